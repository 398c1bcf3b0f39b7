"""FlashAttention-2 backward kernels: recompute each probability tile from the
saved log-sum-exp, never store one.

With P = exp(S - lse) and dO the output's gradient (D' the dropout mask scaled
by 1 / (1 - p), all ones without dropout):

    dV = (P * D')^T dO            dP = (dO V^T) * D'
    dS = P * (dP - delta)         delta = rowsum(dO * O) - dlse
    dQ = scale * dS~ K            dK = scale * dS~^T Q

where dS~ is dS times the softcap's derivative 1 - tanh^2 (the bias is added
after the cap, so the bias gradient is dS itself, summed over the dims it
broadcasts on).

Two kernels split the work so that no two programs ever add into the same
memory (deterministic results, no atomics): `attention_backward_dkdv` owns a
key tile of one key/value head and loops over the query tiles of every query
head in its group (GQA without repeating K, V); `attention_backward_dq` owns a
query tile and loops over key tiles. The bias gradient is written by the
dK/dV kernel, whose loop runs over queries, so a bias shared by all queries is
summed in registers:

    BIAS_GRAD 1: full (Lq, Lk) bias   -> the dK/dV kernel stores dS tiles
    BIAS_GRAD 2: bias broadcast on Lq -> the dK/dV kernel sums dS over queries

A bias broadcast on Lk (one value per query row) shifts a whole row of scores,
which leaves the softmax unchanged and moves the LSE by the same amount: its
gradient is exactly dlse (0 for a row with no key), which the host writes
without a kernel. (Summing dS over the keys would give the same up to the
rounding of O in rowsum(dO * O), which is far from exact in bfloat16.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashformer.attention.triton.forward import sequence_bounds
from flashformer.attention.triton.scores import (
    LOG2E,
    dot,
    dropout_keep,
    interior_keys,
    interior_queries,
    key_range,
    narrow,
    query_range,
    score_tile,
)


@triton.jit
def attention_backward_delta(
    out_ptr, dout_ptr, dlse_ptr, delta_ptr,
    s_ob, s_oh, s_om, s_od,
    s_gb, s_gh, s_gm, s_gd,
    s_lb, s_lh, s_lm,
    cu_q, LQ, H, DV,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_DLSE: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """delta = rowsum(dO * O) - dlse, one float32 per query (laid out like the LSE)."""
    tile_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    q_start, q_len, _, _ = sequence_bounds(b, cu_q, cu_q, LQ, LQ, VARLEN)
    q0 = tile_m * BLOCK_M
    if q0 >= q_len:
        return
    b64, h64 = b.to(tl.int64), h.to(tl.int64)
    row0 = (q_start + q0).to(tl.int64)
    local_m = tl.arange(0, BLOCK_M)
    dims_v = tl.arange(0, BLOCK_DV)
    ok = ((q0 + local_m) < q_len)[:, None] & (dims_v[None, :] < DV)
    out = tl.load(
        out_ptr + b64 * s_ob + h64 * s_oh + row0 * s_om + local_m[:, None] * s_om + dims_v[None, :] * s_od,
        mask=ok,
        other=0.0,
    ).to(tl.float32)
    dout = tl.load(
        dout_ptr + b64 * s_gb + h64 * s_gh + row0 * s_gm + local_m[:, None] * s_gm + dims_v[None, :] * s_gd,
        mask=ok,
        other=0.0,
    ).to(tl.float32)
    delta = tl.sum(out * dout, 1)  # (M,)
    row_ok = (q0 + local_m) < q_len
    lse_offsets = b64 * s_lb + h64 * s_lh + row0 * s_lm + local_m * s_lm
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + lse_offsets, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(delta_ptr + lse_offsets, delta, mask=row_ok)


@triton.jit
def dkdv_tiles(
    dk, dv, dbias_cols, k, v, cols, col_ok, q_from, q_to,
    q_base, dout_base, lse_rows, delta_rows, s_qm, s_qd, s_gm, s_gd, s_lm,
    bias_base, s_bm, s_bn, mask_base, s_mm, s_mn, pad_base, s_pn, dbias_base, s_dm, s_dn,
    head_key, dropout_threshold, dropout_scale, q_len, k_len, D, DV, scale, softcap, slope,
    window_left, right_limit,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PAD: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    DROPOUT: tl.constexpr, PRECISION: tl.constexpr, BIAS_GRAD: tl.constexpr, EDGE: tl.constexpr,
):  # fmt: skip
    """One key tile's dK, dV (and dbias) over query tiles [q_from, q_to) of one head."""
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    for q0 in range(q_from, q_to, BLOCK_M):
        rows = q0 + tl.arange(0, BLOCK_M)  # (M,) query positions
        row_ok = rows < q_len
        q = tl.load(
            q_base + rows[:, None] * s_qm + dims[None, :] * s_qd,
            mask=row_ok[:, None] & (dims[None, :] < D),
            other=0.0,
        )  # (M, D)
        dout = tl.load(
            dout_base + rows[:, None] * s_gm + dims_v[None, :] * s_gd,
            mask=row_ok[:, None] & (dims_v[None, :] < DV),
            other=0.0,
        )  # (M, Dv)
        # lse -inf (a row with no key) -> +inf so its P is exp2(-inf) = 0, as are rows past the end.
        lse = tl.load(lse_rows + rows * s_lm, mask=row_ok, other=float("-inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        delta = tl.load(delta_rows + rows * s_lm, mask=row_ok, other=0.0)
        qk = dot(q, tl.trans(k), PRECISION)  # (M, N)
        s, capped = score_tile(
            qk, rows, cols, q_len, k_len, scale, softcap,
            bias_base + rows.to(tl.int64)[:, None] * s_bm + cols[None, :] * s_bn,
            mask_base + rows.to(tl.int64)[:, None] * s_mm + cols[None, :] * s_mn,
            pad_base + cols * s_pn,
            slope, window_left, right_limit,
            HAS_SOFTCAP, HAS_BIAS, HAS_MASK, HAS_PAD, HAS_ALIBI, HAS_LEFT, HAS_RIGHT, EDGE,
        )  # fmt: skip
        p = tl.exp2(s - lse[:, None])  # (M, N) probabilities
        dp = dot(dout, tl.trans(v), PRECISION)  # (M, N)
        if DROPOUT:
            keep = dropout_keep(head_key, rows, cols, dropout_threshold)
            p_kept = tl.where(keep, p * dropout_scale, 0.0)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        else:
            p_kept = p
        dv += dot(tl.trans(narrow(p_kept, dout.dtype, PRECISION)), dout, PRECISION)
        ds = p * (dp - delta[:, None])  # (M, N) gradient of the scores after bias
        if BIAS_GRAD == 1:
            tl.store(
                dbias_base + rows.to(tl.int64)[:, None] * s_dm + cols[None, :] * s_dn,
                ds,
                mask=row_ok[:, None] & col_ok[None, :],
            )
        if BIAS_GRAD == 2:
            dbias_cols += tl.sum(ds, 0)
        if HAS_SOFTCAP:
            ds = ds * (1.0 - capped * capped)
        dk += dot(tl.trans(narrow(ds, q.dtype, PRECISION)), q, PRECISION)
    return dk, dv, dbias_cols


@triton.jit
def attention_backward_dkdv(
    q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dbias_ptr,
    s_qb, s_qh, s_qm, s_qd,
    s_kb, s_kh, s_kn, s_kd,
    s_vb, s_vh, s_vn, s_vd,
    s_gb, s_gh, s_gm, s_gd,
    s_lb, s_lh, s_lm,
    s_dkb, s_dkh, s_dkn, s_dkd,
    s_dvb, s_dvh, s_dvn, s_dvd,
    s_db, s_dh, s_dm, s_dn,
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
    DROPOUT: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr, BIAS_GRAD: tl.constexpr,
):  # fmt: skip
    tile_n = tl.program_id(0)
    bhk = tl.program_id(1)
    HK = H // G
    b = bhk // HK
    hk = bhk % HK
    q_start, q_len, k_start, k_len = sequence_bounds(b, cu_q, cu_k, LQ, LK, VARLEN)
    k0 = tile_n * BLOCK_N
    if k0 >= k_len:
        return
    b64, hk64 = b.to(tl.int64), hk.to(tl.int64)
    key_row0 = tl.cast(k_start, tl.int64) + k0
    local_n = tl.arange(0, BLOCK_N)
    cols = k0 + local_n  # (N,) key positions in the sequence
    col_ok = cols < k_len
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    k = tl.load(
        k_ptr + b64 * s_kb + hk64 * s_kh + key_row0 * s_kn + local_n[:, None] * s_kn + dims[None, :] * s_kd,
        mask=col_ok[:, None] & (dims[None, :] < D),
        other=0.0,
    )  # (N, D)
    v = tl.load(
        v_ptr + b64 * s_vb + hk64 * s_vh + key_row0 * s_vn + local_n[:, None] * s_vn + dims_v[None, :] * s_vd,
        mask=col_ok[:, None] & (dims_v[None, :] < DV),
        other=0.0,
    )  # (N, Dv)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    q_lo, q_hi = query_range(
        k0, tl.minimum(k0 + BLOCK_N, k_len), q_len, k_len, window_left, right_limit, HAS_LEFT, HAS_RIGHT
    )
    q_lo = (q_lo // BLOCK_M) * BLOCK_M
    full_lo, full_hi = interior_queries(
        k0, tl.minimum(k0 + BLOCK_N, k_len), q_lo, q_hi, q_len, k_len, window_left, right_limit,
        BLOCK_M, HAS_LEFT, HAS_RIGHT,
    )  # fmt: skip
    q_row0 = tl.cast(q_start, tl.int64)
    pad_base = pad_ptr + b64 * s_pb
    for g in range(G):
        h = hk * G + g
        h64 = h.to(tl.int64)
        q_base = q_ptr + b64 * s_qb + h64 * s_qh + q_row0 * s_qm
        dout_base = dout_ptr + b64 * s_gb + h64 * s_gh + q_row0 * s_gm
        lse_base = b64 * s_lb + h64 * s_lh + q_row0 * s_lm  # offsets shared by lse and delta
        bias_base = bias_ptr + b64 * s_bb + h64 * s_bh
        mask_base = mask_ptr + b64 * s_mb + h64 * s_mh
        dbias_base = dbias_ptr + b64 * s_db + h64 * s_dh
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(slopes_ptr + b * s_ab + h * s_ah).to(tl.float32)
        head_key = 0
        if DROPOUT:
            head_key = tl.load(head_keys_ptr + b * H + h).to(tl.uint32)
        dbias_cols = tl.zeros([BLOCK_N], tl.float32)  # used when BIAS_GRAD == 2
        # Edge query tiles (the band's end inside them) are masked; interior tiles are not.
        if HAS_RIGHT:  # else full_lo == q_lo: no masked tiles before the interior
            dk, dv, dbias_cols = dkdv_tiles(
                dk, dv, dbias_cols, k, v, cols, col_ok, q_lo, tl.minimum(full_lo, q_hi),
                q_base, dout_base, lse_ptr + lse_base, delta_ptr + lse_base, s_qm, s_qd, s_gm, s_gd, s_lm,
                bias_base, s_bm, s_bn, mask_base, s_mm, s_mn, pad_base, s_pn, dbias_base, s_dm, s_dn,
                head_key, dropout_threshold, dropout_scale, q_len, k_len, D, DV, scale, softcap, slope,
                window_left, right_limit, BLOCK_M, BLOCK_D, BLOCK_DV,
                HAS_SOFTCAP, HAS_BIAS, HAS_MASK, HAS_PAD, HAS_ALIBI, HAS_LEFT, HAS_RIGHT,
                DROPOUT, PRECISION, BIAS_GRAD, True,
            )  # fmt: skip
        dk, dv, dbias_cols = dkdv_tiles(
            dk, dv, dbias_cols, k, v, cols, col_ok, full_lo, full_hi,
            q_base, dout_base, lse_ptr + lse_base, delta_ptr + lse_base, s_qm, s_qd, s_gm, s_gd, s_lm,
            bias_base, s_bm, s_bn, mask_base, s_mm, s_mn, pad_base, s_pn, dbias_base, s_dm, s_dn,
            head_key, dropout_threshold, dropout_scale, q_len, k_len, D, DV, scale, softcap, slope,
            window_left, right_limit, BLOCK_M, BLOCK_D, BLOCK_DV,
            HAS_SOFTCAP, HAS_BIAS, HAS_MASK, HAS_PAD, HAS_ALIBI, HAS_LEFT, HAS_RIGHT,
            DROPOUT, PRECISION, BIAS_GRAD, False,
        )  # fmt: skip
        if HAS_LEFT:  # else full_hi >= q_hi: no masked tiles after the interior
            dk, dv, dbias_cols = dkdv_tiles(
                dk, dv, dbias_cols, k, v, cols, col_ok, full_hi, q_hi,
                q_base, dout_base, lse_ptr + lse_base, delta_ptr + lse_base, s_qm, s_qd, s_gm, s_gd, s_lm,
                bias_base, s_bm, s_bn, mask_base, s_mm, s_mn, pad_base, s_pn, dbias_base, s_dm, s_dn,
                head_key, dropout_threshold, dropout_scale, q_len, k_len, D, DV, scale, softcap, slope,
                window_left, right_limit, BLOCK_M, BLOCK_D, BLOCK_DV,
                HAS_SOFTCAP, HAS_BIAS, HAS_MASK, HAS_PAD, HAS_ALIBI, HAS_LEFT, HAS_RIGHT,
                DROPOUT, PRECISION, BIAS_GRAD, True,
            )  # fmt: skip
        if BIAS_GRAD == 2:
            tl.store(dbias_base + cols * s_dn, dbias_cols, mask=col_ok)
    dk *= scale
    tl.store(
        dk_ptr
        + b64 * s_dkb
        + hk64 * s_dkh
        + key_row0 * s_dkn
        + local_n[:, None] * s_dkn
        + dims[None, :] * s_dkd,
        narrow(dk, dk_ptr.dtype.element_ty, PRECISION),
        mask=col_ok[:, None] & (dims[None, :] < D),
    )
    tl.store(
        dv_ptr
        + b64 * s_dvb
        + hk64 * s_dvh
        + key_row0 * s_dvn
        + local_n[:, None] * s_dvn
        + dims_v[None, :] * s_dvd,
        narrow(dv, dv_ptr.dtype.element_ty, PRECISION),
        mask=col_ok[:, None] & (dims_v[None, :] < DV),
    )


@triton.jit
def dq_tiles(
    dq, q, dout, lse, delta, rows, k_from, k_to, k_base, v_base, s_kn, s_kd, s_vn, s_vd,
    bias_base, s_bm, s_bn, mask_base, s_mm, s_mn, pad_base, s_pn,
    head_key, dropout_threshold, dropout_scale, q_len, k_len, D, DV, scale, softcap, slope,
    window_left, right_limit,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_PAD: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    DROPOUT: tl.constexpr, PRECISION: tl.constexpr, EDGE: tl.constexpr,
):  # fmt: skip
    """One query tile's dQ (unscaled) over key tiles [k_from, k_to)."""
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
        qk = dot(q, tl.trans(k), PRECISION)  # (M, N)
        s, capped = score_tile(
            qk, rows, cols, q_len, k_len, scale, softcap,
            bias_base + rows.to(tl.int64)[:, None] * s_bm + cols[None, :] * s_bn,
            mask_base + rows.to(tl.int64)[:, None] * s_mm + cols[None, :] * s_mn,
            pad_base + cols * s_pn,
            slope, window_left, right_limit,
            HAS_SOFTCAP, HAS_BIAS, HAS_MASK, HAS_PAD, HAS_ALIBI, HAS_LEFT, HAS_RIGHT, EDGE,
        )  # fmt: skip
        p = tl.exp2(s - lse[:, None])  # (M, N)
        dp = dot(dout, tl.trans(v), PRECISION)  # (M, N)
        if DROPOUT:
            keep = dropout_keep(head_key, rows, cols, dropout_threshold)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - capped * capped)
        dq += dot(narrow(ds, k.dtype, PRECISION), k, PRECISION)
    return dq


@triton.jit
def attention_backward_dq(
    q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, delta_ptr, dq_ptr,
    s_qb, s_qh, s_qm, s_qd,
    s_kb, s_kh, s_kn, s_kd,
    s_vb, s_vh, s_vn, s_vd,
    s_gb, s_gh, s_gm, s_gd,
    s_lb, s_lh, s_lm,
    s_dqb, s_dqh, s_dqm, s_dqd,
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
    q_row0 = (q_start + q0).to(tl.int64)
    local_m = tl.arange(0, BLOCK_M)
    rows = q0 + local_m  # (M,) query positions in the sequence
    row_ok = rows < q_len
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + b64 * s_qb + h64 * s_qh + q_row0 * s_qm + local_m[:, None] * s_qm + dims[None, :] * s_qd,
        mask=row_ok[:, None] & (dims[None, :] < D),
        other=0.0,
    )  # (M, D)
    dout = tl.load(
        dout_ptr + b64 * s_gb + h64 * s_gh + q_row0 * s_gm + local_m[:, None] * s_gm + dims_v[None, :] * s_gd,
        mask=row_ok[:, None] & (dims_v[None, :] < DV),
        other=0.0,
    )  # (M, Dv)
    lse_offsets = b64 * s_lb + h64 * s_lh + q_row0 * s_lm + local_m * s_lm
    lse = tl.load(lse_ptr + lse_offsets, mask=row_ok, other=float("-inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # no key -> P = 0
    delta = tl.load(delta_ptr + lse_offsets, mask=row_ok, other=0.0)

    k_base = k_ptr + b64 * s_kb + hk64 * s_kh + tl.cast(k_start, tl.int64) * s_kn
    v_base = v_ptr + b64 * s_vb + hk64 * s_vh + tl.cast(k_start, tl.int64) * s_vn
    bias_base = bias_ptr + b64 * s_bb + h64 * s_bh
    mask_base = mask_ptr + b64 * s_mb + h64 * s_mh
    pad_base = pad_ptr + b64 * s_pb
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(slopes_ptr + b * s_ab + h * s_ah).to(tl.float32)
    head_key = 0
    if DROPOUT:
        head_key = tl.load(head_keys_ptr + bh).to(tl.uint32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_lo, k_hi = key_range(
        q0, tl.minimum(q0 + BLOCK_M, q_len), q_len, k_len, window_left, right_limit, HAS_LEFT, HAS_RIGHT
    )
    k_lo = (k_lo // BLOCK_N) * BLOCK_N
    full_lo, full_hi = interior_keys(
        q0, tl.minimum(q0 + BLOCK_M, q_len), k_lo, k_hi, q_len, k_len, window_left, right_limit,
        BLOCK_N, HAS_LEFT, HAS_RIGHT,
    )  # fmt: skip
    # Edge key tiles (the band's or the sequence's end inside them) are masked; interior tiles are not.
    if HAS_LEFT:  # else full_lo == k_lo: no masked tiles before the interior
        dq = dq_tiles(
            dq, q, dout, lse, delta, rows, k_lo, tl.minimum(full_lo, k_hi), k_base, v_base, s_kn, s_kd, s_vn, s_vd,
            bias_base, s_bm, s_bn, mask_base, s_mm, s_mn, pad_base, s_pn,
            head_key, dropout_threshold, dropout_scale, q_len, k_len, D, DV, scale, softcap, slope,
            window_left, right_limit, BLOCK_N, BLOCK_D, BLOCK_DV,
            HAS_SOFTCAP, HAS_BIAS, HAS_MASK, HAS_PAD, HAS_ALIBI, HAS_LEFT, HAS_RIGHT,
            DROPOUT, PRECISION, True,
        )  # fmt: skip
    dq = dq_tiles(
        dq, q, dout, lse, delta, rows, full_lo, full_hi, k_base, v_base, s_kn, s_kd, s_vn, s_vd,
        bias_base, s_bm, s_bn, mask_base, s_mm, s_mn, pad_base, s_pn,
        head_key, dropout_threshold, dropout_scale, q_len, k_len, D, DV, scale, softcap, slope,
        window_left, right_limit, BLOCK_N, BLOCK_D, BLOCK_DV,
        HAS_SOFTCAP, HAS_BIAS, HAS_MASK, HAS_PAD, HAS_ALIBI, HAS_LEFT, HAS_RIGHT,
        DROPOUT, PRECISION, False,
    )  # fmt: skip
    dq = dq_tiles(
        dq, q, dout, lse, delta, rows, full_hi, k_hi, k_base, v_base, s_kn, s_kd, s_vn, s_vd,
        bias_base, s_bm, s_bn, mask_base, s_mm, s_mn, pad_base, s_pn,
        head_key, dropout_threshold, dropout_scale, q_len, k_len, D, DV, scale, softcap, slope,
        window_left, right_limit, BLOCK_N, BLOCK_D, BLOCK_DV,
        HAS_SOFTCAP, HAS_BIAS, HAS_MASK, HAS_PAD, HAS_ALIBI, HAS_LEFT, HAS_RIGHT,
        DROPOUT, PRECISION, True,
    )  # fmt: skip
    dq *= scale
    tl.store(
        dq_ptr
        + b64 * s_dqb
        + h64 * s_dqh
        + q_row0 * s_dqm
        + local_m[:, None] * s_dqm
        + dims[None, :] * s_dqd,
        narrow(dq, dq_ptr.dtype.element_ty, PRECISION),
        mask=row_ok[:, None] & (dims[None, :] < D),
    )
