"""What a client asks the engine and what it receives: a request, its choices, their events.

A Request holds a prompt, its SamplingParams (vLLM's names) and `n` Sequences, one per choice;
the engine (engine.py) schedules the sequences, and each step's text reaches the client as
Events through the request's `emit`. Kept apart from the engine's loop so that the HTTP side,
the replicas and the tests name what they send without the machinery that serves it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from flashformer.generate.constraints import Constraint
from flashformer.generate.sampling import GenerationSettings, LogitsProcessor, RowChooser, Thinking
from flashformer.generate.sampling_options import RequestSamplingValues, settings_of_request
from flashformer.serve.paged_cache import adapter_salt
from flashformer.text.detokenizer import Detokenizer

__all__ = [
    "Event",
    "Request",
    "SamplingParams",
    "Sequence",
    "Thinking",
    "TokenLogprob",
    "check_prompt_fits",
    "generation_settings",
    "token_logprobs",
]


@dataclass(frozen=True)
class SamplingParams(RequestSamplingValues):
    """A request's settings in vLLM's names: every sampling option of generate.sampling_options
    (temperature (0: greedy), top_p, top_k, the penalties, ...: keyword-only fields, each at its
    no-op value by default) and these. generation_settings() turns them into the library's
    GenerationSettings, so the server and generate() sample alike."""

    max_tokens: int  # 0: no token (the prompt's log-probabilities alone, with prompt_logprobs)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # the stop tokens are forbidden until this many are generated
    seed: int | None = None
    stop: tuple[str, ...] = ()  # strings that end the text, never returned
    logprobs: int | None = None  # None: none; k: the chosen token's log-probability and the top k
    prompt_logprobs: int | None = None  # None: none; k: every prompt token's, and the top k
    stop_token_ids: tuple[int, ...] = ()  # the tokens that end a sequence (never part of its text)
    constraint: Constraint | None = None  # structured output: the grammar each choice follows
    speculative: bool = True  # False: never drafts, even on a server with a speculative config
    thinking: Thinking | None = None  # the constraint and the budget wait for the reasoning's end
    adapter: str | None = None  # the LoRA adapter it runs with, by its served name (None: the base)


@dataclass
class TokenLogprob:
    token: int
    logprob: float | None  # None: a prompt's first token (nothing predicts it)
    top: list[tuple[int, float]] | None  # the top_logprobs alternatives, best first


@dataclass
class Event:
    """What a client receives. kind "prompt": the prompt's tokens' log-probabilities (logprobs,
    the first None), before anything else; "delta": new text (and its tokens'
    log-probabilities) of choice `index`; "finish": choice `index` ended with `finish_reason`;
    "done": every choice ended (usage holds the token counts); "error": the request failed
    (message). A "finish" that a stop string caused names it (stop)."""

    kind: str
    index: int = 0
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    message: str = ""
    stop: str | None = None


class Request:
    """A prompt and its settings, `n` sequences (choices), and where their events go.

    emit: called from the engine's thread with each Event (the server hands it to its
    event loop). cancel() may be called from any thread: within one step the request's
    sequences stop and their blocks are freed.
    """

    _ids = itertools.count(1)

    def __init__(self, prompt_ids: list[int], params: SamplingParams, n: int, emit: Callable[[Event], None]):
        self.id = next(Request._ids)
        self.prompt_ids, self.params, self.emit = list(prompt_ids), params, emit
        self.settings = generation_settings(params)
        self.process: LogitsProcessor | None = None  # set by Engine.submit, on the model's device
        self.cancelled = threading.Event()
        self.sequences = [Sequence(self, index) for index in range(n)]
        self.completion_tokens = 0

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


class Sequence:
    """One choice of a request: its tokens (prompt + generated), the blocks holding their keys
    and values, how many of them are computed, and its text so far (its detokenizer)."""

    _order = itertools.count()

    def __init__(self, request: Request, index: int):
        self.request, self.index = request, index
        self.tokens = list(request.prompt_ids)
        self.prompt_len = len(self.tokens)
        self.blocks: list[int] = []
        self.computed = 0  # tokens whose keys and values are in the blocks
        self.block_hashes: list[bytes] = []  # the prefix cache's chain hashes of its full blocks
        # what the chain starts from: an adapter's keys and values are its own (paged_cache.adapter_salt)
        self.cache_salt = adapter_salt(request.params.adapter)
        self.registered = 0  # its first blocks registered in (or found in) the prefix cache
        self.window_blocks: list[int] = []  # the window group's table (paged_cache.py), if any
        self.window_registered = 0
        self.long_from: int | None = None  # LongRoPE: its first key written long (scheduler.py)
        self.cached_tokens: int | None = None  # tokens reused at its first admission
        self.detokenizer: Detokenizer | None = None  # set by Engine.submit (it has the tokenizer)
        # its choice of tokens: its grammar's matcher, penalties' history, reasoning (Engine.submit)
        self.chooser: RowChooser | None = None
        self.finish_reason: str | None = None
        self.held_text, self.held_logprobs = "", []  # this step's, sent as one delta at its end
        self.proposer = self.draft_length = None  # its drafts' source and length (speculation.py)
        self.draft_match = 0  # how well its last drafts' source matched (DraftLength's classes)
        self.arrival = next(Sequence._order)
        seed = request.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        # choices of one request differ, and each is reproducible from (seed, index)
        self.generator = torch.Generator().manual_seed((seed * 1_000_003 + index) % 2**63)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def in_prefill(self) -> bool:
        return self.computed < self.prompt_len


def check_prompt_fits(length: int, context: int, pool_tokens: int) -> None:
    """ValueError for a prompt that can never run: empty, the context's length or more, or more
    than the KV pool holds with the first generated token (an engine's, or its replicas')."""
    if length < 1:
        raise ValueError("the prompt is empty: give at least one token")
    if length >= context:
        raise ValueError(
            f"the prompt is {length} tokens; this model's context is {context} tokens "
            f"(prompt and completion together)"
        )
    if length + 1 > pool_tokens:
        raise ValueError(f"the prompt is {length} tokens; the KV pool holds {pool_tokens}")


def generation_settings(params: SamplingParams) -> GenerationSettings:
    """The request's settings in generate()'s terms: the sampling options as they are, temperature
    0 being greedy (settings_of_request); min_tokens forbids the stop tokens (the settings' eos)
    until then."""
    return GenerationSettings(
        **settings_of_request(params),
        logit_bias=dict(params.logit_bias),
        min_new_tokens=params.min_tokens,
        eos_token_id=list(params.stop_token_ids),
    )


def token_logprobs(logits: torch.Tensor, token: int, top: int | None) -> list[TokenLogprob]:
    """The chosen token's log-probability under the model's own distribution (logits (V,),
    before temperature and top-p) and the `top` most likely tokens; [] when top is None."""
    if top is None:
        return []
    log_probs = F.log_softmax(logits, dim=-1)
    best = torch.topk(log_probs, top) if top > 0 else None
    alternatives = [] if best is None else list(zip(best.indices.tolist(), best.values.tolist()))
    return [TokenLogprob(token, float(log_probs[token]), alternatives)]
