"""Speculative decoding's proposers: what guesses the next tokens, one table of them.

    model.generate(ids, prompt_lookup_num_tokens=8)                        # "ngram", transformers' name
    model.generate(ids, assistant_model=draft)                             # "draft_model"
    model.generate(ids, prompt_lookup_num_tokens=8, speculative_method="suffix")
    flashformer serve FILE --speculative-config '{"method": "suffix"}'     # vLLM's names

A proposer answers two questions about a context (the prompt and the tokens so far, each call
continuing the last): match(context), how well the place its drafts come from agrees with the
context's end (DraftLength counts each length's kept drafts apart; 0: nothing to draft), and
draft(context, k), up to k drafts and, for a proposer that samples, their distributions q (k, V)
(None: a point mass). A row of PROPOSERS names it as vLLM's --speculative-config does (method),
says which of transformers' generate() arguments asks for it alone (asked_by) and which setting
bounds its drafts (limit), whether it needs a draft model, and builds it. generate(), the server's
configuration and the CLI's flags are derived from the table: a new proposer is a module and a row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from flashformer.generate.draft_model import DraftModel
from flashformer.generate.prompt_lookup import PromptLookup
from flashformer.generate.sampling import GenerationSettings
from flashformer.generate.suffix_lookup import SuffixLookup

__all__ = [
    "PROPOSERS",
    "Proposer",
    "ProposerInputs",
    "ProposerKind",
    "check_speculation",
    "drafting",
    "proposer_kind",
]


class Proposer(Protocol):
    def match(self, context: list[int]) -> int: ...

    def draft(self, context: list[int], k: int) -> tuple[list[int], Tensor | None]: ...


@dataclass
class ProposerInputs:
    """What a proposer may be built from: the prompt (1, P), the target's settings (greedy or
    sampling, temperature, native), the generator its draws use, the tokens a draft model's cache
    must hold beyond the prompt (room), the lookups' n-gram sizes, and the draft model."""

    prompt: Tensor
    settings: GenerationSettings
    generator: object = None
    room: int = 0
    max_ngram: int = 4
    min_ngram: int = 1
    draft_model: object = None


@dataclass(frozen=True)
class ProposerKind:
    method: str  # vLLM's --speculative-config "method"; generate()'s speculative_method
    asked_by: str | None  # transformers' generate() argument that alone asks for it (None: none)
    limit: str  # the generate() setting that bounds its drafts per round
    needs_model: bool  # a draft model: generate()'s assistant_model, the configuration's "model"
    make: Callable[[ProposerInputs], Proposer]
    summary: str


PROPOSERS: dict[str, ProposerKind] = {
    kind.method: kind
    for kind in (
        ProposerKind(
            "ngram",
            "prompt_lookup_num_tokens",
            "prompt_lookup_num_tokens",
            False,
            lambda i: PromptLookup([], i.max_ngram, i.min_ngram),
            "prompt lookup: what followed the latest earlier occurrence of the last n tokens",
        ),
        ProposerKind(
            "draft_model",
            "assistant_model",
            "num_assistant_tokens",
            True,
            lambda i: DraftModel(i.draft_model, i.prompt, i.settings, i.generator, i.room),
            "a smaller model with the same tokenizer decoding ahead",
        ),
        ProposerKind(
            "suffix",
            None,
            "prompt_lookup_num_tokens",
            False,
            lambda i: SuffixLookup([]),
            "longest match: what followed the longest earlier run of the context's last tokens",
        ),
    )
}


def proposer_kind(s: GenerationSettings) -> ProposerKind | None:
    """The row `s` asks for: speculative_method's, else the one whose transformers argument is
    given (prompt_lookup_num_tokens: ngram, assistant_model: draft_model); None: no speculation.
    Errors name the argument, the value and the choices."""
    if s.speculative_method is not None:
        kind = PROPOSERS.get(s.speculative_method)
        if kind is None:
            raise ValueError(
                f"speculative_method must be one of {sorted(PROPOSERS)}; got {s.speculative_method!r}"
            )
        return kind
    asked = [kind for kind in PROPOSERS.values() if kind.asked_by and _given(getattr(s, kind.asked_by))]
    if len(asked) > 1:
        raise ValueError(f"give {' or '.join(kind.asked_by for kind in asked)}, not both")
    return asked[0] if asked else None


def drafting(s: GenerationSettings) -> bool:
    """Whether `s` asks for speculative decoding."""
    return proposer_kind(s) is not None


def check_speculation(s: GenerationSettings, model) -> None:
    """The speculative settings, against the model (errors name the argument): the row asked for,
    its draft bound given, a draft model where it needs one and none where it does not."""
    kind = proposer_kind(s)
    if kind is None:
        return
    if not getattr(s, kind.limit):
        raise ValueError(
            f"speculative_method {kind.method!r} drafts up to {kind.limit} tokens: give it (>= 1)"
        )
    if kind.needs_model != (s.assistant_model is not None):
        needing = [k.method for k in PROPOSERS.values() if k.needs_model]
        raise ValueError(
            f"assistant_model goes with speculative_method in {needing}, and they need one; "
            f"got speculative_method {kind.method!r} and assistant_model {type(s.assistant_model).__name__}"
        )
    if s.num_beams != 1:
        raise ValueError(
            f"speculative decoding picks one token at a time: num_beams must be 1; got {s.num_beams}"
        )
    if model.config.arch != "decoder":
        raise ValueError(f"speculative decoding needs a decoder-only model; got arch {model.config.arch!r}")
    if "conv" in (model.config.layer_types or ()):  # a conv state cannot take back rejected drafts
        raise ValueError(
            "speculative decoding rewinds the cache after rejected drafts, and this model's conv layers "
            "(LFM2's short convolutions, layer_types 'conv') keep a state that cannot rewind yet"
        )
    draft = s.assistant_model
    if draft is not None:
        config = getattr(draft, "config", None)
        if config is None or getattr(config, "arch", None) != "decoder":
            raise ValueError("assistant_model must be a flashformer decoder model (GPT-2, LLaMA, ...)")
        if config.vocab_size != model.config.vocab_size:
            raise ValueError(
                f"assistant_model must share the model's tokenizer: its vocab_size is {config.vocab_size}, "
                f"the model's {model.config.vocab_size}"
            )
        if next(draft.parameters()).device != next(model.parameters()).device:
            raise ValueError("assistant_model must be on the model's device")


def _given(value) -> bool:
    """Whether a transformers argument asks for speculation: a positive count or an object."""
    return value is not None and value is not False and value != 0
