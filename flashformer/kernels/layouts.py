"""The packed layouts a quantized layer holds its weight in, one row each in LAYOUTS: the rows
of a group, the values of a block, whether the bytes are GGUF's own, the dequantization (the
reference every kernel and fallback is held to) and the operator that multiplies by it.

    "int4"  GGUF's Q4_1 block (Q4_0 as Q4_1 with m = -8 d): weight = d * q + m, q in 0..15
    "int8"  weight = s * q, q in int8; s float16 per block of 32 (GGUF's Q8_0) or float32 per row
    "int5"  Q5_1 (Q5_0 as Q5_1 with m = -16 d): int4 with a fifth bit (gguf_blocks.py)
    "q4_k", "q5_k", "q6_k"  the K-quants' blocks of 256 as the file stores them (gguf_blocks.py)
    "mxfp4"  GGUF's MXFP4 blocks of 32 (e2m1 values, an e8m0 scale) as the file stores them

Layout of int4 and int8 (the kernels read it; the dequantizers undo it): output rows in groups
of 8 (int4) or 4 (int8), padded with zero rows; for each group and block of 32 inputs the
group's quants are adjacent, so that a group is read as one sequential stream:
    int4: qweight uint8 (groups, blocks, 8, 16), GGUF's nibble order (byte j: q[j] low, q[j+16] high)
          scales float16 (groups, blocks, 2, 8): the 8 rows' d, then their m
    int8: qweight int8 (groups, blocks, 4, 32)
          scales float16 (groups, blocks, 4) per block, or float32 (groups * 4,) per row

Why those group sizes: 8 rows for int4, whose one-row kernel reads 8 rows per block (the x
block's loads and scale shared by 8 rows) as one sequential stream, which the hardware
prefetches best (docs/benchmarks.md, "Packed layouts"); 4 for int8, whose 4 rows x 32 bytes are
already a 128-byte sequential block. int5 as int4; the K-quants and MXFP4 are not interleaved: a
row's blocks are one sequential stream already, and they stay the file's bytes, mapped, not a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from flashformer.kernels import gguf_blocks
from flashformer.kernels.gguf_blocks import SUPER_BLOCK

BLOCK = 32  # values per quantization block along the input dim (GGUF's QK4_0, QK4_1, QK8_0)


@dataclass(frozen=True)
class Layout:
    """One packed layout: how a quantized layer holds its weight."""

    name: str
    group_rows: int  # output rows interleaved in a group (qweight's first dim counts groups)
    block_values: int  # inputs per block (qweight's second dim counts blocks)
    in_place: bool  # GGUF's own bytes, row after row: a file's map used as it is, never repacked
    # (qweight, scales) -> float32 (groups * group_rows, blocks * block_values); scales None where
    # the blocks hold their own
    dequantize: Callable[[Tensor, Tensor | None], Tensor]

    @property
    def op(self) -> str:
        """Its operator's name (operators.py)."""
        return f"{self.name}_linear"


# ---- int4 and int8: packing, dequantization, and a float weight's quantization ----


def row_groups(source: Tensor, rows: int) -> Tensor:
    """(N, blocks, *inner) -> (G, blocks, rows, *inner): source row g * rows + r at [g, :, r], and
    zero rows padding N to G * rows; the interleave of the packed layouts. source may be a strided
    view (a file's blocks) whose inner values are contiguous. One numpy copy moving each row's
    block whole (a void of its bytes), where torch's copy of the same permutation moved a byte at
    a time: SmolLM2's 66 MB of Q4_1 blocks in 50 ms instead of 200 ms, most of a load's repacking."""
    n, blocks, *inner = source.shape
    groups, full = -(-n // rows), n // rows
    packed = (torch.zeros if n % rows else torch.empty)(groups, blocks, rows, *inner, dtype=source.dtype)
    src, dst = source.numpy(), packed.numpy()
    if inner:  # a row's block of values as one element
        width = f"V{src.itemsize * int(np.prod(inner))}"
        src = src.reshape(n, blocks, -1).view(width)[..., 0]  # (N, blocks)
        dst = dst.reshape(groups, blocks, rows, -1).view(width)[..., 0]  # (G, blocks, rows)
    dst[:full].transpose(0, 2, 1)[...] = src[: full * rows].reshape(full, rows, blocks)
    if n % rows:
        dst[full, :, : n - full * rows] = src[full * rows :].T
    return packed


def pack_int4(d: Tensor, m: Tensor, nibbles: Tensor) -> tuple[Tensor, Tensor]:
    """GGUF Q4_1 fields of N rows -> the packed layout. d, m: float16 (N, blocks);
    nibbles: uint8 (N, blocks, 16) in GGUF's order (views of a file's blocks, or tensors).
    Returns qweight (G, blocks, 8, 16) uint8 and scales (G, blocks, 2, 8) float16, rows
    padded with zeros to G * 8."""
    rows = LAYOUTS["int4"].group_rows
    scales = torch.stack((row_groups(d, rows), row_groups(m, rows)), dim=2)  # (G, blocks, 2, 8)
    return row_groups(nibbles, rows), scales


def pack_int5(d: Tensor, m: Tensor, nibbles: Tensor, words: Tensor) -> tuple[Tensor, Tensor]:
    """Q5_1 fields of N rows (d, m, nibbles as pack_int4's; words int32 (N, blocks): the fifth
    bits, gguf_blocks.fifth_bit_words) -> qweight (G, blocks, 160) uint8, scales as int4's."""
    nibble_blocks, scales = pack_int4(d, m, nibbles)  # (G, blocks, 8, 16)
    groups, blocks = nibble_blocks.shape[:2]
    word_bytes = row_groups(words, LAYOUTS["int5"].group_rows).view(torch.uint8)  # (G, blocks, 32)
    return torch.cat((nibble_blocks.reshape(groups, blocks, 128), word_bytes), dim=-1), scales


def pack_int8(q: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """int8 quants (N, blocks, 32) and their scales, float16 (N, blocks) per block or float32 (N,)
    per row -> qweight (G, blocks, 4, 32) int8 and scales (G, blocks, 4) or (G * 4,)."""
    rows = LAYOUTS["int8"].group_rows
    qweight = row_groups(q, rows)  # q may be a strided view of a file's blocks
    if scales.dim() == 1:
        return qweight, F.pad(scales, (0, -q.shape[0] % rows))
    return qweight, row_groups(scales, rows)


def dequantize_int4(qweight: Tensor, scales: Tensor) -> Tensor:
    """Packed int4 -> float32 (G * 8, K): d * q + m, rounded as gguf's dequantizer rounds it."""
    groups, blocks, rows = qweight.shape[:3]
    q = torch.stack((qweight & 15, qweight >> 4), dim=3).view(groups, blocks, rows, BLOCK).float()
    d, m = scales.float().unbind(2)  # (G, blocks, 8) each
    weight = d[..., None] * q + m[..., None]  # (G, blocks, 8, 32)
    return weight.permute(0, 2, 1, 3).reshape(groups * rows, blocks * BLOCK)


def dequantize_int8(qweight: Tensor, scales: Tensor) -> Tensor:
    """Packed int8 -> float32 (G * 4, K): q * s, per block (float16 scales) or per row (float32)."""
    groups, blocks, rows = qweight.shape[:3]
    q = qweight.permute(0, 2, 1, 3).reshape(groups * rows, blocks, BLOCK).float()  # (N, blocks, 32)
    if scales.dim() == 1:
        return (q * scales[:, None, None]).view(groups * rows, blocks * BLOCK)
    s = scales.float().permute(0, 2, 1).reshape(groups * rows, blocks, 1)
    return (q * s).view(groups * rows, blocks * BLOCK)


def quantize_q4_1(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A float weight (N, K) -> GGUF Q4_1 fields (d, m float16 (N, K/32), nibbles uint8 (N, K/32, 16)),
    with llama.cpp's rule (quantize_row_q4_1_ref; gguf.quants does the same): per block,
    d = (max - min) / 15, q = trunc((x - min) / d + 0.5) clipped to 0..15 with 1/d and d in
    float32, then d and m = min stored as float16. Every step is a float32 operation of its own,
    as there, so the bytes are the same."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    low = blocks.amin(dim=-1, keepdim=True)
    d = (blocks.amax(dim=-1, keepdim=True) - low) / 15
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc((blocks - low) * inverse + 0.5).clamp(0, 15).to(torch.uint8)  # (N, blocks, 32)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    return d.squeeze(-1).half(), low.squeeze(-1).half(), nibbles


def quantize_int8_per_row(weight: Tensor) -> tuple[Tensor, Tensor]:
    """A float weight (N, K) -> int8 quants (N, K/32, 32) (K zero-padded to a multiple of 32)
    and float32 scales (N,): s = max|w| / 127 per row, q = round(w / s), half to even."""
    n, k = weight.shape
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127  # (N,)
    q = torch.round(w / torch.where(scale == 0, torch.ones_like(scale), scale)[:, None]).clamp(-127, 127)
    q = F.pad(q.to(torch.int8), (0, -k % BLOCK))
    return q.view(n, -1, BLOCK), scale


def _kquant(name: str) -> Layout:
    return Layout(
        name, 1, SUPER_BLOCK, True, lambda blocks, scales: gguf_blocks.dequantize_kquant(name, blocks)
    )


# the order is the one error messages list
LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("int4", 8, BLOCK, False, dequantize_int4),
        Layout("int8", 4, BLOCK, False, dequantize_int8),
        Layout("int5", 8, BLOCK, False, gguf_blocks.dequantize_int5),
        _kquant("q4_k"),
        _kquant("q5_k"),
        _kquant("q6_k"),
        Layout("mxfp4", 1, BLOCK, True, lambda blocks, scales: gguf_blocks.dequantize_mxfp4(blocks)),
    )
}
