"""Speculative decoding in the server: drafts verified inside the batched step.

    flashformer serve FILE --speculative-config '{"method": "ngram", "num_speculative_tokens": 8}'

The configuration has vLLM's names: method, a row of generate.proposers.PROPOSERS: "ngram"
(prompt lookup: the last n tokens, n from prompt_lookup_max down to prompt_lookup_min, found
earlier in the sequence; what followed them is drafted), "draft_model" (a smaller model with the
same tokenizer, "model": its path, "quantization": how it loads, by default as the served model,
by checkpoints.loading.load_draft_model; each drafting sequence keeps its own session of it, a
static KV cache as long as its prompt and answer), or another row by its name; num_speculative_tokens
(the most drafts a step checks per sequence); disable_by_batch_size (4: speculation stops while a
step decodes more sequences than this, where it stopped paying on this CPU; below it the draft
length weighs the batch too, see below). A request opts out with "speculative": false.

The engine (engine.py, its packed step) feeds each drafting sequence's last token and drafts in
the same forward as everyone else's rows and gets every one of its rows' logits back; the tokens
are then chosen row by row exactly as plain steps would choose them (the same processors,
grammar, history), up to the first draft the model would not have chosen. Only greedy requests
draft: their tokens are plain greedy's whatever the batch, so the server stays batch invariant
(a sampled request's draws would depend on whether its step drafted, hence on the batch).
How many drafts each sequence offers follows generate.speculative's DraftLength: the
acceptance of its recent drafts against the measured cost of a row, in a step of that many
sequences (in a large batch a draft row costs nearly what a sequence's own row does, so only
drafts that are nearly always kept are offered).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from flashformer.generate.proposers import PROPOSERS, ProposerInputs
from flashformer.generate.speculative import DraftLength, row_cost
from flashformer.model.quantize import MODES

# measured (docs/benchmarks.md, "Speculative decoding": SmolLM2 Q4_1, the copying workloads, 2
# threads): with drafts 1.65x at 1 client, 1.36x at 2, 1.12x at 4, 0.97x at 8, 0.94x at 16
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
METHODS = tuple(PROPOSERS)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 8
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None  # draft_model: the draft's file or folder (the same tokenizer)
    quantization: str | None = None  # draft_model: how it loads (None: as the served model)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """--speculative-config's JSON, every field checked (errors name it)."""
        try:
            given = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--speculative-config: not JSON ({error}): {text!r}") from None
        if not isinstance(given, dict):
            raise ValueError(f"--speculative-config: expected a JSON object; got {text!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(given) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown field {unknown[0]!r}; known: {sorted(known)}")
        method = given.get("method", "ngram")
        if method not in METHODS:
            raise ValueError(f"--speculative-config: method must be one of {METHODS}; got {method!r}")
        if PROPOSERS[method].needs_model and not isinstance(given.get("model"), str):
            raise ValueError(f'--speculative-config: method {method!r} needs "model": the draft\'s path')
        if not PROPOSERS[method].needs_model and ("model" in given or "quantization" in given):
            needing = " or ".join(repr(k.method) for k in PROPOSERS.values() if k.needs_model)
            raise ValueError(f'--speculative-config: "model" and "quantization" go with method {needing}')
        quantization = given.get("quantization")
        if quantization is not None and quantization not in MODES:
            raise ValueError(
                f"--speculative-config: quantization must be one of {MODES}; got {quantization!r}"
            )
        config = cls(**given)
        for name in (
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "disable_by_batch_size",
        ):
            value = getattr(config, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--speculative-config: {name} must be an int >= 1; got {value!r}")
        if config.prompt_lookup_min > config.prompt_lookup_max:
            raise ValueError(
                f"--speculative-config: prompt_lookup_min ({config.prompt_lookup_min}) must be at most "
                f"prompt_lookup_max ({config.prompt_lookup_max})"
            )
        return config


class Speculator:
    """The engine's drafts: each greedy sequence's proposer (its n-gram index, or the draft
    model's session over its tokens) and draft length, kept on the sequence.

    draft: the draft model, for method draft_model (the same vocabulary as `model`)."""

    def __init__(self, config: SpeculativeConfig, model, draft=None):
        self.kind = PROPOSERS[config.method]
        if self.kind.needs_model != (draft is not None):
            raise ValueError(f"a draft model goes with method {config.method!r}, and that method needs one")
        if draft is not None and draft.config.vocab_size != model.config.vocab_size:
            raise ValueError(
                f"--speculative-config: the draft's vocabulary ({draft.config.vocab_size} tokens) must be the "
                f"served model's ({model.config.vocab_size}): the same tokenizer"
            )
        self.config, self.draft = config, draft
        self.cost = _measured_row_cost(model, self.kind, config.num_speculative_tokens, draft)

    def drafts(self, sequence, room: int, batch: int) -> list[int]:
        """Up to `room` drafts for `sequence` in a step of `batch` decoding sequences (none for
        one that samples or opted out)."""
        request = sequence.request
        if request.settings.do_sample or not request.params.speculative or room <= 0:
            return []
        limit = self.config.num_speculative_tokens
        if sequence.proposer is None:  # a draft model's KV cache: room for the answer and a round of drafts
            config, prompt = self.config, torch.tensor([request.prompt_ids])
            inputs = ProposerInputs(
                prompt,
                request.settings,
                None,
                request.params.max_tokens + limit,
                config.prompt_lookup_max,
                config.prompt_lookup_min,
                self.draft,
            )
            sequence.proposer = self.kind.make(inputs)
            sequence.draft_length = DraftLength(limit, self.cost)
        sequence.draft_match = sequence.proposer.match(sequence.tokens)
        k = min(room, sequence.draft_length.next(batch, sequence.draft_match))
        return sequence.proposer.draft(sequence.tokens, k)[0] if k > 0 else []

    def step_drafts(self, decoding: list, pool, context: int, long_rope_after: int | None = None) -> dict:
        """A step's drafts per decoding sequence, each with the blocks of `pool` to hold them: none
        past disable_by_batch_size sequences, nor beyond a sequence's max_tokens, the `context` or
        the free blocks (drafts never preempt). With LongRoPE (long_rope_after: its original
        context) a verify never crosses the switch to the long table: a forward ending past it
        would turn the sequence's last token by the long table, where a plain step turns it short."""
        if len(decoding) > self.config.disable_by_batch_size:
            return {}
        found = {}
        for sequence in decoding:
            if sequence.in_prefill or sequence.computed != len(sequence.tokens) - 1:
                continue  # a replay after preemption: not caught up yet
            room = min(
                sequence.request.params.max_tokens - len(sequence.generated) - 1,
                context - len(sequence.tokens),
            )
            if long_rope_after is not None and len(sequence.tokens) <= long_rope_after:
                room = min(room, long_rope_after - len(sequence.tokens))
            guesses = self.drafts(sequence, room, len(decoding))
            while guesses and pool.blocks_for(len(sequence.tokens) + len(guesses)) > len(sequence.blocks):
                block = pool.allocate(1)
                if block is None:
                    guesses = guesses[: len(sequence.blocks) * pool.block_size - len(sequence.tokens)]
                    break
                sequence.blocks += block
            if guesses:
                found[sequence] = guesses
        return found

    def verify(self, sequence, guesses: list[int], rows: torch.Tensor, choose) -> int:
        """rows (1 + k, V): the logits after the sequence's last token and after each of its k
        drafts (guesses). Each row's token is chosen as a plain step would choose it (choose(sequence,
        row): the engine's own, which appends and streams it), up to the first that is not the
        draft there; an accepted draft's keys are in the cache already. How many drafts it kept."""
        kept = 0
        for i, row_logits in enumerate(rows):
            choose(sequence, row_logits)
            if sequence.finish_reason is not None or i == len(guesses) or sequence.tokens[-1] != guesses[i]:
                break
            kept += 1
            sequence.computed += 1
        sequence.draft_length.observe(len(guesses), kept, sequence.draft_match)
        return kept


def _measured_row_cost(model, kind, limit: int, draft=None) -> float:
    """generate.speculative.row_cost on a short prompt of the model (timed once per model; with a
    draft model its step's cost is added)."""
    from flashformer.generate.sampling import settings_from
    from flashformer.generate.session import DecoderSession

    settings = settings_from(model, max_new_tokens=limit + 2, eos_token_id=[])
    ids = torch.zeros(1, 64, dtype=torch.long, device=next(model.parameters()).device)
    session = DecoderSession(model, ids, None, settings)
    session.prefill()
    proposer = kind.make(ProposerInputs(ids, settings, None, limit + 2, 1, 1, draft))
    return row_cost(session, proposer, limit)
