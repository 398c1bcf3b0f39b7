"""Every sampling option, declared once, beside the function that applies it.

A row of OPTIONS is one option: its name (transformers', OpenAI's or vLLM's: generate()'s keyword
and the server's request field), its type, generate()'s default, the value that changes nothing,
its valid range, its help text, which APIs expose it, and its processor. Everything else is
derived from the table:

    generate()'s keywords          GenerationSettings' fields (sampling.py), checked by range
    the logits processor           penalties always, warpers when sampling, in the table's order
    the server's request fields    serve/http/protocol.py's Sampling (pydantic, 400 by name)
    the server's SamplingParams    serve/engine.py (a request's null is the no-op value)
    the CLI's flags                `generate` and `chat` (cli/arguments.py), where `cli` is set

Adding an option is a row here and its processor (a function of the scores). The options that
are not a number with a range stay in sampling.py: logit_bias (a map of token ids), min_new_tokens
(OpenAI's min_tokens: eos forbidden), ignore_eos, the stop tokens, beams and speculation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# ---- the processors: scores (B, V) in, scores out ----


def penalize_repetition(scores: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL's penalty (Keskar et al., 2019), as transformers applies it: a seen
    token's score is divided by the penalty if positive, multiplied if negative."""
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalized, scores)


def penalize_frequency(scores: Tensor, counts: Tensor, frequency: float) -> Tensor:
    """OpenAI's frequency penalty: each token's score loses frequency x the times it was
    generated (counts (B, V) over the generated tokens)."""
    return scores - frequency * counts


def penalize_presence(scores: Tensor, counts: Tensor, presence: float) -> Tensor:
    """OpenAI's presence penalty: each generated token's score loses presence once."""
    return scores - presence * (counts > 0).to(scores.dtype)


def penalize_presence_and_frequency(
    scores: Tensor, counts: Tensor, presence: float, frequency: float
) -> Tensor:
    """OpenAI's penalties: each generated token's score loses frequency x its count, and
    presence once if it appeared at all (counts (B, V) over the generated tokens)."""
    return penalize_presence(penalize_frequency(scores, counts, frequency), counts, presence)


def filter_top_k(scores: Tensor, top_k: int) -> Tensor:
    """Keep the top_k highest scores of each row (ties with the k-th included); the rest -inf."""
    kth = torch.topk(scores, min(top_k, scores.shape[-1])).values[..., -1:]  # (B, 1)
    return scores.masked_fill(scores < kth, -math.inf)


def filter_top_p(scores: Tensor, top_p: float, min_keep: int = 1) -> Tensor:
    """Nucleus filter (Holtzman et al., 2020): keep the smallest set of tokens
    whose probability reaches top_p. As in transformers, tokens are sorted by
    increasing score and those whose cumulative probability stays <= 1 - top_p
    are dropped, keeping at least min_keep."""
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= 1 - top_p
    drop_sorted[..., -min_keep:] = False
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return scores.masked_fill(drop, -math.inf)


def filter_min_p(scores: Tensor, min_p: float, min_keep: int = 1) -> Tensor:
    """Min-p (Nguyen et al., 2024), as transformers applies it: drop the tokens whose
    probability is below min_p times the most likely token's, keeping at least the
    min_keep most likely."""
    probs = scores.softmax(dim=-1)  # (B, V)
    drop = probs < min_p * probs.amax(dim=-1, keepdim=True)
    best = torch.topk(probs, min(min_keep, probs.shape[-1])).indices  # (B, min_keep)
    drop = drop.scatter(1, best, False)
    return scores.masked_fill(drop, -math.inf)


def filter_typical(scores: Tensor, typical_p: float, min_keep: int = 1) -> Tensor:
    """Locally typical sampling (Meister et al., 2023), as transformers applies it: tokens ranked
    by how far their information (-log p) lies from the distribution's entropy, the closest
    first, are kept until their probability reaches typical_p (the one that reaches it
    included, with any as close), and at least min_keep."""
    log_probs = scores.log_softmax(dim=-1)  # (B, V)
    entropy = -(log_probs * log_probs.exp()).nansum(dim=-1, keepdim=True)  # (B, 1); -inf x 0 skipped
    distance = (-log_probs - entropy).abs()  # (B, V)
    ranked, order = torch.sort(distance, dim=-1)
    mass = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)  # (B, V), closest first
    last = (mass < typical_p).sum(dim=-1, keepdim=True).clamp(max=scores.shape[-1] - 1)  # (B, 1)
    drop_ranked = ranked > ranked.gather(-1, last)
    drop_ranked[..., :min_keep] = False
    drop = drop_ranked.scatter(1, order, drop_ranked)
    return scores.masked_fill(drop, -math.inf)


# ---- the table ----


@dataclass(frozen=True)
class SamplingOption:
    """One sampling option. `apply(scores, value, history, min_keep)` changes the scores (B, V)
    when the value is not `off`: a "penalty" always (it reads the TokenHistory), a "warper" only
    when sampling (greedy's argmax is the same without it)."""

    name: str
    type: type  # int or float
    default: Any  # generate()'s (None: off, as transformers' None)
    off: Any  # the value that changes nothing: the server's default, a request's null
    bounds: dict[str, float]  # generate()'s valid range, in pydantic's words (ge, gt, le, lt)
    help: str
    stage: str  # "penalty" | "warper"
    apply: Callable[[Tensor, Any, Any, int], Tensor]
    request_bounds: dict[str, float] | None = None  # the request field's range (None: bounds)
    request_off: tuple = ()  # request values that mean off besides null (vLLM's top_k -1)
    request: bool = True  # a field of the server's requests (OpenAI's completions and chat)
    cli: bool = False  # `generate` and `chat` have a flag --NAME
    cli_default: Any = None  # the flag's default, where it differs from generate()'s
    checked_when_greedy: bool = True  # False: checked only when sampling (greedy ignores it)

    def active(self, value) -> bool:
        """Whether `value` changes the scores."""
        return value is not None and value != self.off

    def describe_range(self) -> str:
        """generate()'s range in words: 'a number in [-2, 2]', 'an int >= 0', 'a number > 0'."""
        kind = "an int" if self.type is int else "a number"
        low = [f"{'[' if k == 'ge' else '('}{v:g}" for k, v in self.bounds.items() if k in ("ge", "gt")]
        high = [f"{v:g}{']' if k == 'le' else ')'}" for k, v in self.bounds.items() if k in ("le", "lt")]
        if low and high:
            return f"{kind} in {low[0]}, {high[0]}"
        words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
        return " and ".join(f"{kind} {words[k]} {v:g}" for k, v in self.bounds.items())

    def check(self, value) -> None:
        """generate()'s check: a number (an int for int options) in bounds; None where the
        default is None. The error names the option, the range, the no-op value and the value."""
        if value is None and self.default is None:
            return
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if self.type is int and not isinstance(value, int):
            number = False
        ok = number and math.isfinite(value) and all(_BOUNDS[k](value, b) for k, b in self.bounds.items())
        if not ok:
            raise ValueError(
                f"{self.name} must be {self.describe_range()} ({self.off!r} = none); got {value!r}"
            )

    def from_request(self, value):
        """A request's value as the server's SamplingParams holds it: null -> off."""
        return self.off if value is None or value in self.request_off else value


_BOUNDS = {
    "ge": lambda v, b: v >= b,
    "gt": lambda v, b: v > b,
    "le": lambda v, b: v <= b,
    "lt": lambda v, b: v < b,
}

# each stage in the order the logits processor applies it: the penalties first, always (after
# logit_bias, as vLLM), then, when sampling, the warpers (transformers' order); the CLI's flags
# follow the table too. A row: name, type, default (generate()'s), off (the no-op value), bounds
# (generate()'s range), help, stage, processor; then what differs for requests and the CLI.
OPTIONS: tuple[SamplingOption, ...] = (
    SamplingOption(
        "temperature", float, 1.0, 1.0, {"gt": 0.0},
        "divides the scores before sampling: below 1 sharper, above 1 flatter (a request's 0: greedy)",
        "warper", lambda scores, value, history, keep: scores / value,
        request_bounds={"ge": 0.0, "le": 2.0}, cli=True, cli_default=0.8, checked_when_greedy=False,
    ),
    SamplingOption(
        "top_k", int, None, 0, {"ge": 0},
        "keep the TOP_K likeliest tokens; 0 = no top-k filter",
        "warper", lambda scores, value, history, keep: filter_top_k(scores, max(value, keep)),
        request_bounds={"ge": -1}, request_off=(-1,), cli=True, cli_default=50,
    ),
    SamplingOption(
        "top_p", float, None, 1.0, {"gt": 0.0, "le": 1.0},
        "nucleus sampling: keep the smallest set of tokens whose probability reaches TOP_P; 1.0 = none",
        "warper", lambda scores, value, history, keep: filter_top_p(scores, value, keep),
        cli=True,
    ),
    SamplingOption(
        "min_p", float, None, 0.0, {"ge": 0.0, "le": 1.0},
        "drop tokens below MIN_P x the likeliest's probability; 0 = none",
        "warper", lambda scores, value, history, keep: filter_min_p(scores, value, keep),
        cli=True,
    ),
    SamplingOption(
        "typical_p", float, 1.0, 1.0, {"gt": 0.0, "le": 1.0},
        "locally typical sampling: keep the tokens whose -log p is closest to the entropy until "
        "their probability reaches TYPICAL_P; 1.0 = none",
        "warper", lambda scores, value, history, keep: filter_typical(scores, value, keep),
        cli=True,
    ),
    SamplingOption(
        "repetition_penalty", float, 1.0, 1.0, {"gt": 0.0},
        "CTRL's penalty over the prompt's and the generated tokens: a seen token's score is divided "
        "by it (multiplied if negative); 1.0 = none",
        "penalty", lambda scores, value, history, keep: penalize_repetition(scores, history.seen, value),
        cli=True,
    ),
    # frequency before presence: together they are OpenAI's formula, in its order
    SamplingOption(
        "frequency_penalty", float, 0.0, 0.0, {"ge": -2.0, "le": 2.0},
        "OpenAI's: subtracted from a token's score once per time it was generated; 0 = none",
        "penalty", lambda scores, value, history, keep: penalize_frequency(scores, history.counts, value),
    ),
    SamplingOption(
        "presence_penalty", float, 0.0, 0.0, {"ge": -2.0, "le": 2.0},
        "OpenAI's: subtracted once from the score of every token generated so far; 0 = none",
        "penalty", lambda scores, value, history, keep: penalize_presence(scores, history.counts, value),
    ),
)  # fmt: skip

REQUEST_OPTIONS = tuple(option for option in OPTIONS if option.request)
CLI_OPTIONS = tuple(option for option in OPTIONS if option.cli)


def option_fields(defaults: str) -> list[tuple[str, type, dataclasses.Field]]:
    """The table as dataclass fields (for make_dataclass), each keyword-only with its default
    ("default": generate()'s, "off": the no-op value, the server's)."""
    return [
        (o.name, o.type | None, dataclasses.field(default=getattr(o, defaults), kw_only=True))
        for o in OPTIONS
    ]


def _values_class(name: str, defaults: str, frozen: bool, doc: str) -> type:
    cls = dataclasses.make_dataclass(name, option_fields(defaults), frozen=frozen)
    cls.__module__, cls.__doc__ = __name__, doc  # importable by name (pickle, Ray)
    return cls


# generate()'s sampling options with its defaults: the base of GenerationSettings (sampling.py)
SamplingValues = _values_class(
    "SamplingValues", "default", False, "The sampling options of OPTIONS, with generate()'s defaults."
)
# the server's: every option at its no-op value unless the request gives one (serve/engine.py)
RequestSamplingValues = _values_class(
    "RequestSamplingValues", "off", True, "The sampling options of OPTIONS, off unless a request sets them."
)


def settings_of_request(values) -> dict:
    """A request's option values (RequestSamplingValues) as GenerationSettings' keywords:
    temperature 0 is greedy (do_sample False; the warpers then change nothing)."""
    settings = {o.name: getattr(values, o.name) for o in OPTIONS}
    sampling = settings["temperature"] > 0
    settings.update(do_sample=sampling, temperature=settings["temperature"] if sampling else 1.0)
    return settings


def describe(indent: str) -> str:
    """The options as lines for a docstring (generate()'s): name=default: help."""
    return "\n".join(f"{indent}{o.name}={o.default!r}: {o.help}" for o in OPTIONS)
