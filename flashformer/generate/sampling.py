"""From logits to the next token: the settings of a generate() call, and
what turns a step's logits into scores to pick from.

    settings = settings_from(model, max_new_tokens=50, do_sample=True, top_p=0.9)
    process = LogitsProcessor(settings, device)
    history = TokenHistory.for_settings(settings, prompt, real, vocab)  # None when no penalty reads it
    scores = process(logits, history, new_tokens)   # bias, penalties, min length, temperature, filters
    tokens = choose_tokens(scores, settings.do_sample, generator)   # (B,)

Every setting has transformers' name, default and meaning (OpenAI's for
logit_bias and the presence and frequency penalties, which transformers
lacks), and is checked before any compute; errors name the argument. The
sampling options (temperature, top-k, top-p, the penalties, ...) are the rows of
sampling_options.OPTIONS, each with its range and its processor. The server
builds the same settings from a request (serve/request.py) and chooses each
sequence's tokens with a RowChooser, the TokenChooser's scores for one row, so a
request and a generate() call with the same settings pick the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from flashformer.generate.constraints import (
    Constraint,
    check_constraint,
    constrain,
    keep_an_end,
    matchers_for,
)
from flashformer.generate.sampling_options import (
    OPTIONS,
    SamplingValues,
    filter_min_p,
    filter_top_k,
    filter_top_p,
    penalize_frequency,
    penalize_presence,
    penalize_presence_and_frequency,
    penalize_repetition,
)
from flashformer.kernels import kv_blocks

# the score changes, importable from here as before (sampling_options.py holds them)
__all__ = [
    "GenerationSettings",
    "LogitsProcessor",
    "RowChooser",
    "Thinking",
    "TokenChooser",
    "TokenHistory",
    "choose_tokens",
    "filter_min_p",
    "filter_top_k",
    "filter_top_p",
    "first_argmax",
    "penalize_frequency",
    "penalize_presence",
    "penalize_presence_and_frequency",
    "penalize_repetition",
    "settings_from",
]

# ---- settings ----


@dataclass
class GenerationSettings(SamplingValues):
    """The knobs of one generate() call, with transformers' names and defaults: every sampling
    option of sampling_options.OPTIONS (temperature, top_k, top_p, min_p, the penalties, ...,
    keyword-only fields inherited from SamplingValues), and these."""

    max_new_tokens: int = 20
    min_new_tokens: int = 0
    do_sample: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, as OpenAI's
    ignore_eos: bool = False  # keep going past eos tokens (settings_from then stops on none)
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in transformers
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    decoder_start_token_id: int | None = None
    prefill_chunk_size: int | None = None
    # native: a decoder with a native form runs each forward as one C++ call (model/native.py);
    # False runs its PyTorch modules eagerly. compile: torch.compile the decode step instead.
    native: bool = True
    compile: bool = False
    # a grammar the text must follow (generate.constraints): one Constraint for every row, or a
    # list with one per prompt (None: a free row); its mask comes before the logits processors
    constraint: Constraint | list[Constraint | None] | None = None
    # speculative decoding (speculative.py), transformers' names: n-gram lookup drafts of up to
    # prompt_lookup_num_tokens tokens, matching up to max_matching_ngram_size tokens; or a draft
    # model with the same tokenizer (assistant_model) running up to num_assistant_tokens ahead;
    # speculative_method: a row of proposers.PROPOSERS by name (None: the one these ask for)
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int = 4  # llama.cpp's lookup matches up to 4 too
    assistant_model: object | None = None
    num_assistant_tokens: int = 5
    speculative_method: str | None = None
    # the KV cache's element types for keys and values, llama.cpp's names (kernels/kv_blocks.py:
    # f32, f16, q8_0, q4_0); None: the model's own (generate.cache.cache_dtype)
    cache_type_k: str | None = None
    cache_type_v: str | None = None


def settings_from(model, **kwargs) -> GenerationSettings:
    """Settings with the model config's token ids filled in where not given,
    as transformers does; every value is checked."""
    config = model.config
    eos = kwargs.pop("eos_token_id", None)
    if eos is None:
        eos = _in_vocabulary(config.eos_token_id, config.vocab_size)
    eos_list = _token_list("eos_token_id", eos, config.vocab_size)
    pad = kwargs.pop("pad_token_id", None)
    if pad is None:
        pad = _in_vocabulary(config.pad_token_id, config.vocab_size)
    if pad is None and eos_list:
        pad = eos_list[0]  # finished rows need some filler; transformers uses eos too
    start = kwargs.pop("decoder_start_token_id", None)
    start = config.decoder_start_token_id if start is None else start
    if kwargs.get("ignore_eos") is True:
        eos_list = []  # nothing ends a row early; pad keeps the eos id chosen above
    settings = GenerationSettings(
        eos_token_id=eos_list, pad_token_id=pad, decoder_start_token_id=start, **kwargs
    )
    check_settings(settings, model)
    return settings


def check_settings(s: GenerationSettings, model) -> None:
    vocab = model.config.vocab_size
    for argument in ("cache_type_k", "cache_type_v"):
        if getattr(s, argument) is not None:
            kv_blocks.check_type(getattr(s, argument), argument)
    _check_int("max_new_tokens", s.max_new_tokens, 0)
    _check_int("min_new_tokens", s.min_new_tokens, 0)
    _check_int("num_beams", s.num_beams, 1)
    if not isinstance(s.do_sample, bool):
        raise ValueError(f"do_sample must be True or False; got {s.do_sample!r}")
    for option in OPTIONS:  # the temperature matters only when sampling (greedy ignores it)
        if s.do_sample or option.checked_when_greedy:
            option.check(getattr(s, option.name))
    check_logit_bias(s.logit_bias, vocab)
    if not isinstance(s.ignore_eos, bool):
        raise ValueError(f"ignore_eos must be True or False; got {s.ignore_eos!r}")
    if not _is_number(s.length_penalty) or not math.isfinite(s.length_penalty):
        raise ValueError(f"length_penalty must be a finite number; got {s.length_penalty!r}")
    if s.early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never'; got {s.early_stopping!r}")
    if s.pad_token_id is not None and not (
        isinstance(s.pad_token_id, int)
        and not isinstance(s.pad_token_id, bool)
        and 0 <= s.pad_token_id < vocab
    ):
        raise ValueError(f"pad_token_id must be a token id in [0, {vocab}); got {s.pad_token_id!r}")
    if s.prefill_chunk_size is not None:
        _check_int("prefill_chunk_size", s.prefill_chunk_size, 1)
    if not isinstance(s.compile, bool):
        raise ValueError(f"compile must be True or False; got {s.compile!r}")
    if not isinstance(s.native, bool):
        raise ValueError(f"native must be True or False; got {s.native!r}")
    check_constraint(s.constraint)
    check_speculation_numbers(s)
    if model.config.arch == "encoder-decoder":
        start = s.decoder_start_token_id
        if not (isinstance(start, int) and not isinstance(start, bool) and 0 <= start < vocab):
            raise ValueError(
                f"an encoder-decoder needs decoder_start_token_id, a token id in [0, {vocab}) "
                f"(from the argument or the model's config); got {start!r}"
            )


def check_speculation_numbers(s: GenerationSettings) -> None:
    """The speculative settings' counts (which proposer they ask for, and its checks against the
    model: proposers.check_speculation, at generate()'s and a chat's start)."""
    if s.prompt_lookup_num_tokens is not None:  # 0 or None: no lookup
        _check_int("prompt_lookup_num_tokens", s.prompt_lookup_num_tokens, 0)
    _check_int("max_matching_ngram_size", s.max_matching_ngram_size, 1)
    _check_int("num_assistant_tokens", s.num_assistant_tokens, 1)
    if s.speculative_method is not None and not isinstance(s.speculative_method, str):
        raise ValueError(f"speculative_method must be a proposer's name; got {s.speculative_method!r}")


def check_logit_bias(bias, vocab: int) -> None:
    """A logit_bias maps token ids in the vocabulary to finite numbers in [-100, 100] (OpenAI's
    range: -100 bans a token, 100 all but forces it)."""
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to numbers; got {bias!r}")
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise ValueError(f"logit_bias: {token!r} is not a token id in [0, {vocab})")
        if not (_is_number(value) and -100 <= value <= 100):
            raise ValueError(f"logit_bias[{token}] must be a number in [-100, 100]; got {value!r}")


def _in_vocabulary(ids, vocab: int):
    """A config's token id(s), without those the model cannot produce.

    A preset shrunk to a small vocabulary can keep a family's eos id (GPT-2's
    50256 with 1000 tokens): such an id could never end a sequence, so it is
    dropped rather than refused. Ids given as arguments are checked instead.
    """
    if ids is None or isinstance(ids, int):
        return ids if ids is None or 0 <= ids < vocab else None
    return [i for i in ids if 0 <= i < vocab]


def _token_list(name: str, value, vocab: int) -> list[int]:
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if value is None:
        return []
    if not isinstance(values, (list, tuple)) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < vocab for v in values
    ):
        raise ValueError(f"{name} must be a token id in [0, {vocab}) or a list of them; got {value!r}")
    return list(values)


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---- from logits to scores ----


def needs_history(s: GenerationSettings) -> bool:
    """Whether a penalty of `s` reads the tokens seen so far (a TokenHistory)."""
    return any(o.stage == "penalty" and o.active(getattr(s, o.name)) for o in OPTIONS)


class TokenHistory:
    """What the penalties read: which tokens each row has seen, prompt included (B, vocab) bool,
    for the repetition penalty; how often each was generated (B, vocab) int32, for OpenAI's
    presence and frequency penalties, which count the generated tokens only.

    Updated per step (one scatter), never recomputed from the whole sequence.
    Padding is not part of a prompt, so it is not penalized.
    """

    def __init__(self, tokens: Tensor, real: Tensor | None, vocab: int):
        batch = tokens.shape[0]
        # padding goes to an extra column that is dropped: scatter never sees a conflicting write
        index = tokens if real is None else tokens.masked_fill(~real.bool(), vocab)
        seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=tokens.device)
        self.seen = seen.scatter_(1, index, True)[:, :vocab]  # (B, V)
        self.counts = torch.zeros(batch, vocab, dtype=torch.int32, device=tokens.device)  # (B, V)

    @staticmethod
    def for_settings(s: GenerationSettings, tokens: Tensor, real: Tensor | None, vocab: int):
        """A history for the prompts `tokens` (B, P), or None when no penalty of `s` reads one."""
        return TokenHistory(tokens, real, vocab) if needs_history(s) else None

    def add(self, tokens: Tensor) -> None:  # tokens (B,)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        self.seen[rows, tokens] = True
        self.counts[rows, tokens] += 1

    def reorder(self, rows: Tensor) -> None:
        self.seen, self.counts = self.seen[rows], self.counts[rows]

    def expand(self, times: int) -> None:
        self.seen = self.seen.repeat_interleave(times, dim=0)
        self.counts = self.counts.repeat_interleave(times, dim=0)


class LogitsProcessor:
    """The score changes of one generate() call or request: logit_bias, the penalties of
    OPTIONS (vLLM's order: bias, then penalties), min_new_tokens (eos forbidden), then, when
    sampling, the warpers of OPTIONS in transformers' order (temperature, top-k, top-p, ...).
    Greedy choice skips the warpers (none changes the argmax). Only the options whose value
    changes something are applied."""

    def __init__(self, s: GenerationSettings, device, min_keep: int = 1):
        self.s, self.min_keep = s, min_keep
        active = [(o, getattr(s, o.name)) for o in OPTIONS if o.active(getattr(s, o.name))]
        self.penalties = [(o, value) for o, value in active if o.stage == "penalty"]
        self.warpers = [(o, value) for o, value in active if o.stage == "warper"]
        self.eos = torch.tensor(s.eos_token_id, dtype=torch.long, device=device)
        bias = s.logit_bias or {}
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long, device=device)  # (N,)
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32, device=device)  # (N,)

    def changes_scores(self, new_tokens: int) -> bool:
        """Whether __call__ changes any score at step `new_tokens` (when it does not, a greedy
        choice is the logits' own argmax: the server finds it for many rows at once)."""
        s = self.s
        forbids_eos = new_tokens < s.min_new_tokens and bool(s.eos_token_id)
        return (
            bool(s.logit_bias) or bool(self.penalties) or forbids_eos or (s.do_sample and bool(self.warpers))
        )

    def __call__(self, scores: Tensor, history: TokenHistory | None, new_tokens: int) -> Tensor:
        s = self.s
        if len(self.bias_ids):
            added = self.bias_values.to(scores.dtype).expand(scores.shape[0], -1)  # (B, N)
            scores = scores.index_add(1, self.bias_ids, added)
        for option, value in self.penalties:
            scores = option.apply(scores, value, history, self.min_keep)
        if new_tokens < s.min_new_tokens and len(self.eos):
            scores = scores.index_fill(1, self.eos, -math.inf)
        if s.do_sample:
            for option, value in self.warpers:
                scores = option.apply(scores, value, history, self.min_keep)
        return scores


# ---- choosing ----


class TokenChooser:
    """What turns a step's logits into the next tokens of every row, in the order each step
    applies it: the grammar's mask (constraints), the logits processors (bias, penalties over the
    history, min_new_tokens, the warpers), then, once a token is chosen, its commit: pad for the
    rows that have ended, the grammar's advance, eos, the history. Plain decoding (stream_tokens)
    and speculative decoding (speculative.py) choose through the same one, so a verified row's
    scores are exactly what a plain step would have seen."""

    def __init__(self, s: GenerationSettings, batch: int, device, history: TokenHistory | None):
        self.s, self.history = s, history
        self.process = LogitsProcessor(s, device)
        self.matchers = matchers_for(s.constraint, batch)
        self.unfinished: Tensor | None = None  # (B,) bool, once eos can end a row

    def scores(self, logits: Tensor, index: int) -> Tensor:
        """logits (B, V) of new token `index` -> the scores (B, V) to choose from."""
        if self.matchers is None:
            return self.process(logits, self.history, index)
        matchers = _still_running(self.matchers, self.unfinished)
        return constrained_scores(self.process, logits, self.history, index, matchers)

    def commit(self, tokens: Tensor, index: int) -> Tensor:
        """The chosen tokens (B,) of new token `index` -> what the rows emit (pad where ended)."""
        eos = self.process.eos
        if eos.numel():
            if self.unfinished is None:
                self.unfinished = torch.ones_like(tokens, dtype=torch.bool)
            tokens = torch.where(self.unfinished, tokens, self.s.pad_token_id)
        if self.matchers is not None:
            for row, (matcher, token) in enumerate(
                zip(_still_running(self.matchers, self.unfinished), tokens.tolist())
            ):
                if matcher is not None and not matcher.advance(token):
                    raise RuntimeError(
                        f"constraint: the grammar engine stopped on row {row} at new token {index}: {matcher.error}"
                    )
        if eos.numel():
            self.unfinished = self.unfinished & ~torch.isin(tokens, eos)
        if self.history is not None:
            self.history.add(tokens)
        return tokens

    @property
    def all_ended(self) -> bool:
        return self.unfinished is not None and not bool(self.unfinished.any())


def constrained_scores(
    process: LogitsProcessor,
    logits: Tensor,
    history: TokenHistory | None,
    index: int,
    matchers: list,
    reopen: int | None = None,
) -> Tensor:
    """The scores (B, V) of a constrained step: the grammar's mask first, so that the processors
    see only what it allows (`reopen`: a token id the mask may not take away, a reasoning's
    opening tag), then the processors; before min_new_tokens an end stays possible."""
    masked = constrain(logits, matchers, process.eos)
    if reopen is not None:
        masked[:, reopen] = logits[:, reopen]
    scores = process(masked, history, index)
    if index < process.s.min_new_tokens:
        scores = keep_an_end(scores, masked)
    return scores


@dataclass(frozen=True)
class Thinking:
    """A thinking model's tags (token ids) for a sequence whose answer is constrained, the grammar
    starting after `end` ("before": `start` may come first), or whose reasoning has a budget."""

    start: int
    end: int
    state: str  # "thinking" | "before" ("answer" needs no Thinking)
    budget: int | None = None


class RowChooser:
    """One sequence's choice of its tokens, one at a time, with its own state: the server's rows,
    each a request of its own in a batch. The scores are TokenChooser's (the grammar's mask, the
    processors, min_new_tokens' rule), from the sequence's matcher and penalties' history (made
    at its first choice), drawn with its own generator; a thinking model's reasoning (phase
    "thinking", or "before" it opens) is left free of the grammar, and ended at its budget.

    process: the request's LogitsProcessor (shared by its sequences); matcher: the sequence's
    place in its grammar (None: free); thinking: the reasoning's tags and budget (None: none)."""

    def __init__(self, process: LogitsProcessor, generator, matcher=None, thinking: Thinking | None = None):
        self.process, self.generator, self.matcher, self.thinking = process, generator, matcher, thinking
        self.s = process.s
        self.phase = thinking and thinking.state  # None once the answer has begun
        self.thought = 0  # reasoning tokens so far
        self.history: TokenHistory | None = None

    def plain(self, index: int) -> bool:
        """Whether new token `index` is the plain argmax of its logits: greedy, no grammar and no
        reasoning to track, and a processor that changes no score there (the server finds those
        rows' tokens in one call, choose_tokens on all of them)."""
        return (
            not self.s.do_sample
            and self.matcher is None
            and self.phase is None
            and not self.process.changes_scores(index)
        )

    def choose(self, logits: Tensor, tokens: list[int], index: int) -> int:
        """New token `index` from one row's logits (V,) float32, after `tokens` (the prompt, then
        the `index` generated so far)."""
        thinking, phase = self.thinking, self.phase
        if self.history is None and needs_history(self.s):
            self.history = _history(tokens, index, logits.shape[-1], logits.device)
        if self.matcher is None or phase == "thinking":
            scores = self.process(logits[None], self.history, index)  # (1, V)
        else:  # only a constrained row is masked: the others pay nothing for it
            reopen = thinking.start if phase == "before" else None  # the reasoning may open instead
            scores = constrained_scores(
                self.process, logits[None], self.history, index, [self.matcher], reopen
            )
        token = int(choose_tokens(scores, self.s.do_sample, self.generator)[0])
        spent = phase == "thinking" and thinking.budget is not None and self.thought >= thinking.budget
        return thinking.end if spent else token  # a spent budget ends the reasoning

    def take(self, token: int, device) -> None:
        """Follow the chosen token (however it was chosen): the reasoning's phase, the grammar
        (an answer's token), the penalties' history (on `device`, the logits')."""
        phase = self.phase
        if phase is not None:  # the reasoning goes on until `end`; "before": it opens at `start`
            self.thought += phase == "thinking"
            opened = token == self.thinking.start or (phase == "thinking" and token != self.thinking.end)
            self.phase = "thinking" if opened else None
        if self.matcher is not None and phase != "thinking" and self.phase is None:
            self.matcher.advance(token)
        if self.history is not None:
            self.history.add(torch.tensor([token], device=device))


def _history(tokens: list[int], index: int, vocab: int, device) -> TokenHistory:
    """The penalties' record of a row's prompt and generated tokens (tokens: both; index: how
    many were generated), made at its first choice, then one token added per choice."""
    prompt_len = len(tokens) - index
    history = TokenHistory(torch.tensor([tokens[:prompt_len]], device=device), None, vocab)  # (1, P)
    for token in tokens[prompt_len:]:  # none: a row's first choice comes before any token
        history.add(torch.tensor([token], device=device))
    return history


def _still_running(matchers: list, unfinished: Tensor | None) -> list:
    """The matchers of the rows that have not ended (an ended row's pad tokens are no text)."""
    if unfinished is None:
        return matchers
    return [m if alive else None for m, alive in zip(matchers, unfinished.tolist())]


def choose_tokens(scores: Tensor, do_sample: bool, generator: torch.Generator | None) -> Tensor:
    """The next token of every row from its processed scores (B, vocab) -> (B,): the highest
    score, or with do_sample a draw from softmax(scores) with the generator (generate() and the
    server choose here, so a row's token is the same whoever asks)."""
    if do_sample:
        return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1)
    return first_argmax(scores)


# scores per chunk of first_argmax: small enough that finding the winner inside one is cheap
ARGMAX_CHUNK = 512


def first_argmax(scores: Tensor) -> Tensor:
    """scores.argmax(dim=-1) for (B, V) scores, the same indices (the first of equal maxima, a
    NaN above everything, the first NaN), in two passes that vectorize.

    PyTorch's argmax on the CPU tracks an index beside every value and runs at about 1.2
    billion scores a second: 0.23 ms for one row of Gemma's 262,144, 3.6 ms of a 16-row
    serving step (a tenth of it). amax vectorizes: the maximum of each chunk of ARGMAX_CHUNK
    scores, the first chunk holding the row's maximum (argmax over the chunk maxima, which
    are few), then the first index inside that chunk. A tail shorter than a chunk wins only
    with a greater score (or a NaN against none), so the first index still wins ties.

    float32 scores on the CPU take numpy's argmax instead, which keeps the same rule in one
    single-threaded pass: 4 us for a row of 49,152 where the chunked passes take 23 us, and
    right after a decode step (whose weights have pushed PyTorch's dispatch out of the caches,
    and whose cores the server's other threads then want) 0.09 ms against 0.27-0.30 for one
    row, 1.8-2.0 ms against 1.3-15 ms for Gemma's 16 rows (torch's two threads wait for each
    other when one loses its core)."""
    rows, vocab = scores.shape
    if scores.dtype == torch.float32 and scores.device.type == "cpu":
        return torch.from_numpy(scores.detach().numpy().argmax(axis=-1))
    chunks = vocab // ARGMAX_CHUNK
    if chunks < 2 or scores.stride(-1) != 1:
        return scores.argmax(dim=-1)
    body = scores[:, : chunks * ARGMAX_CHUNK].unflatten(-1, (chunks, ARGMAX_CHUNK))  # (B, n, C)
    chunk = body.amax(dim=-1).argmax(dim=-1)  # (B,)
    every = torch.arange(rows, device=scores.device)
    found = chunk * ARGMAX_CHUNK + body[every, chunk].argmax(dim=-1)  # (B,)
    if chunks * ARGMAX_CHUNK == vocab:
        return found
    tail = scores[:, chunks * ARGMAX_CHUNK :].argmax(dim=-1) + chunks * ARGMAX_CHUNK  # (B,)
    best, rival = scores[every, found], scores[every, tail]
    return torch.where((rival > best) | (rival.isnan() & ~best.isnan()), tail, found)


def make_generator(generator, seed, device) -> torch.Generator | None:
    if generator is not None and seed is not None:
        raise ValueError("give generator or seed, not both")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator; got {type(generator).__name__}")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int; got {seed!r}")
        return torch.Generator(device=device).manual_seed(seed)
    return generator
