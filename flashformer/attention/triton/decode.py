"""Split-KV decoding (FlashDecoding): few new queries against a long KV cache.

A decode step has one (or a few) queries per sequence, so one program per
query tile would leave most of a GPU idle while it walks the whole cache. The
keys are instead cut into `num_splits` ranges: program (split, b, kv head)
reads one range of keys once and serves every query head of its GQA group
with it (the G heads x Lq queries are the rows of one tile). Each writes a
partial output normalized by its own row sum, and its log-sum-exp; a combine
kernel then weighs the partials by exp(lse_split - lse) — the same rescaling
the online softmax does, once per split instead of once per tile.

Each sequence's cache holds cache_seqlens[b] valid keys; the Lq new queries
are its last Lq positions (bottom-right alignment, as everywhere).

The same split kernel reads a paged cache (PAGED, see attention/paged.py):
key position p of sequence b then lives in block block_table[b, p // PAGE_SIZE]
of the pool, at offset p % PAGE_SIZE; each key tile's rows are found through
the table, and nothing is gathered. For the paged cache the splits have a fixed
length and `combine_in_order` adds a row's partials one split after the other,
up to that row's own last split: a sequence's result then depends on its own
keys only, never on the batch it was computed in (batch invariance).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashformer.attention.triton.scores import LOG2E, dot, key_range, narrow, score_tile


@triton.jit
def decode_split(
    q_ptr, k_ptr, v_ptr, seqlens_ptr, part_out_ptr, part_lse_ptr,
    s_qb, s_qh, s_qm, s_qd,
    s_kb, s_kh, s_kn, s_kd,
    s_vb, s_vh, s_vn, s_vd,
    slopes_ptr, s_ab, s_ah,
    table_ptr, s_tb, s_tn, s_kp, s_vp,
    LQ, H, G, D, DV, NUM_SPLITS, SPLIT_LEN,
    scale, softcap, window_left, right_limit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    PRECISION: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
):  # fmt: skip
    """Partial results: part_out (B, Hq, Lq, S, Dv) float32 and part_lse (B, Hq, Lq, S).

    PAGED: k_ptr/v_ptr are pools (Hk, num_blocks, PAGE_SIZE, D) with strides
    (s_kh, s_kp, s_kn, s_kd) (s_kb = 0), table_ptr the (B, max_blocks) block
    table with strides (s_tb, s_tn)."""
    split = tl.program_id(0)
    bhk = tl.program_id(1)
    tile_r = tl.program_id(2)
    HK = H // G
    b = bhk // HK
    hk = bhk % HK
    k_len = tl.load(seqlens_ptr + b).to(tl.int32)
    b64 = b.to(tl.int64)

    r = tile_r * BLOCK_M + tl.arange(0, BLOCK_M)  # (M,) rows: query i of group head g at g * Lq + i
    row_ok = r < G * LQ
    g = r // LQ
    i = r % LQ  # query positions among the Lq new ones
    h = hk * G + g  # (M,) query heads
    dims = tl.arange(0, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + b64 * s_qb + h.to(tl.int64)[:, None] * s_qh + i[:, None] * s_qm + dims[None, :] * s_qd,
        mask=row_ok[:, None] & (dims[None, :] < D),
        other=0.0,
    )  # (M, D)
    slope = tl.zeros([BLOCK_M, 1], tl.float32)
    if HAS_ALIBI:
        slope = tl.load(slopes_ptr + b * s_ab + h * s_ah, mask=row_ok, other=0.0).to(tl.float32)[:, None]

    # The keys of this split that any of these rows may see.
    i_lo = tl.min(tl.where(row_ok, i, LQ), 0)
    i_hi = tl.max(tl.where(row_ok, i, 0), 0) + 1
    band_lo, band_hi = key_range(i_lo, i_hi, LQ, k_len, window_left, right_limit, HAS_LEFT, HAS_RIGHT)
    k_lo = tl.maximum(split * SPLIT_LEN, band_lo)
    k_hi = tl.minimum((split + 1) * SPLIT_LEN, band_hi)
    k_lo = split * SPLIT_LEN + ((k_lo - split * SPLIT_LEN) // BLOCK_N) * BLOCK_N

    k_base = k_ptr + b64 * s_kb + hk.to(tl.int64) * s_kh
    v_base = v_ptr + b64 * s_vb + hk.to(tl.int64) * s_vh
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_N):
        cols = k0 + tl.arange(0, BLOCK_N)
        col_ok = cols < k_hi
        if PAGED:  # each key's block from the table (cols >= 0: // and % agree on GPU and interpreter)
            page = tl.load(table_ptr + b64 * s_tb + (cols // PAGE_SIZE) * s_tn, mask=col_ok, other=0)
            page = page.to(tl.int64)  # (N,)
            k_rows = page * s_kp + (cols % PAGE_SIZE) * s_kn
            v_rows = page * s_vp + (cols % PAGE_SIZE) * s_vn
        else:
            k_rows = cols.to(tl.int64) * s_kn
            v_rows = cols.to(tl.int64) * s_vn
        k = tl.load(
            k_base + k_rows[:, None] + dims[None, :] * s_kd,
            mask=col_ok[:, None] & (dims[None, :] < D),
            other=0.0,
        )  # (N, D)
        v = tl.load(
            v_base + v_rows[:, None] + dims_v[None, :] * s_vd,
            mask=col_ok[:, None] & (dims_v[None, :] < DV),
            other=0.0,
        )  # (N, Dv)
        qk = dot(q, tl.trans(k), PRECISION)  # (M, N)
        s, _ = score_tile(
            qk, i, cols, LQ, k_len, scale, softcap, q_ptr, q_ptr, q_ptr, slope, window_left, right_limit,
            HAS_SOFTCAP, False, False, False, HAS_ALIBI, HAS_LEFT, HAS_RIGHT, True,
        )  # fmt: skip
        s = tl.where(col_ok[None, :], s, float("-inf"))  # keys of the next split belong to it
        new_max = tl.maximum(row_max, tl.max(s, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        correction = tl.exp2(row_max - safe_max)
        p = tl.exp2(s - safe_max[:, None])  # (M, N)
        row_sum = row_sum * correction + tl.sum(p, 1)
        acc = acc * correction[:, None] + dot(narrow(p, v.dtype, PRECISION), v, PRECISION)
        row_max = new_max

    no_key = row_sum == 0.0
    out = acc / tl.where(no_key, 1.0, row_sum)[:, None]  # (M, Dv)
    lse = tl.where(no_key, float("-inf"), (row_max + tl.log2(tl.where(no_key, 1.0, row_sum))) / LOG2E)  # (M,)
    # part_out is contiguous (B, Hq, Lq, S, Dv): row (b, h, i) of split `split`.
    part_row = ((b64 * H + h.to(tl.int64)) * LQ + i) * NUM_SPLITS + split  # (M,)
    tl.store(
        part_out_ptr + part_row[:, None] * DV + dims_v[None, :],
        out,
        mask=row_ok[:, None] & (dims_v[None, :] < DV),
    )
    tl.store(part_lse_ptr + part_row, lse, mask=row_ok)


@triton.jit
def decode_combine(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr,
    s_ob, s_oh, s_om, s_od,
    H, LQ, DV, NUM_SPLITS,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """out = sum_s exp(lse_s - lse) out_s, lse = log sum_s exp(lse_s), for one query row."""
    row = tl.program_id(0).to(tl.int64)  # (b * H + h) * Lq + i
    i = row % LQ
    bh = row // LQ
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < NUM_SPLITS
    dims_v = tl.arange(0, BLOCK_DV)
    lse_s = tl.load(part_lse_ptr + row * NUM_SPLITS + splits, mask=split_ok, other=float("-inf"))  # (S,)
    top = tl.max(lse_s, 0)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(lse_s - safe_top)  # (S,), 0 for splits with no key
    total = tl.sum(weight, 0)
    part = tl.load(
        part_out_ptr + (row * NUM_SPLITS + splits)[:, None] * DV + dims_v[None, :],
        mask=split_ok[:, None] & (dims_v[None, :] < DV),
        other=0.0,
    )  # (S, Dv)
    out = tl.sum(part * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)  # (Dv,)
    lse = tl.where(total == 0.0, float("-inf"), safe_top + tl.log(tl.where(total == 0.0, 1.0, total)))
    b = bh // H
    h = bh % H
    tl.store(
        out_ptr + b * s_ob + h * s_oh + i * s_om + dims_v * s_od,
        narrow(out, out_ptr.dtype.element_ty, PRECISION),
        mask=dims_v < DV,
    )
    tl.store(lse_ptr + row, lse)


@triton.jit
def combine_in_order(
    part_out_ptr, part_lse_ptr, seqlens_ptr, out_ptr, lse_ptr,
    s_ob, s_oh, s_om, s_od,
    H, LQ, DV, NUM_SPLITS, SPLIT_LEN,
    BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """decode_combine for fixed-length splits, batch-invariant: row (b, h, i)
    reads only the cdiv(seqlens[b], SPLIT_LEN) splits that hold its keys, and
    sums them one after the other (a vector sum over all NUM_SPLITS would let
    the reduction tree depend on the longest sequence of the batch)."""
    row = tl.program_id(0).to(tl.int64)  # (b * H + h) * Lq + i
    i = row % LQ
    bh = row // LQ
    b = bh // H
    h = bh % H
    k_len = tl.load(seqlens_ptr + b).to(tl.int32)
    splits = (k_len + SPLIT_LEN - 1) // SPLIT_LEN
    dims_v = tl.arange(0, BLOCK_DV)
    top = tl.full([], float("-inf"), tl.float32)
    for split in range(0, splits):
        top = tl.maximum(top, tl.load(part_lse_ptr + row * NUM_SPLITS + split))
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for split in range(0, splits):
        weight = tl.exp(
            tl.load(part_lse_ptr + row * NUM_SPLITS + split) - safe_top
        )  # 0 for a split with no key
        part = tl.load(part_out_ptr + (row * NUM_SPLITS + split) * DV + dims_v, mask=dims_v < DV, other=0.0)
        total += weight
        acc += weight * part
    out = acc / tl.where(total == 0.0, 1.0, total)  # (Dv,)
    lse = tl.where(total == 0.0, float("-inf"), safe_top + tl.log(tl.where(total == 0.0, 1.0, total)))
    tl.store(
        out_ptr + b * s_ob + h * s_oh + i * s_om + dims_v * s_od,
        narrow(out, out_ptr.dtype.element_ty, PRECISION),
        mask=dims_v < DV,
    )
    tl.store(lse_ptr + row, lse)
