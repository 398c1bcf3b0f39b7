"""FlashAttention-2 forward kernel.

One program owns BLOCK_M queries of one (batch, head). It keeps their running
row max m, row sum l and output accumulator in registers and walks the key
tiles that the causal/window band lets them see (tiles wholly outside it are
never loaded), so the (Lq, Lk) score matrix never exists outside one tile. The
output and the log-sum-exp are written once at the end.

The same kernel serves padded batches (q: (B, Hq, Lq, D)) and packed
variable-length batches (q: (total_q, Hq, D) with cu_seqlens): every sequence
reads its start and length from cu_seqlens when VARLEN, and a batch stride of
0 makes the two layouts one pointer formula.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashformer.attention.triton.scores import (
    LOG2E,
    dot,
    dropout_keep,
    interior_keys,
    key_range,
    narrow,
    score_tile,
)


@triton.jit
def sequence_bounds(b, cu_q, cu_k, LQ, LK, VARLEN: tl.constexpr):
    """(q_start, q_len, k_start, k_len) of sequence b."""
    if VARLEN:
        q_start = tl.load(cu_q + b)
        q_len = tl.load(cu_q + b + 1) - q_start
        k_start = tl.load(cu_k + b)
        k_len = tl.load(cu_k + b + 1) - k_start
    else:
        q_start = 0
        q_len = LQ
        k_start = 0
        k_len = LK
    return q_start, q_len, k_start, k_len


@triton.jit
def forward_tiles(
    acc, row_max, row_sum, q, rows, k_from, k_to, k_base, v_base, s_kn, s_kd, s_vn, s_vd,
    bias_base, s_bm, s_bn, mask_base, s_mm, s_mn, pad_base, s_pn,
    head_key, dropout_threshold, q_len, k_len, D, DV, scale, softcap, slope, window_left, right_limit,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PAD: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    DROPOUT: tl.constexpr, PRECISION: tl.constexpr, EDGE: tl.constexpr,
):  # fmt: skip
    """The online softmax over key tiles [k_from, k_to): returns (acc, row_max, row_sum) updated."""
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    for k0 in range(k_from, k_to, BLOCK_N):
        cols = k0 + tl.arange(0, BLOCK_N)  # (N,) key positions
        col_ok = cols < k_len
        k = tl.load(
            k_base + cols[:, None] * s_kn + dims[None, :] * s_kd,
            mask=col_ok[:, None] & (dims[None, :] < D),
            other=0.0,
        )  # (N, D)
        v = tl.load(
            v_base + cols[:, None] * s_vn + dims_v[None, :] * s_vd,
            mask=col_ok[:, None] & (dims_v[None, :] < DV),
            other=0.0,
        )  # (N, Dv)
        qk = dot(q, tl.trans(k), PRECISION)  # (M, N) float32
        s, _ = score_tile(
            qk, rows, cols, q_len, k_len, scale, softcap,
            bias_base + rows.to(tl.int64)[:, None] * s_bm + cols[None, :] * s_bn,
            mask_base + rows.to(tl.int64)[:, None] * s_mm + cols[None, :] * s_mn,
            pad_base + cols * s_pn,
            slope, window_left, right_limit,
            HAS_SOFTCAP, HAS_BIAS, HAS_MASK, HAS_PAD, HAS_ALIBI, HAS_LEFT, HAS_RIGHT, EDGE,
        )  # fmt: skip
        new_max = tl.maximum(row_max, tl.max(s, 1))
        # A row with no allowed key so far keeps max -inf; subtracting 0 then
        # gives exp2(-inf) = 0 instead of exp2(-inf + inf) = NaN.
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp2(row_max - safe_max)  # (M,)
        p = tl.exp2(s - safe_max[:, None])  # (M, N) unnormalized probabilities
        row_sum = row_sum * correction + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(dropout_keep(head_key, rows, cols, dropout_threshold), p, 0.0)
        acc = acc * correction[:, None] + dot(narrow(p, v.dtype, PRECISION), v, PRECISION)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit
def attention_forward(
    q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
    s_qb, s_qh, s_qm, s_qd,
    s_kb, s_kh, s_kn, s_kd,
    s_vb, s_vh, s_vn, s_vd,
    s_ob, s_oh, s_om, s_od,
    s_lb, s_lh, s_lm,
    bias_ptr, s_bb, s_bh, s_bm, s_bn,
    mask_ptr, s_mb, s_mh, s_mm, s_mn,
    pad_ptr, s_pb, s_pn,
    slopes_ptr, s_ab, s_ah,
    head_keys_ptr, dropout_threshold, dropout_scale,
    cu_q, cu_k, LQ, LK, H, G, D, DV,
    scale, softcap, window_left, right_limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PAD: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    DROPOUT: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    tile_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    q_start, q_len, k_start, k_len = sequence_bounds(b, cu_q, cu_k, LQ, LK, VARLEN)
    q0 = tile_m * BLOCK_M
    if q0 >= q_len:
        return
    b64, h64, hk64 = b.to(tl.int64), h.to(tl.int64), (h // G).to(tl.int64)
    q_base = q_ptr + b64 * s_qb + h64 * s_qh + (q_start + q0).to(tl.int64) * s_qm
    k_base = k_ptr + b64 * s_kb + hk64 * s_kh + tl.cast(k_start, tl.int64) * s_kn
    v_base = v_ptr + b64 * s_vb + hk64 * s_vh + tl.cast(k_start, tl.int64) * s_vn

    local_m = tl.arange(0, BLOCK_M)
    rows = q0 + local_m  # (M,) query positions in the sequence
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_base + local_m[:, None] * s_qm + dims[None, :] * s_qd,
        mask=(rows[:, None] < q_len) & (dims[None, :] < D),
        other=0.0,
    )  # (M, D)

    bias_base = bias_ptr + b64 * s_bb + h64 * s_bh
    mask_base = mask_ptr + b64 * s_mb + h64 * s_mh
    pad_base = pad_ptr + b64 * s_pb
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(slopes_ptr + b * s_ab + h * s_ah).to(tl.float32)
    head_key = 0
    if DROPOUT:
        head_key = tl.load(head_keys_ptr + bh).to(tl.uint32)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)  # log2 units
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    k_lo, k_hi = key_range(
        q0, tl.minimum(q0 + BLOCK_M, q_len), q_len, k_len, window_left, right_limit, HAS_LEFT, HAS_RIGHT
    )
    k_lo = (k_lo // BLOCK_N) * BLOCK_N
    full_lo, full_hi = interior_keys(
        q0, tl.minimum(q0 + BLOCK_M, q_len), k_lo, k_hi, q_len, k_len, window_left, right_limit,
        BLOCK_N, HAS_LEFT, HAS_RIGHT,
    )  # fmt: skip
    # Edge tiles (the band's or the sequence's end inside them) are masked; interior tiles are not.
    if HAS_LEFT:  # else full_lo == k_lo: no masked tiles before the interior
        acc, row_max, row_sum = forward_tiles(
            acc, row_max, row_sum, q, rows, k_lo, tl.minimum(full_lo, k_hi), k_base, v_base, s_kn, s_kd, s_vn, s_vd,
            bias_base, s_bm, s_bn, mask_base, s_mm, s_mn, pad_base, s_pn,
            head_key, dropout_threshold, q_len, k_len, D, DV, scale, softcap, slope, window_left, right_limit,
            BLOCK_N, BLOCK_D, BLOCK_DV, HAS_SOFTCAP, HAS_BIAS, HAS_MASK, HAS_PAD, HAS_ALIBI, HAS_LEFT, HAS_RIGHT,
            DROPOUT, PRECISION, True,
        )  # fmt: skip
    acc, row_max, row_sum = forward_tiles(
        acc, row_max, row_sum, q, rows, full_lo, full_hi, k_base, v_base, s_kn, s_kd, s_vn, s_vd,
        bias_base, s_bm, s_bn, mask_base, s_mm, s_mn, pad_base, s_pn,
        head_key, dropout_threshold, q_len, k_len, D, DV, scale, softcap, slope, window_left, right_limit,
        BLOCK_N, BLOCK_D, BLOCK_DV, HAS_SOFTCAP, HAS_BIAS, HAS_MASK, HAS_PAD, HAS_ALIBI, HAS_LEFT, HAS_RIGHT,
        DROPOUT, PRECISION, False,
    )  # fmt: skip
    acc, row_max, row_sum = forward_tiles(
        acc, row_max, row_sum, q, rows, full_hi, k_hi, k_base, v_base, s_kn, s_kd, s_vn, s_vd,
        bias_base, s_bm, s_bn, mask_base, s_mm, s_mn, pad_base, s_pn,
        head_key, dropout_threshold, q_len, k_len, D, DV, scale, softcap, slope, window_left, right_limit,
        BLOCK_N, BLOCK_D, BLOCK_DV, HAS_SOFTCAP, HAS_BIAS, HAS_MASK, HAS_PAD, HAS_ALIBI, HAS_LEFT, HAS_RIGHT,
        DROPOUT, PRECISION, True,
    )  # fmt: skip

    no_key = row_sum == 0.0
    out = acc * (dropout_scale / tl.where(no_key, 1.0, row_sum))[:, None]  # (M, Dv)
    lse = tl.where(
        no_key, float("-inf"), (row_max + tl.log2(tl.where(no_key, 1.0, row_sum))) / LOG2E
    )  # (M,) natural log
    row_ok = rows < q_len
    out_base = out_ptr + b64 * s_ob + h64 * s_oh + (q_start + q0).to(tl.int64) * s_om
    tl.store(
        out_base + local_m[:, None] * s_om + dims_v[None, :] * s_od,
        narrow(out, out_ptr.dtype.element_ty, PRECISION),
        mask=row_ok[:, None] & (dims_v[None, :] < DV),
    )
    lse_base = lse_ptr + b64 * s_lb + h64 * s_lh + (q_start + q0).to(tl.int64) * s_lm
    tl.store(lse_base + local_m * s_lm, lse, mask=row_ok)
