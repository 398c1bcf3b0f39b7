"""From logits to the next token: the settings of a generate() call, and
what turns a step's logits into scores to pick from.

    settings = settings_from(model, max_new_tokens=50, do_sample=True, top_p=0.9)
    process = LogitsProcessor(settings, device)
    scores = process(logits, history, new_tokens)   # repetition penalty, min length, temperature, top-k, top-p
    tokens = choose_tokens(scores, settings.do_sample, generator)   # (B,)

Every setting has transformers' name, default and meaning, and is checked
before any compute; errors name the argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

# ---- settings ----


@dataclass
class GenerationSettings:
    """The knobs of one generate() call, with transformers' names and defaults."""

    max_new_tokens: int = 20
    min_new_tokens: int = 0
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None  # None or 0: no top-k filter
    top_p: float | None = None  # None or 1.0: no nucleus filter
    repetition_penalty: float = 1.0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in transformers
    eos_token_id: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    decoder_start_token_id: int | None = None
    prefill_chunk_size: int | None = None
    compile: bool = False


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
    settings = GenerationSettings(
        eos_token_id=eos_list, pad_token_id=pad, decoder_start_token_id=start, **kwargs
    )
    check_settings(settings, model)
    return settings


def check_settings(s: GenerationSettings, model) -> None:
    vocab = model.config.vocab_size
    _check_int("max_new_tokens", s.max_new_tokens, 0)
    _check_int("min_new_tokens", s.min_new_tokens, 0)
    _check_int("num_beams", s.num_beams, 1)
    if not isinstance(s.do_sample, bool):
        raise ValueError(f"do_sample must be True or False; got {s.do_sample!r}")
    if s.do_sample and not (_is_number(s.temperature) and s.temperature > 0 and math.isfinite(s.temperature)):
        raise ValueError(
            f"temperature must be a finite number > 0 when sampling (do_sample=True); got {s.temperature!r}"
        )
    if s.top_k is not None:
        _check_int("top_k", s.top_k, 0)
    if s.top_p is not None and not (_is_number(s.top_p) and 0 < s.top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1]; got {s.top_p!r}")
    if not (_is_number(s.repetition_penalty) and s.repetition_penalty > 0):
        raise ValueError(
            f"repetition_penalty must be a number > 0 (1.0 = none); got {s.repetition_penalty!r}"
        )
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
    if model.config.arch == "encoder-decoder":
        start = s.decoder_start_token_id
        if not (isinstance(start, int) and not isinstance(start, bool) and 0 <= start < vocab):
            raise ValueError(
                f"an encoder-decoder needs decoder_start_token_id, a token id in [0, {vocab}) "
                f"(from the argument or the model's config); got {start!r}"
            )


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


class TokenHistory:
    """Which tokens each row has produced so far (B, vocab) bool, for the repetition penalty.

    Updated per step (one scatter), never recomputed from the whole sequence.
    Padding is not part of a prompt, so it is not penalized.
    """

    def __init__(self, tokens: Tensor, real: Tensor | None, vocab: int):
        batch = tokens.shape[0]
        # padding goes to an extra column that is dropped: scatter never sees a conflicting write
        index = tokens if real is None else tokens.masked_fill(~real.bool(), vocab)
        seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=tokens.device)
        self.seen = seen.scatter_(1, index, True)[:, :vocab]  # (B, V)

    def add(self, tokens: Tensor) -> None:  # tokens (B,)
        self.seen[torch.arange(tokens.shape[0], device=tokens.device), tokens] = True

    def reorder(self, rows: Tensor) -> None:
        self.seen = self.seen[rows]

    def expand(self, times: int) -> None:
        self.seen = self.seen.repeat_interleave(times, dim=0)


def penalize_repetition(scores: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL's penalty (Keskar et al., 2019), as transformers applies it: a seen
    token's score is divided by the penalty if positive, multiplied if negative."""
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalized, scores)


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


class LogitsProcessor:
    """The score changes of one generate() call, in transformers' order:
    repetition penalty, min_new_tokens (eos forbidden), then, when sampling,
    temperature, top-k, top-p."""

    def __init__(self, s: GenerationSettings, device, min_keep: int = 1):
        self.s, self.min_keep = s, min_keep
        self.eos = torch.tensor(s.eos_token_id, dtype=torch.long, device=device)

    def __call__(self, scores: Tensor, history: TokenHistory | None, new_tokens: int) -> Tensor:
        s = self.s
        if s.repetition_penalty != 1.0:
            scores = penalize_repetition(scores, history.seen, s.repetition_penalty)
        if new_tokens < s.min_new_tokens and len(self.eos):
            scores = scores.index_fill(1, self.eos, -math.inf)
        if s.do_sample:
            if s.temperature != 1.0:
                scores = scores / s.temperature
            if s.top_k:
                scores = filter_top_k(scores, max(s.top_k, self.min_keep))
            if s.top_p is not None and s.top_p < 1.0:
                scores = filter_top_p(scores, s.top_p, self.min_keep)
        return scores


def choose_tokens(scores: Tensor, do_sample: bool, generator: torch.Generator | None) -> Tensor:
    """The next token of every row from its processed scores (B, vocab) -> (B,): the highest
    score, or with do_sample a draw from softmax(scores) with the generator (generate() and the
    server choose here, so a row's token is the same whoever asks)."""
    if do_sample:
        return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1)
    return scores.argmax(dim=-1)


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
