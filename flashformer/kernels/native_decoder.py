"""The native decoder's Python side: the C++ class of csrc/decoder_cpu.cpp, fed with weights and
the inputs of one call.

A decoder-only model's forward over new tokens against a KV cache runs as one C++ call: the
embeddings, every layer (norms, the q/k/v product, RoPE, the cache write, attention, the output
projection, the feed-forward) and the head, on the packed weights as the layers hold them
(quantized or float32), with nothing compiled at run time. `model/native.py` decides once, at
load, what each layer is and feeds it here; `generate` (a session's prompt chunks and steps) and
the server (its packed steps) call `forward` with a `NativeBatch`.

    decoder = NativeDecoder(d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, vocab_size=49152, n_layers=30)
    decoder.set_embedding(table)                  # a float (V, d) tensor or a QuantizedEmbedding
    decoder.set_norm(0, "attn", weight, eps=1e-5) # and the other norms, projections, attention ...
    decoder.add_linear(0, "qkv", layer.qkv)       # a QuantizedLinear, ConcatenatedLinear or Linear
    decoder.finish()
    cache = NativeCache(k_pools, v_pools)         # per layer (Hk, blocks, block_size, D)
    logits = decoder.forward(batch, cache)        # (R, vocab) float32
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from flashformer.kernels import extension
from flashformer.kernels.quantized import (
    ACTIVATION_CODES,
    ConcatenatedLinear,
    QuantizedEmbedding,
    QuantizedLinear,
)


@dataclass(frozen=True)
class Packing:
    """One row of the C++ table of packings (csrc/packings.h): how a layer holds its weight."""

    index: int  # its number in the C++ table (products.h's Packing)
    layout: str | None  # the layouts.LAYOUTS row it holds; None: float32
    group_rows: int  # output rows a group interleaves
    block_values: int  # inputs a block holds
    group_block_bytes: int  # bytes of a group's block
    scales: bool  # whether its scales are kept beside the data


@functools.cache
def packings() -> dict[str, Packing]:
    """The C++ table of packings, read from the extension (name -> row), not copied here: what the
    native decoder calls a packing is what its table says. Empty without the C++ kernels."""
    extension.load()
    table = {}
    for index, line in enumerate(torch.ops.flashformer.packings()):
        name, layout, *numbers = line.split()
        group_rows, block_values, block_bytes, scales = map(int, numbers)
        layout = None if layout == "-" else layout
        table[name] = Packing(index, layout, group_rows, block_values, block_bytes, bool(scales))
    return table


def packing_index(name: str) -> int:
    """A packing's number in the C++ table, or a clear error if the table has no such row."""
    row = packings().get(name)
    if row is None:
        raise ValueError(
            f"packing: the C++ table (csrc/packings.h) has no row {name!r}; it has {sorted(packings())}"
        )
    return row.index


NORMS = {"rmsnorm": 1, "layernorm": 2}
ACTIVATIONS = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3}  # csrc/row_ops.h
FEED_FORWARDS = {"plain": 0, "gated": 1}  # down(act(up x)); down(act(gate x) * up x), gate | up in one output


def _packing(fmt: str, scales: Tensor | None) -> str:
    if fmt == "int8":
        return "int8_per_block" if scales.dim() == 3 else "int8_per_row"
    return fmt


def _packed(weight: QuantizedLinear | QuantizedEmbedding) -> tuple[int, Tensor, Tensor | None, int, int]:
    """A quantized layer's (packing, data, scales, groups, blocks)."""
    qweight, scales = weight.qweight, weight.scales
    return packing_index(_packing(weight.fmt, scales)), qweight, scales, qweight.shape[0], qweight.shape[1]


@dataclass
class NativeBatch:
    """One call's inputs (csrc/decoder_cpu.cpp's top says what each is): T new tokens of S
    sequences packed one after another, where their keys go, and which rows' logits come back."""

    tokens: Tensor  # (T,) int64
    positions: Tensor  # (T,) int64
    q_starts: Tensor  # (S + 1,) int64
    seq_lens: Tensor  # (S,) int32 or int64
    block_tables: Tensor  # (S, max_blocks) int32 or int64
    slots: Tensor  # (T,) int64
    logit_rows: Tensor  # (R,) int64
    key_padding: Tensor | None = None  # (S, >= max seq_len) bool, False = a padding key
    # the sliding-window layers' own tables and slots, when their pools hold only each sequence's
    # window (serve/paged_cache.py's window group); None: every layer reads block_tables and slots
    window_tables: Tensor | None = None  # (S, max_blocks) int32 or int64
    window_slots: Tensor | None = None  # (T,) int64


class NativeDecoder:
    """A decoder-only Transformer's forward in one C++ call (see the module docstring)."""

    def __init__(
        self, *, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, vocab_size: int, n_layers: int
    ):
        if not extension.cpp_kernels():
            raise RuntimeError(
                "the native decoder needs flashformer's C++ kernels, which could not be built here"
            )
        self._decoder = torch.classes.flashformer.NativeDecoder(
            d_model, n_heads, n_kv_heads, head_dim, vocab_size, n_layers
        )
        # one call at a time: a call owns the decoder's working memory and its bound cache (a
        # server's engine thread and a generate() on another thread may share a model)
        self._lock = threading.Lock()
        self._bound = None  # the NativeCache bound last

    def set_embedding(self, table: Tensor | QuantizedEmbedding, scale: float = 1.0) -> None:
        """The token table: float32 (V, d) or quantized; each row times scale (Gemma's sqrt(d))."""
        if isinstance(table, QuantizedEmbedding):
            packing, data, scales, groups, blocks = _packed(table)
            rows, dim = table.num_embeddings, table.embedding_dim
        else:
            data, scales = _float32("embedding", table), None
            packing, (rows, dim) = packing_index("float32"), data.shape
            groups, blocks = rows, dim
        self._decoder.set_embedding(data, scales, packing, rows, dim, groups, blocks, float(scale))

    def set_positions(self, table: Tensor) -> None:
        """Learned absolute positions (max_positions, d), added to the token embeddings."""
        self._decoder.set_positions(_float32("positions", table))

    def set_rotary(self, index: int, inv_freq: Tensor) -> None:
        """RoPE table `index` (0: the layers' own, 1: the sliding-window layers'): (rotary_dim/2,)."""
        self._decoder.set_rotary(index, _float32("inv_freq", inv_freq))

    def set_rotary_scaling(self, cos_sin_factor: float, long_inv_freq: Tensor | None, original: int) -> None:
        """Table 0's cos and sin times cos_sin_factor (YaRN's or LongRoPE's attention factor), and
        LongRoPE's long table (rotary_dim/2,), read by a sequence whose last new position + 1 passes
        `original` (positional.RotaryEmbedding's rule); None: no long table."""
        table = torch.zeros(0) if long_inv_freq is None else long_inv_freq
        if long_inv_freq is None:
            original = 0
        elif original < 1:
            raise ValueError(f"original: LongRoPE's original context must be >= 1, got {original}")
        self._decoder.set_rotary_scaling(
            _float32("long_inv_freq", table), int(original), float(cos_sin_factor)
        )

    def set_norm(
        self, layer: int, which: str, kind: str, weight: Tensor, bias: Tensor | None, eps: float
    ) -> None:
        """which: attn, attn_out, ffn, ffn_out, q, k (layer >= 0) or final (layer -1)."""
        bias = None if bias is None else _float32("bias", bias)
        self._decoder.set_norm(layer, which, NORMS[kind], _float32("weight", weight), bias, float(eps))

    def add_linear(
        self, layer: int, which: str, linear: QuantizedLinear | ConcatenatedLinear | nn.Linear | Tensor
    ) -> None:
        """Append a projection's rows: which is qkv, out, up, down (layer >= 0) or head (-1).
        A float weight (out, in) or nn.Linear, a QuantizedLinear, or a ConcatenatedLinear's parts."""
        if isinstance(linear, ConcatenatedLinear):
            if linear.bias is not None:
                raise ValueError(
                    f"{which}: a ConcatenatedLinear's own bias is not read by the native decoder"
                )
            for part in linear.parts:
                self.add_linear(layer, which, part)
            return
        if isinstance(linear, QuantizedLinear):
            packing, data, scales, groups, blocks = _packed(linear)
            k = linear.in_features + linear._pad_in  # whole blocks (int8 rows are padded with zeros)
            self._decoder.add_part(
                layer, which, packing, data, scales, linear.bias, linear.out_features, k, groups, blocks,
                ACTIVATION_CODES[linear.activations],
            )  # fmt: skip
            return
        weight, bias = (linear.weight, linear.bias) if isinstance(linear, nn.Linear) else (linear, None)
        weight = _float32("weight", weight)
        n, k = weight.shape
        bias = None if bias is None else _float32("bias", bias)
        float_activations = ACTIVATION_CODES["float32"]
        self._decoder.add_part(
            layer, which, packing_index("float32"), weight, None, bias, n, k, n, k, float_activations
        )

    def set_attention(
        self, layer: int, *, rope: int, scale: float, softcap: float | None, window_left: int | None
    ) -> None:
        """rope: the layer's RoPE table (-1: none); window_left: keys before the query a sliding
        layer sees (None: all)."""
        self._decoder.set_attention(
            layer, rope, float(scale), float(softcap or 0.0), -1 if window_left is None else window_left
        )

    def set_feed_forward(self, layer: int, kind: str, activation: str) -> None:
        self._decoder.set_feed_forward(layer, FEED_FORWARDS[kind], ACTIVATIONS[activation])

    def set_logit_softcap(self, cap: float | None) -> None:
        self._decoder.set_logit_softcap(float(cap or 0.0))

    def finish(self) -> NativeDecoder:
        self._decoder.finish()
        return self

    def forward(self, batch: NativeBatch, cache: NativeCache) -> Tensor:
        """The logits (R, vocab) float32 of batch.logit_rows, after writing every new token's keys
        and values into `cache`."""
        with self._lock:
            if self._bound is not cache:
                self._decoder.bind_cache(cache.k_pools, cache.v_pools)
                self._bound = cache
            return self._decoder.forward(
                batch.tokens,
                batch.positions,
                batch.q_starts,
                batch.seq_lens,
                batch.block_tables,
                batch.slots,
                batch.key_padding,
                batch.logit_rows,
                batch.window_tables,
                batch.window_slots,
            )

    def set_profiling(self, on: bool) -> None:
        """Start (or stop) adding up each kind of step's time over the calls (profile())."""
        self._decoder.set_profiling(on)

    def profile(self) -> dict[str, float]:
        """Seconds per kind of step (embed, norm, qkv, rope_cache, attention, prepare, out,
        residual_norm, up, act, down, residual, head) since set_profiling(True): each step's
        time from the barrier before it to the barrier after it, as the calling thread saw it."""
        return dict(self._decoder.profile())


class NativeCache:
    """The KV cache a native call reads and writes: each layer's keys and values as a pool (Hk,
    blocks, block_size, D), float32 or float16 (the server's paged pools, or a static cache
    (B, Hk, max_len, D) through .transpose(0, 1): B blocks of max_len). Make a new one when the
    tensors change (a beam search's expand)."""

    def __init__(self, k_pools: list[Tensor], v_pools: list[Tensor]):
        self.k_pools, self.v_pools = list(k_pools), list(v_pools)

    @classmethod
    def of_static(cls, caches: list) -> NativeCache:
        """generate.cache.KVCache objects, as B blocks of max_len each (block b: row b)."""
        return cls([c.k.transpose(0, 1) for c in caches], [c.v.transpose(0, 1) for c in caches])


def _float32(name: str, t: Tensor) -> Tensor:
    if not isinstance(t, Tensor) or t.dtype != torch.float32 or t.device.type != "cpu":
        got = f"{t.dtype} on {t.device}" if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name}: the native decoder takes float32 CPU tensors, got {got}")
    return t.detach().contiguous()
