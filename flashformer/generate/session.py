"""Decoding sessions: a model, its prompt and its KV cache, stepped one token at a time.

    session = make_session(model, input_ids, attention_mask, settings)
    logits = session.prefill()        # (B, vocab) after the prompt (in chunks if asked)
    logits = session.step(tokens)     # (B, vocab) after one more token per row

A session is one prefill over the prompt, then one decode step per token,
each a forward pass of one new token per row against the cache
(flashformer.generate.cache). A decoder with a native form (model/native.py: every
decoder-only model flashformer loads, float32 or quantized, on the CPU) runs each prompt
chunk and step as one native call (kernels/native_decoder.py), nothing compiled; otherwise
the model's modules run eagerly. With compile=True the decode step is compiled once with
torch.compile instead (as gpt-fast does: what pays on a GPU), and reused by later calls.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from flashformer.generate.cache import cache_room, make_caches
from flashformer.generate.sampling import GenerationSettings
from flashformer.kernels import extension
from flashformer.kernels.cpu import cpu_decode_step_options
from flashformer.kernels.native_decoder import NativeBatch, NativeCache

# ---- sessions ----


class DecoderSession:
    """A decoder's KV cache and prompt: prefill() once, then step() per token.

    With left padding the keys carry a padding mask (B, max_len), preallocated
    and sliced, and every row counts positions from its first real token, as
    transformers does (position = number of real tokens before it). Without
    padding neither exists and attention runs unmasked.

    caches, cached_len: continue in caches that already hold the first
    cached_len tokens of input_ids (a chat's earlier turns): the prefill
    computes only the rest. Without padding only.
    """

    def __init__(
        self,
        model,
        input_ids: Tensor,
        attention_mask: Tensor | None,
        s: GenerationSettings,
        caches: list | None = None,
        cached_len: int = 0,
    ):
        batch, prompt_len = input_ids.shape
        max_len = prompt_len + s.max_new_tokens
        self.model, self.input_ids, self.chunk_size = model, input_ids, s.prefill_chunk_size or prompt_len
        if caches is None:
            caches = make_caches(model, batch, max_len, input_ids.device, s.cache_type_k, s.cache_type_v)
        elif cache_room(caches) < max_len or not 0 <= cached_len < prompt_len or attention_mask is not None:
            raise ValueError(
                f"continuing in given caches needs room for the prompt and the new tokens ({max_len} <= "
                f"{cache_room(caches)}), 0 <= cached_len={cached_len} < the prompt's {prompt_len} tokens, and "
                f"no attention_mask"
            )
        self.caches, self.cached_len = caches, cached_len
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
        native = getattr(model, "native_decoder", None)
        self.native = native() if native is not None and s.native and not s.compile else None
        self.native_cache = None if self.native is None else NativeCache.of_static(self.caches)
        self.decode = compiled(decode_step, input_ids.device.type) if s.compile else decode_step

    def prefill(self) -> Tensor:
        """Run the prompt through the model (chunk by chunk); the last token's logits (B, vocab) float32."""
        prompt_len = self.input_ids.shape[1]
        for start in range(self.cached_len, prompt_len, self.chunk_size):
            end = min(start + self.chunk_size, prompt_len)
            if self.native is not None:
                positions = None if self.positions is None else self.positions[:, start:end]
                logits = self._native_forward(self.input_ids[:, start:end], positions, start)[:, None]
                continue
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
        if self.native is not None:
            logits = self._native_forward(tokens[:, None], self.next_positions, self.length)
        else:
            mask = None if self.key_mask is None else self.key_mask[:, : self.length + 1]
            logits = self.decode(
                self.model, tokens[:, None], mask, self.next_positions, self.caches, self.length
            )
        self.length += 1
        if self.next_positions is not None:
            self.next_positions = self.next_positions + 1
        return logits

    def extend(self, tokens: Tensor) -> Tensor:
        """tokens (B, L) after the cached ones, in one forward -> the logits (B, L, vocab) float32
        after each of them (speculative decoding's verify step). Without padding only."""
        batch, length = tokens.shape
        if self.key_mask is not None:
            raise ValueError("extend() runs without padding: give prompts of one length (no attention_mask)")
        end = self.length + length
        if end > cache_room(self.caches):
            raise ValueError(
                f"the KV cache holds {cache_room(self.caches)} tokens; extending {self.length} by {length} needs {end}"
            )
        if self.native is not None:
            logits = self._native_forward(tokens, None, self.length, every_row=True).view(batch, length, -1)
        else:
            logits = self.model(
                tokens, kv_caches=self.caches, cache_position=self.length, logits_to_keep=length
            ).logits
        self.length = end
        return logits.float()

    def rewind(self, length: int) -> None:
        """Keep the first `length` cached tokens: the next forward writes after them (the keys and
        values of rejected drafts are left behind and overwritten)."""
        if not 0 <= length <= self.length or self.key_mask is not None:
            raise ValueError(f"rewind: length must be in [0, {self.length}] without padding; got {length}")
        self.length = length

    def _native_forward(
        self, tokens: Tensor, positions: Tensor | None, start: int, every_row: bool = False
    ) -> Tensor:
        """tokens (B, L) after `start` cached ones, one native call: every row is a sequence of
        the static cache (row b: block b of max_len); the logits (B, vocab) of each row's last,
        or with every_row those of every token (B * L, vocab)."""
        batch, length = tokens.shape
        end = start + length
        rows = torch.arange(batch)
        steps = torch.arange(start, end)
        if positions is None:
            positions = steps.expand(batch, length)
        native_batch = NativeBatch(
            tokens=tokens.reshape(-1),
            positions=positions.reshape(-1),
            q_starts=torch.arange(batch + 1) * length,
            seq_lens=torch.full((batch,), end),
            block_tables=rows[:, None],
            slots=(rows[:, None] * self.caches[0].max_len + steps).reshape(-1),
            logit_rows=torch.arange(batch * length) if every_row else rows * length + length - 1,
            key_padding=None if self.key_mask is None else self.key_mask[:, :end],
        )
        return self.native.forward(native_batch, self.native_cache)

    def expand(self, times: int) -> None:
        """Each row becomes `times` consecutive rows (beam search after one prefill per prompt)."""
        for cache in self.caches:
            cache.expand(times)
        if self.native is not None:  # new tensors
            self.native_cache = NativeCache.of_static(self.caches)
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
        self.caches = make_caches(
            model, batch, 1 + s.max_new_tokens, input_ids.device, s.cache_type_k, s.cache_type_v
        )
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


# the step's arguments that change every token, symbolic from the first compile on
CHANGING_EVERY_STEP = "L['cache_position'],L['attention_mask']:1"


@functools.cache
def compiled(step, device_type: str):
    """A decode step (decode_step or encoder_decoder_step) under torch.compile,
    made on first use (importing the compiler is slow), one per step and device type.

    The cache position (and a padding mask's length) are symbolic from the first
    compile on (torch.compiler.config.dynamic_sources, set while dynamo traces):
    left to automatic dynamic shapes, the first step compiled a graph specialized
    to its position and the second compiled again with the position symbolic,
    twice the compile time for a graph used once. The cache sizes are symbolic
    already (let_sizes_vary); a new dtype or model compiles again. dynamic=True
    would also make the layers' float attributes symbolic, which breaks the graph.
    """
    if device_type == "cpu":
        extension.load()  # the C++ kernels (attention's "cpu" backend) before tracing, see cpp_kernels
    graph = torch.compile(step, options=cpu_decode_step_options() if device_type == "cpu" else None)

    def call(*args):
        with torch.compiler.config.patch(dynamic_sources=CHANGING_EVERY_STEP):
            return graph(*args)

    return call


def let_sizes_vary(caches: list) -> None:
    """For compile=True: the caches' batch and length dims are symbolic from
    the first compile on, so a call with another batch size or another
    prompt + max_new_tokens reuses the graph instead of compiling again
    (torch.compile still specializes a batch of 1 at first)."""
    for cache in caches:
        if not hasattr(cache, "k"):  # a recurrent state: its sizes do not grow
            continue
        for t in (cache.k, cache.v):
            torch._dynamo.maybe_mark_dynamic(t, 0)
            torch._dynamo.maybe_mark_dynamic(t, 2)


def make_session(model, input_ids, attention_mask, s: GenerationSettings):
    kind = EncoderDecoderSession if model.config.arch == "encoder-decoder" else DecoderSession
    return kind(model, input_ids, attention_mask, s)
