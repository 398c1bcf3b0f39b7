"""Generation over a static KV cache: greedy, sampling, beam search, streaming.

    ids = model.generate(input_ids, max_new_tokens=50)                                  # greedy
    ids = model.generate(input_ids, do_sample=True, temperature=0.8, top_p=0.9, seed=0)  # sampling
    ids = model.generate(input_ids, num_beams=4, length_penalty=1.0, early_stopping=True)
    for tokens in model.stream(input_ids, max_new_tokens=50):                           # (B,) per step
        ...

Arguments have transformers' names and meanings, and generate returns what
transformers' generate returns: for a decoder, the prompt followed by the new
tokens (B, P + n); for an encoder-decoder, the decoder's tokens starting with
decoder_start_token_id (B, 1 + n). Rows that finish early (eos) are filled
with pad_token_id. A batch of prompts of different lengths is left-padded,
with an attention_mask; each row then generates what it would alone, as the
position ids count its real tokens only.

A run is one prefill over the prompt (in chunks if asked), then one decode
step per token, each a forward pass of one new token per row against the
cache (flashformer.cache). With compile=True the decode step is compiled
once with torch.compile (as gpt-fast does) and reused by later calls.

Every argument is checked before any compute; errors name the argument.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from flashformer.cache import make_caches

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


@dataclass
class GenerateOutput:
    """generate(..., return_dict_in_generate=True): the sequences, and with
    output_logits=True the raw logits of every step, each (B * num_beams, vocab) float32."""

    sequences: Tensor
    logits: tuple[Tensor, ...] | None = None


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


def check_prompt(model, input_ids, attention_mask, s: GenerationSettings) -> None:
    """The prompt's shape, ids, mask and length, against the model and the settings."""
    config = model.config
    if (
        not isinstance(input_ids, Tensor)
        or input_ids.dtype.is_floating_point
        or input_ids.dtype == torch.bool
    ):
        raise ValueError(
            f"input_ids must be an integer tensor of shape (batch, length); got {_describe(input_ids)}"
        )
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must have shape (batch >= 1, length); got {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids is an empty prompt (shape {tuple(input_ids.shape)}); give at least one token"
        )
    device = next(model.parameters()).device
    if input_ids.device != device:
        raise ValueError(f"input_ids must be on the model's device {device}; got {input_ids.device}")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= config.vocab_size:
        raise ValueError(
            f"input_ids must be in [0, vocab_size={config.vocab_size}); got a token id {low if low < 0 else high}"
        )
    batch, length = input_ids.shape
    if attention_mask is not None:
        if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != (batch, length):
            raise ValueError(
                f"attention_mask must be a tensor of the shape of input_ids {(batch, length)}; "
                f"got {_describe(attention_mask)}"
            )
        if attention_mask.device != device:
            raise ValueError(
                f"attention_mask must be on the model's device {device}; got {attention_mask.device}"
            )
        real = attention_mask.bool()
        empty = (~real.any(dim=1)).nonzero().flatten().tolist()
        if empty:
            raise ValueError(
                f"attention_mask marks row {empty[0]} of input_ids as all padding: an empty prompt"
            )
        if config.arch == "decoder":
            # new tokens follow the last column, so a decoder's prompts must end there: left padding
            after_real = real.long().cummax(dim=1).values.bool() & ~real
            rows = after_real.any(dim=1).nonzero().flatten().tolist()
            if rows:
                raise ValueError(
                    f"a decoder's prompts must be left-padded (padding before the tokens); attention_mask "
                    f"row {rows[0]} has padding after a real token"
                )
    if config.arch == "decoder" and config.position == "learned":
        if length + s.max_new_tokens > config.max_seq_len:
            raise ValueError(
                f"the prompt ({length} tokens) plus max_new_tokens={s.max_new_tokens} is "
                f"{length + s.max_new_tokens} tokens, beyond the model's {config.max_seq_len} learned positions "
                f"(max_seq_len)"
            )
    if config.arch == "encoder-decoder" and config.position == "learned":
        if length > config.max_seq_len or 1 + s.max_new_tokens > config.max_seq_len:
            raise ValueError(
                f"the encoder's prompt ({length} tokens) and the decoder's 1 + max_new_tokens={s.max_new_tokens} "
                f"tokens must each fit the model's {config.max_seq_len} learned positions (max_seq_len)"
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


def _describe(x) -> str:
    if isinstance(x, Tensor):
        return f"a tensor of dtype {x.dtype} and shape {tuple(x.shape)}"
    return type(x).__name__


# ---- sessions: a model, its prompt and its cache ----


class DecoderSession:
    """A decoder's KV cache and prompt: prefill() once, then step() per token.

    With left padding the keys carry a padding mask (B, max_len), preallocated
    and sliced, and every row counts positions from its first real token, as
    transformers does (position = number of real tokens before it). Without
    padding neither exists and attention runs unmasked.
    """

    def __init__(self, model, input_ids: Tensor, attention_mask: Tensor | None, s: GenerationSettings):
        batch, prompt_len = input_ids.shape
        max_len = prompt_len + s.max_new_tokens
        self.model, self.input_ids, self.chunk_size = model, input_ids, s.prefill_chunk_size or prompt_len
        self.caches = make_caches(model, batch, max_len, input_ids.device)
        if s.compile:
            let_sizes_vary(self.caches)
        self.length = 0  # tokens in the cache
        self.key_mask = self.positions = self.next_positions = None
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            real = attention_mask.bool()
            self.key_mask = torch.ones(batch, max_len, dtype=torch.bool, device=input_ids.device)
            self.key_mask[:, :prompt_len] = real
            self.positions = (real.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, P)
            self.next_positions = self.positions[:, -1:] + 1  # (B, 1)
        self.decode = compiled(decode_step, input_ids.device.type) if s.compile else decode_step

    def prefill(self) -> Tensor:
        """Run the prompt through the model (chunk by chunk); the last token's logits (B, vocab) float32."""
        prompt_len = self.input_ids.shape[1]
        for start in range(0, prompt_len, self.chunk_size):
            end = min(start + self.chunk_size, prompt_len)
            logits = self.model(
                self.input_ids[:, start:end],
                attention_mask=None if self.key_mask is None else self.key_mask[:, :end],
                position_ids=None if self.positions is None else self.positions[:, start:end],
                kv_caches=self.caches,
                cache_position=start,
                logits_to_keep=1,
            ).logits
        self.length = prompt_len
        return logits[:, -1].float()

    def step(self, tokens: Tensor) -> Tensor:
        """tokens (B,) -> the next logits (B, vocab) float32."""
        logits = self.decode(
            self.model,
            tokens[:, None],
            None if self.key_mask is None else self.key_mask[:, : self.length + 1],
            self.next_positions,
            self.caches,
            self.length,
        )
        self.length += 1
        if self.next_positions is not None:
            self.next_positions = self.next_positions + 1
        return logits

    def expand(self, times: int) -> None:
        """Each row becomes `times` consecutive rows (beam search after one prefill per prompt)."""
        for cache in self.caches:
            cache.expand(times)
        if self.key_mask is not None:
            self.key_mask = self.key_mask.repeat_interleave(times, dim=0)
            self.next_positions = self.next_positions.repeat_interleave(times, dim=0)

    def reorder(self, rows: Tensor) -> None:
        """Row r continues from row rows[r] (beam search)."""
        for cache in self.caches:
            cache.reorder(rows, self.length)
        if self.key_mask is not None:
            self.key_mask = self.key_mask[rows]
            self.next_positions = self.next_positions[rows]


class EncoderDecoderSession:
    """An encoder-decoder: the encoder runs once, the decoder starts from
    decoder_start_token_id; the first decoder step fills the caches' cross-attention keys and values."""

    def __init__(self, model, input_ids: Tensor, attention_mask: Tensor | None, s: GenerationSettings):
        batch = input_ids.shape[0]
        self.model, self.input_ids, self.attention_mask = model, input_ids, attention_mask
        self.caches = make_caches(model, batch, 1 + s.max_new_tokens, input_ids.device)
        if s.compile:
            let_sizes_vary(self.caches)
        self.start = torch.full(
            (batch, 1), s.decoder_start_token_id, dtype=torch.long, device=input_ids.device
        )
        self.memory = None
        self.length = 0
        self.decode = (
            compiled(encoder_decoder_step, input_ids.device.type) if s.compile else encoder_decoder_step
        )

    def prefill(self) -> Tensor:
        self.memory = self.model.encode(self.input_ids, self.attention_mask)  # (B, M, d_model)
        logits = self.model(
            decoder_input_ids=self.start,
            attention_mask=self.attention_mask,
            encoder_outputs=self.memory,
            kv_caches=self.caches,
            logits_to_keep=1,
        ).logits
        self.length = 1
        return logits[:, -1].float()

    def step(self, tokens: Tensor) -> Tensor:
        logits = self.decode(
            self.model, tokens[:, None], self.memory, self.attention_mask, self.caches, self.length
        )
        self.length += 1
        return logits

    def expand(self, times: int) -> None:
        for cache in self.caches:
            cache.expand(times)
        self.memory = self.memory.repeat_interleave(times, dim=0)
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask.repeat_interleave(times, dim=0)

    def reorder(self, rows: Tensor) -> None:
        for cache in self.caches:
            cache.reorder(rows, self.length)
        self.memory = self.memory[rows]
        if self.attention_mask is not None:
            self.attention_mask = self.attention_mask[rows]


def decode_step(model, tokens, attention_mask, position_ids, caches, cache_position: int) -> Tensor:
    """One new token per row (B, 1) against the cache -> logits (B, vocab) float32."""
    out = model(
        tokens,
        attention_mask=attention_mask,
        position_ids=position_ids,
        kv_caches=caches,
        cache_position=cache_position,
        logits_to_keep=1,
    )
    return out.logits[:, -1].float()


def encoder_decoder_step(model, tokens, memory, memory_mask, caches, cache_position: int) -> Tensor:
    out = model(
        decoder_input_ids=tokens,
        attention_mask=memory_mask,
        encoder_outputs=memory,
        kv_caches=caches,
        cache_position=cache_position,
        logits_to_keep=1,
    )
    return out.logits[:, -1].float()


# Inductor options for a decode step on the CPU. Such a step multiplies one
# row (or a few) by every weight matrix, so its time is the time to stream the
# weights; what inductor adds around that is what these remove. Measured on
# GPT-2-small, batch 1, float32, 2-core AMD EPYC, torch 2.13, the steps of
# each variant interleaved in one process (median ms per step):
CPU_DECODE_STEP_OPTIONS = {
    # Store every intermediate instead of recomputing it inside the loop that
    # reads it. By default inductor inlines a LayerNorm into the matrix-vector
    # product after it and normalizes the input again for each of the 2304 or
    # 3072 output rows: that product then streams its weights at 7 GB/s
    # instead of 17. With this: 33.0 -> 31.1 ms per step.
    "realize_opcount_threshold": 1,
    # The code that calls the kernels in C++ instead of Python: 31.1 -> 30.2 ms.
    # Compiling GPT-2-small's two graphs from a cold cache: 115 s instead of 102.
    "cpp_wrapper": True,
}


@functools.cache
def compiled(step, device_type: str):
    """A decode step (decode_step or encoder_decoder_step) under torch.compile,
    made on first use (importing the compiler is slow), one per step and device type.

    torch.compile's automatic dynamic shapes: the first compiled step is
    specialized to its cache position; the second, seeing it change, compiles
    a graph with the position symbolic, which then serves every later step
    and call (the cache sizes are symbolic already, see let_sizes_vary; a new
    dtype or model compiles again). dynamic=True from the start would also
    make the layers' float attributes symbolic, which breaks the graph.
    """
    return torch.compile(step, options=CPU_DECODE_STEP_OPTIONS if device_type == "cpu" else None)


def let_sizes_vary(caches: list) -> None:
    """For compile=True: the caches' batch and length dims are symbolic from
    the first compile on, so a call with another batch size or another
    prompt + max_new_tokens reuses the graph instead of compiling again
    (torch.compile still specializes a batch of 1 at first)."""
    for cache in caches:
        for t in (cache.k, cache.v):
            torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(t, 2)


def make_session(model, input_ids, attention_mask, s: GenerationSettings):
    kind = EncoderDecoderSession if model.config.arch == "encoder-decoder" else DecoderSession
    return kind(model, input_ids, attention_mask, s)


# ---- from logits to the next token ----


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


# ---- greedy and sampling ----


def stream_tokens(
    session, s: GenerationSettings, history: TokenHistory | None, generator, logits_out: list | None = None
) -> Iterator[Tensor]:
    """Yield the next token of every row (B,) per step, until max_new_tokens
    or every row has produced an eos (finished rows then get pad_token_id)."""
    process = LogitsProcessor(s, session.input_ids.device)
    unfinished = tokens = None
    for index in range(s.max_new_tokens):
        logits = session.prefill() if index == 0 else session.step(tokens)  # (B, V) float32
        if logits_out is not None:
            logits_out.append(logits)
        scores = process(logits, history, index)
        if s.do_sample:
            tokens = torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(1)  # (B,)
        else:
            tokens = scores.argmax(dim=-1)  # (B,)
        if process.eos.numel():
            if unfinished is None:
                unfinished = torch.ones_like(tokens, dtype=torch.bool)
            tokens = torch.where(unfinished, tokens, s.pad_token_id)
            unfinished = unfinished & ~torch.isin(tokens, process.eos)
        if history is not None:
            history.add(tokens)
        yield tokens
        if unfinished is not None and not bool(unfinished.any()):
            return


# ---- the methods models get ----


def _prepare(model, input_ids, attention_mask, generator, seed, kwargs):
    s = settings_from(model, **kwargs)
    check_prompt(model, input_ids, attention_mask, s)
    generator = make_generator(generator, seed, input_ids.device)
    return s, generator


def _decoder_prompt(model, input_ids, attention_mask, s):
    """The tokens the decoder starts from (B, P), and which are real (None: all)."""
    if model.config.arch == "encoder-decoder":
        start = torch.full((input_ids.shape[0], 1), s.decoder_start_token_id, device=input_ids.device)
        return start, None
    return input_ids, attention_mask


class GenerationMixin:
    """generate() and stream() for DecoderModel and EncoderDecoderModel."""

    @torch.no_grad()
    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        return_dict_in_generate: bool = False,
        output_logits: bool = False,
        **kwargs,
    ) -> Tensor | GenerateOutput:
        """Generate up to max_new_tokens after each prompt; see the module docstring.

        input_ids: (B, P) prompts, left-padded for a decoder; attention_mask (B, P), 1 = real token.
        Keyword arguments (transformers' names): max_new_tokens=20, min_new_tokens=0,
        do_sample=False, temperature=1.0, top_k=None, top_p=None, repetition_penalty=1.0,
        num_beams=1, length_penalty=1.0, early_stopping=False, eos_token_id (int or list;
        default the config's), pad_token_id, decoder_start_token_id; and flashformer's
        prefill_chunk_size (None = the whole prompt at once) and compile (torch.compile
        the decode step). generator or seed make sampling reproducible.
        Returns (B, P + n) for a decoder, (B, 1 + n) for an encoder-decoder, or a
        GenerateOutput with return_dict_in_generate=True.
        """
        s, generator = _prepare(self, input_ids, attention_mask, generator, seed, kwargs)
        prompt, real = _decoder_prompt(self, input_ids, attention_mask, s)
        logits_out = [] if output_logits else None
        if s.max_new_tokens == 0:
            sequences = prompt
        elif s.num_beams > 1:
            from flashformer.beam_search import beam_search

            sequences = beam_search(
                make_session(self, input_ids, attention_mask, s), s, prompt, real, generator, logits_out
            )
        else:
            history = (
                TokenHistory(prompt, real, self.config.vocab_size) if s.repetition_penalty != 1.0 else None
            )
            session = make_session(self, input_ids, attention_mask, s)
            steps = list(stream_tokens(session, s, history, generator, logits_out))
            sequences = torch.cat([prompt] + [t[:, None] for t in steps], dim=1)
        if return_dict_in_generate:
            return GenerateOutput(sequences, tuple(logits_out) if output_logits else None)
        return sequences

    def stream(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        seed: int | None = None,
        **kwargs,
    ) -> Iterator[Tensor]:
        """Like generate() (greedy or sampling), but yields each step's new tokens (B,) as they come."""
        s, generator = _prepare(self, input_ids, attention_mask, generator, seed, kwargs)
        if s.num_beams != 1:
            raise ValueError(
                f"stream() yields one token per step, which beam search cannot (a beam's earlier tokens "
                f"change until it ends); got num_beams={s.num_beams}"
            )
        return self._stream(input_ids, attention_mask, s, generator)

    @torch.no_grad()
    def _stream(self, input_ids, attention_mask, s, generator) -> Iterator[Tensor]:
        prompt, real = _decoder_prompt(self, input_ids, attention_mask, s)
        history = TokenHistory(prompt, real, self.config.vocab_size) if s.repetition_penalty != 1.0 else None
        session = make_session(self, input_ids, attention_mask, s)
        yield from stream_tokens(session, s, history, generator)
