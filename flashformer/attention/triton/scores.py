"""Device functions every Triton kernel shares: one score tile under the
ScoreRules (masks.py), and the dropout hash.

A kernel hands `score_tile` the raw q @ k^T tile and the positions of its rows
and columns within their sequence; it gets back the scores in log2 units
(s * log2(e), so that the softmax can use exp2) with -inf wherever the key may
not be seen, in the same order as masks.py:

    s = scale * q k^T -> softcap -> + bias + ALiBi -> -inf where not allowed

It also returns tanh(scale * q k^T / softcap), the softcap's derivative being
1 - tanh^2, which the backward kernels need.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # a global a kernel may read must be a constexpr


@triton.jit
def dot(a, b, PRECISION: tl.constexpr):
    """a @ b accumulated in float32.

    PRECISION "ieee" (float32 inputs: true float32 products, as the eager
    backend computes them, not TF32) or "tf32" (ignored for 16-bit inputs).
    "bf16_as_fp32" exists for Triton's CPU interpreter only, whose tl.dot
    multiplies bfloat16 tiles as their raw uint16 bits: the bfloat16 values
    are widened to float32 first, which gives what a GPU's bf16 tensor cores
    compute (exact products, float32 sums) — every rounding to bfloat16 in the
    kernel still happens before the dot.
    """
    if PRECISION == "bf16_as_fp32":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def narrow(x, dtype: tl.constexpr, PRECISION: tl.constexpr):
    """float32 -> dtype, rounded to nearest even (as the GPU converts).

    Triton's CPU interpreter converts float32 to bfloat16 by truncation (and
    its round-to-nearest mode drops the carry into the exponent), so there
    the rounding is done on the bits: add 0x7FFF plus the lowest kept bit,
    keep the top 16 bits.
    """
    if PRECISION == "bf16_as_fp32":
        bits = x.to(tl.uint32, bitcast=True)
        bits += 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def mix32(x):
    """lowbias32 on uint32: the same bits as masks.mix32 computes on int32 words."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B  # >= 2**31, so Triton types the literal as uint32
    x ^= x >> 16
    return x


@triton.jit
def dropout_keep(head_key, rows, cols, threshold):
    """(M, N) bool: True where entry (rows[i], cols[j]) of head `head_key` is kept.

    head_key: a uint32 scalar (masks.dropout_head_keys); threshold: int64,
    masks.dropout_threshold(p). Dropped iff mix32(mix32(key ^ i) ^ mix32(j)) < threshold.
    """
    row_keys = mix32(head_key ^ rows.to(tl.uint32))  # (M,)
    col_keys = mix32(cols.to(tl.uint32))  # (N,)
    bits = mix32(row_keys[:, None] ^ col_keys[None, :])  # (M, N)
    return bits.to(tl.int64) >= threshold


@triton.jit
def tanh(x):
    """tanh from exp, exact to float32 rounding at both tails (exp overflow gives +-1)."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def score_tile(
    qk,  # (M, N) float32: q @ k^T, unscaled
    rows,  # (M,) int32: query positions within the sequence
    cols,  # (N,) int32: key positions within the sequence
    q_len,
    k_len,
    scale,
    softcap,
    bias_ptrs,  # (M, N) pointers into the bias (broadcast strides already applied)
    mask_ptrs,  # (M, N) pointers into the bool mask viewed as uint8
    pad_ptrs,  # (N,) pointers into this sequence's key padding mask (uint8)
    slope,  # float32 ALiBi slope of this (batch, head)
    window_left,
    right_limit,
    HAS_SOFTCAP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    EDGE: tl.constexpr,
):
    """Returns (scores * log2(e) with -inf where not allowed, tanh for the softcap's gradient).

    EDGE: the tile may hold pairs outside the causal/window band or keys past
    the end of the sequence. Tiles that the kernels know to be wholly inside
    (see interior_keys / interior_queries) skip that masking work; key padding
    and the bool mask are tensors and always apply.
    """
    inside = (rows[:, None] < q_len) & (cols[None, :] < k_len)  # (M, N)
    diagonal = rows + (k_len - q_len)  # (M,) key position of each query (bottom-right)
    if HAS_SOFTCAP:
        capped = tanh(qk * (scale / softcap))
        s = capped * (softcap * LOG2E)
    else:
        capped = qk
        s = qk * (scale * LOG2E)
    if HAS_BIAS:
        s += tl.load(bias_ptrs, mask=inside, other=0.0).to(tl.float32) * LOG2E
    if HAS_ALIBI:
        distance = tl.abs(diagonal[:, None] - cols[None, :]).to(tl.float32)
        s -= (slope * LOG2E) * distance
    if EDGE:
        allowed = inside
        if HAS_RIGHT:
            allowed &= cols[None, :] <= diagonal[:, None] + right_limit
        if HAS_LEFT:
            allowed &= cols[None, :] >= diagonal[:, None] - window_left
        s = tl.where(allowed, s, float("-inf"))
    if HAS_PAD:
        s = tl.where(tl.load(pad_ptrs, mask=cols < k_len, other=0)[None, :] != 0, s, float("-inf"))
    if HAS_MASK:
        s = tl.where(tl.load(mask_ptrs, mask=inside, other=0) != 0, s, float("-inf"))
    return s, capped


@triton.jit
def key_range(
    q0, q1, q_len, k_len, window_left, right_limit, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr
):
    """Half-open range of keys that queries [q0, q1) may see (ScoreRules.key_range)."""
    offset = k_len - q_len
    k_lo = 0
    k_hi = k_len
    if HAS_LEFT:
        k_lo = tl.maximum(0, q0 + offset - window_left)
    if HAS_RIGHT:
        k_hi = tl.minimum(k_len, q1 + offset + right_limit)
    return k_lo, k_hi


@triton.jit
def query_range(
    k0, k1, q_len, k_len, window_left, right_limit, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr
):
    """Half-open range of queries that may see any key in [k0, k1) (ScoreRules.query_range)."""
    offset = k_len - q_len
    q_lo = 0
    q_hi = q_len
    if HAS_RIGHT:
        q_lo = tl.maximum(0, k0 - offset - right_limit)
    if HAS_LEFT:
        q_hi = tl.minimum(q_len, k1 + window_left - offset)
    return q_lo, q_hi


# Integer division below only ever sees non-negative operands: the GPU
# truncates toward zero where the interpreter (numpy) floors.


@triton.jit
def interior_keys(
    q0, q1, k_lo, k_hi, q_len, k_len, window_left, right_limit,
    BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):  # fmt: skip
    """[lo, hi): the key tiles of [k_lo, k_hi) (k_lo a multiple of BLOCK_N) whose
    keys all exist and are all allowed by the band to every query in [q0, q1).
    k_lo <= lo <= hi <= k_hi, lo and hi multiples of BLOCK_N (hi = lo if none)."""
    offset = k_len - q_len
    lo = k_lo
    if HAS_LEFT:  # the last query's first key
        first = tl.maximum(q1 - 1 + offset - window_left, 0)
        lo = tl.maximum(lo, ((first + BLOCK_N - 1) // BLOCK_N) * BLOCK_N)
    hi = tl.minimum((k_len // BLOCK_N) * BLOCK_N, k_hi)
    if HAS_RIGHT:  # the first query's last key, + 1
        end = tl.maximum(q0 + offset + right_limit + 1, 0)
        hi = tl.minimum(hi, (end // BLOCK_N) * BLOCK_N)
    hi = tl.maximum(hi, lo)
    return lo, hi


@triton.jit
def interior_queries(
    k0, k1, q_lo, q_hi, q_len, k_len, window_left, right_limit,
    BLOCK_M: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):  # fmt: skip
    """[lo, hi): the query tiles from q_lo (a multiple of BLOCK_M) whose queries
    the band allows every key in [k0, k1). Queries past the end of the
    sequence may be among them: their probabilities are 0 from their LSE."""
    offset = k_len - q_len
    lo = q_lo
    if HAS_RIGHT:  # queries that see the last key
        first = tl.maximum(k1 - 1 - offset - right_limit, 0)
        lo = tl.maximum(lo, ((first + BLOCK_M - 1) // BLOCK_M) * BLOCK_M)
    hi = q_lo + ((tl.maximum(q_hi - q_lo, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M  # past the last tile
    if HAS_LEFT:  # queries that see the first key, + 1
        end = tl.maximum(k0 - offset + window_left + 1, 0)
        hi = tl.minimum(hi, (end // BLOCK_M) * BLOCK_M)
    hi = tl.maximum(hi, lo)
    return lo, hi
