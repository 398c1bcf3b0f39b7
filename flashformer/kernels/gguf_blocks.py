"""GGUF's 5-bit (Q5_0, Q5_1), K-quant (Q4_K, Q5_K, Q6_K) and MXFP4 blocks for the quantized
layers (layouts.py's "int5", "q4_k", "q5_k", "q6_k", "mxfp4"): their fields and their
dequantization (gguf's float32 arithmetic, bit for bit).

- "int5" (Q5_1, and Q5_0 as Q5_1 with m = -16 d, exact in float16): int4's packing (groups of 8
  rows, GGUF's nibble order, d and m float16) plus each row's 32 fifth bits in one uint32,
  rearranged so that the kernels' transposed 4-byte words find theirs with one shift: byte k,
  bit i holds q[4i + k]'s and bit 4 + i q[16 + 4i + k]'s (FIFTH_BIT_SOURCE).
      qweight uint8 (groups, blocks, 160): the 8 rows' 16 nibble bytes, then their 8 uint32 words
      scales float16 (groups, blocks, 2, 8), as int4's
- "q4_k", "q5_k", "q6_k": the file's blocks as they are, row after row: uint8 (N, K / 256,
  144 / 176 / 210). Nothing is repacked (the C++ kernels read ggml's block structs), so the tensor
  may be the file's own bytes.
- "mxfp4" (gpt-oss's experts): the file's blocks of 32 as they are, uint8 (N, K / 32, 17): byte 0
  an e8m0 exponent e (the block's scale 2^(e - 127)), then 16 bytes of e2m1 codes (byte j: value
  j in the low nibble, value j + 16 in the high). A code's value doubled is an integer
  (E2M1_DOUBLED), so w = E2M1_DOUBLED[code] * 2^(e - 128), exact in float32.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

SUPER_BLOCK = 256  # values per K-quant block (GGUF's QK_K)
# bit p of an int5 row's word holds the fifth bit of quant FIFTH_BIT_SOURCE[p] (see above)
FIFTH_BIT_SOURCE = [
    (4 * (p % 8) + p // 8) if p % 8 < 4 else (16 + 4 * (p % 8 - 4) + p // 8) for p in range(32)
]


def _halves(data: Tensor, start: int) -> Tensor:
    """float16 fields at byte `start` of every block, as float32: (..., blocks, bytes) -> (..., blocks)."""
    return data[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1).float()


# ---- int5 (Q5_0, Q5_1) ----


def fifth_bit_words(qh: Tensor) -> Tensor:
    """GGUF's qh bytes (..., 4) (bit j of the little-endian word: q[j]'s fifth bit) -> the packed
    layout's word (...,) int32, its bits rearranged as FIFTH_BIT_SOURCE says.

    Each input bit lands on one output bit, so the word is the OR (here: the sum of disjoint
    bits) of four 256-entry tables, one per input byte: four gathers, where spreading every
    bit to its own int64 took 0.8 s for Gemma 3 270M's Q5_0 tensors."""
    word = _fifth_bit_tables().gather(1, qh.reshape(-1, 4).to(torch.int64).t()).sum(0)  # (n,)
    word = torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)
    return word.view(qh.shape[:-1])


@functools.cache
def _fifth_bit_tables() -> Tensor:
    """(4, 256) int64: table[i][v] = the output bits that byte i of the qh word set when it is v.
    Made on first use, not at import: PyTorch's allocator reads THP_MEM_ALLOC_ENABLE at its first
    allocation, so a tensor made while flashformer is imported would switch huge pages off for the
    whole process (kernels.huge_pages)."""
    destination = [0] * 32
    for p, j in enumerate(FIFTH_BIT_SOURCE):
        destination[j] = p  # input bit j -> output bit p
    values = torch.arange(256)
    tables = torch.zeros(4, 256, dtype=torch.int64)
    for i in range(4):
        for bit in range(8):
            tables[i] += ((values >> bit) & 1) << destination[8 * i + bit]
    return tables


def gguf_bits_of(words: Tensor) -> Tensor:
    """The packed words (...,) int32 -> the fifth bits (..., 32) uint8 in input order."""
    bits = ((words.to(torch.int64) & 0xFFFFFFFF)[..., None] >> torch.arange(32)) & 1  # bit p
    out = torch.empty_like(bits)
    out[..., FIFTH_BIT_SOURCE] = bits
    return out.to(torch.uint8)


def parse_int5(type_name: str, data: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Q5_0 / Q5_1 blocks uint8 (N, blocks, 22 or 24) -> (d, m float16 (N, blocks), nibbles uint8
    (N, blocks, 16), fifth-bit words int32 (N, blocks))."""
    d = data[..., :2].contiguous().view(torch.float16).squeeze(-1)
    if type_name == "Q5_1":
        m, rest = data[..., 2:4].contiguous().view(torch.float16).squeeze(-1), data[..., 4:]
    else:
        m, rest = d * -16, data[..., 2:]
        if not torch.isfinite(m).all():
            raise ValueError("raw_uint8_blocks: a Q5_0 scale d is too large for m = -16 d in float16")
    return d, m, rest[..., 4:], fifth_bit_words(rest[..., :4])


def dequantize_int5(qweight: Tensor, scales: Tensor) -> Tensor:
    """Packed int5 -> float32 (G * 8, K): d * q + m, as gguf's dequantizer rounds it."""
    groups, blocks = qweight.shape[:2]
    nibbles = qweight[..., :128].reshape(groups, blocks, 8, 16)
    words = qweight[..., 128:].contiguous().view(torch.int32)  # (G, blocks, 8)
    q = torch.cat((nibbles & 15, nibbles >> 4), dim=3) | (gguf_bits_of(words) << 4)  # (G, blocks, 8, 32)
    d, m = scales.float().unbind(2)  # (G, blocks, 8) each
    weight = d[..., None] * q.float() + m[..., None]
    return weight.permute(0, 2, 1, 3).reshape(groups * 8, blocks * 32)


def int5_rows(qweight: Tensor, scales: Tensor, ids: Tensor) -> Tensor:
    """Rows `ids` (L,) of a packed int5 matrix, dequantized: (L, K) float32."""
    group, row = ids // 8, ids % 8
    nibbles = qweight[group, :, :128].view(len(ids), -1, 8, 16)[
        torch.arange(len(ids)), :, row
    ]  # (L, blocks, 16)
    words = (
        qweight[group, :, 128:].contiguous().view(torch.int32)[torch.arange(len(ids)), :, row]
    )  # (L, blocks)
    q = torch.cat((nibbles & 15, nibbles >> 4), dim=-1) | (gguf_bits_of(words) << 4)  # (L, blocks, 32)
    d, m = scales[group, :, :, row].float().unbind(-1)  # (L, blocks) each
    return (d[..., None] * q.float() + m[..., None]).reshape(len(ids), -1)


# ---- K-quants ----


def _scales_mins(packed: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K / Q5_K's 12 scale bytes (..., 12) -> 6-bit scales and minimums (..., 8) each."""
    low, mid, top = packed.unflatten(-1, (3, 4)).unbind(-2)  # (..., 4) each
    scales = torch.cat((low & 63, (top & 15) | ((low >> 2) & 48)), dim=-1)
    mins = torch.cat((mid & 63, (top >> 4) | ((mid >> 2) & 48)), dim=-1)
    return scales, mins


def dequantize_kquant(fmt: str, blocks: Tensor) -> Tensor:
    """K-quant blocks (R, nb, bytes) -> float32 (R, nb * 256), gguf's float32 operations in
    gguf's order: Q4_K / Q5_K (d * sc) * q - (dmin * m), Q6_K (d * sc) * (q - 32)."""
    rows, nb = blocks.shape[:2]
    if fmt == "q6_k":
        ql = blocks[..., :128].unflatten(-1, (2, 64))  # (R, nb, 2 halves, 64)
        low = torch.cat((ql & 15, ql >> 4), dim=-1).unflatten(-1, (4, 32))  # (R, nb, 2, 4, 32)
        qh = blocks[..., 128:192].unflatten(-1, (2, 1, 32))
        high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]) & 3  # (R, nb, 2, 4, 32)
        q = (low | (high << 4)).to(torch.float32).reshape(rows, nb, 16, 16) - 32
        sc = blocks[..., 192:208].contiguous().view(torch.int8).float()  # (R, nb, 16)
        d = _halves(blocks, 208)[..., None] * sc
        return (d[..., None] * q).reshape(rows, nb * SUPER_BLOCK)
    sc, mins = _scales_mins(blocks[..., 4:16])  # (R, nb, 8) each
    qs = blocks[..., -128:].unflatten(-1, (4, 1, 32))  # (R, nb, 4, 1, 32)
    q = torch.cat((qs & 15, qs >> 4), dim=-2).reshape(rows, nb, 8, 32)
    if fmt == "q5_k":
        qh = blocks[..., 16:48][..., None, :]  # (R, nb, 1, 32)
        q = q | (((qh >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1) << 4)
    d = _halves(blocks, 0)[..., None] * sc.float()  # (R, nb, 8)
    dm = _halves(blocks, 2)[..., None] * mins.float()
    return (d[..., None] * q.float() - dm[..., None]).reshape(rows, nb * SUPER_BLOCK)


# ---- MXFP4 ----

# e2m1's values doubled, by code (bit 3 the sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6 times 2
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def e8m0_half(e: Tensor) -> Tensor:
    """e8m0 exponents (uint8) -> 2^(e - 128) float32, as ggml's e8m0 "half" (subnormal for e = 0,
    1: its bit patterns 2^21 << e; otherwise the exponent field e - 1)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def dequantize_mxfp4(blocks: Tensor) -> Tensor:
    """MXFP4 blocks (R, nb, 17) -> float32 (R, nb * 32): doubled value times 2^(e - 128), gguf's values."""
    rows, nb = blocks.shape[:2]
    codes = blocks[..., 1:]  # (R, nb, 16)
    nibbles = torch.cat((codes & 15, codes >> 4), dim=-1).long()  # (R, nb, 32), values in order
    doubled = torch.tensor(E2M1_DOUBLED, dtype=torch.float32)[nibbles]
    return (doubled * e8m0_half(blocks[..., :1])).reshape(rows, nb * 32)
