"""Float weights to llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K), for writing GGUF files.

    blocks = quantize_k(weight, "Q4_K")      # (rows, cols) float -> (rows, cols/256*144) uint8

The `gguf` library quantizes only the legacy types (Q4_0/1, Q5_0/1, Q8_0); these are ours. They
follow llama.cpp's reference quantizers without an importance matrix (quantize_row_q4_K_ref,
q5_K_ref, q6_K_ref in ggml-quants.c), the ones `llama-quantize` runs on an f16 file:

- Q4_K / Q5_K: a super-block of 256 weights is 8 sub-blocks of 32, each x ~ scale * q - min with
  q in [0, 15] (Q5_K: [0, 31]). Each sub-block's (scale, min) is the best of a small search over
  the grid's step (make_qkx2_quants: 21 or 16 candidate steps, each refit by weighted least
  squares with weights sqrt(mean x^2) + |x|); the 8 scales and 8 mins are then quantized to
  6 bits against one float16 scale and one float16 min per super-block, and q recomputed.
- Q6_K: 16 sub-blocks of 16, x ~ scale * q with q in [-32, 31]; each sub-block's scale is the
  best of 19 candidates by the x^2-weighted fit (make_qx_quants), then quantized to int8
  against one float16 scale per super-block.

Every sub-block of a tensor is searched at once (torch, float32 as llama.cpp computes), in
chunks of rows so that a 128k x 2048 embedding needs a few hundred MB of temporaries at most.
Ties round to even, as llama.cpp's nearest_int does.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

from flashformer.kernels.block_types import TYPES

QK_K = TYPES["Q4_K"].block_values  # values per super-block: 256
BLOCK_BYTES = {name: TYPES[name].block_bytes for name in ("Q4_K", "Q5_K", "Q6_K")}
GROUP_MAX_EPS = 1e-15  # llama.cpp: a sub-block below this is all zeros
CHUNK_ELEMENTS = 1 << 16  # weights quantized per step: temporaries that stay in the caches


def quantize_k(weight: Tensor, ggml_type: str) -> np.ndarray:
    """(rows, cols) float weights as rows of `ggml_type` blocks: (rows, cols / 256 * bytes) uint8.

    Raises ValueError for a type that is not a K-quant or a row not a multiple of 256 long
    (llama.cpp falls back to another type for those; see writer.py)."""
    if ggml_type not in BLOCK_BYTES:
        raise ValueError(f"ggml_type must be one of {sorted(BLOCK_BYTES)}; got {ggml_type!r}")
    if weight.dim() != 2 or weight.shape[1] % QK_K:
        raise ValueError(
            f"{ggml_type} needs rows of a multiple of {QK_K} weights; got a tensor of shape {tuple(weight.shape)}"
        )
    rows, cols = weight.shape
    quantize_blocks = {"Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}[ggml_type]
    out = np.empty((rows, cols // QK_K * BLOCK_BYTES[ggml_type]), dtype=np.uint8)
    step = max(1, CHUNK_ELEMENTS // cols)

    def run(start: int) -> None:
        chunk = weight[start : start + step].detach().to(torch.float32).reshape(-1, QK_K)  # (blocks, 256)
        out[start : start + step] = quantize_blocks(chunk).numpy().reshape(-1, out.shape[1])

    # Chunks in parallel, each op single-threaded: the ops are small (64k weights), and torch's
    # own threads cost more in fork/join (and in spinning, on a busy machine) than they save.
    workers = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(run, range(0, rows, step)))
    finally:
        torch.set_num_threads(workers)
    return out


# ---- the searches (make_qkx2_quants, make_qx_quants), over many sub-blocks at once ----


def _asymmetric_fit(x: Tensor, weights: Tensor, nmax: int, rmin: float, rdelta: float, steps: int):
    """x (N, n) ~ scale * q - min, q in [0, nmax]: llama.cpp's make_qkx2_quants (squared error).

    Returns scale (N,), min (N,) (>= 0, subtracted) and q (N, n) uint8. The first candidate is
    the plain min/max grid; then for each of steps + 1 grid steps the q it gives are refit by
    weighted least squares, and the candidate of least weighted squared error is kept (each
    grid starting, as in llama.cpp, from the best offset found so far). The
    error is expanded in the sums the fit needs (sum w (s q + o - x)^2 = s^2 Swqq + 2 s o Swq
    - 2 s Swxq + o^2 Sw - 2 o Swx + Swxx), so a candidate costs one pass to make q and three
    row sums, not a second pass over the weights."""
    low = x.amin(dim=1).clamp(max=0.0)  # (N,)
    high = x.amax(dim=1)
    flat = high == low  # all x equal (and <= 0): q = 0, the min carries the value
    wx = weights * x
    sum_w, sum_x, sum_xx = _row_sums(weights), _row_sums(wx), _row_sums(wx * x)

    def codes(numerator: float | Tensor, offset: Tensor) -> Tensor:
        span = high - offset
        inverse = numerator / torch.where(span > 0, span, 1.0)
        return (inverse[:, None] * (x - offset[:, None])).round_().clamp_(0, nmax)

    def error(scale, offset, sum_l, sum_l2, sum_xl):
        return (
            scale * scale * sum_l2 + 2 * scale * offset * sum_l - 2 * scale * sum_xl
            + offset * offset * sum_w - 2 * offset * sum_x + sum_xx
        )  # fmt: skip

    offset = low.clone()  # x ~ scale * q + offset, offset <= 0
    q = codes(float(nmax), offset)
    wq = weights * q
    span = high - low
    scale = torch.where(flat, 0.0, 1.0 / (nmax / torch.where(flat, 1.0, span)))
    best = error(scale, offset, _row_sums(wq), _row_sums(wq * q), _row_sums(wq * x))
    for step in range(steps + 1):
        # as llama.cpp: each candidate's grid starts at the best offset found so far
        trial = codes(_f32_sum(rmin, np.float32(rdelta) * np.float32(step), nmax), offset)
        wq = weights * trial
        sum_l, sum_l2, sum_xl = _row_sums(wq), _row_sums(wq * trial), _row_sums(trial * wx)
        det = sum_w * sum_l2 - sum_l * sum_l
        safe = torch.where(det > 0, det, torch.ones_like(det))
        trial_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        trial_offset = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = trial_offset > 0  # a positive offset is not representable: refit through zero
        trial_scale = torch.where(positive, sum_xl / torch.where(sum_l2 > 0, sum_l2, 1.0), trial_scale)
        trial_offset = torch.where(positive, torch.zeros_like(trial_offset), trial_offset)
        trial_error = error(trial_scale, trial_offset, sum_l, sum_l2, sum_xl)
        better = (det > 0) & (trial_error < best) & ~flat
        best = torch.where(better, trial_error, best)
        scale = torch.where(better, trial_scale, scale)
        offset = torch.where(better, trial_offset, offset)
        q = torch.where(better[:, None], trial, q)
    q = torch.where(flat[:, None], 0.0, q)
    return scale, -offset, q.to(torch.uint8)


def _symmetric_fit(x: Tensor, nmax: int):
    """x (N, n) ~ scale * (q - nmax), q - nmax in [-nmax, nmax - 1], weights x^2: llama.cpp's
    make_qx_quants(rmse_type=1). Returns scale (N,) (signed: the largest |x| maps to -nmax)
    and q (N, n) uint8 (offset by nmax)."""
    index = x.abs().argmax(dim=1, keepdim=True)
    peak = x.gather(1, index).squeeze(1)  # (N,) the value of largest magnitude, with its sign
    zero = peak.abs() < GROUP_MAX_EPS
    peak = torch.where(zero, torch.ones_like(peak), peak)
    weights = x * x
    wx = weights * x

    def levels(inverse: Tensor) -> Tensor:
        return (inverse[:, None] * x).round_().clamp_(-nmax, nmax - 1)

    def fit(inverse: Tensor):
        trial = levels(inverse)
        return _row_sums(trial * wx), _row_sums(trial * trial * weights)

    inverse = -nmax / peak
    sum_lx, sum_l2 = fit(inverse)
    scale = torch.where(sum_l2 > 0, sum_lx / torch.where(sum_l2 > 0, sum_l2, 1.0), torch.zeros_like(sum_lx))
    best = scale * sum_lx
    best_inverse = inverse
    for step in range(-9, 10):
        if step == 0:
            continue
        trial_inverse = -_f32_sum(nmax, np.float32(0.1) * np.float32(step)) / peak
        trial_lx, trial_l2 = fit(trial_inverse)
        better = (trial_l2 > 0) & (trial_lx * trial_lx > best * trial_l2)
        trial_scale = trial_lx / torch.where(trial_l2 > 0, trial_l2, 1.0)
        scale = torch.where(better, trial_scale, scale)
        best = torch.where(better, trial_scale * trial_lx, best)
        best_inverse = torch.where(better, trial_inverse, best_inverse)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    q = torch.where(zero[:, None], -nmax, levels(best_inverse))
    return scale, (q + nmax).to(torch.uint8)


def _row_sums(values: Tensor) -> Tensor:
    """(N, n) -> (N,): a matrix-vector product, several times faster in torch than .sum(dim=1)
    over rows this short."""
    return values @ values.new_ones(values.shape[1])


def _f32_sum(*terms) -> float:
    """The candidate's numerator summed in float32, left to right, as llama.cpp computes it."""
    total = np.float32(0)
    for term in terms:
        total = np.float32(total + np.float32(term))
    return float(total)


def _half(values: Tensor) -> Tensor:
    """float32 through float16 and back: the super-block scale as the file stores it."""
    return values.to(torch.float16).to(torch.float32)


def _nearest(values: Tensor) -> Tensor:
    return torch.round(values)  # half to even, as nearest_int


# ---- Q4_K and Q5_K: d, dmin (float16), 12 bytes of 6-bit scales and mins, the codes ----


def _scales_and_mins(x: Tensor, nmax: int, rmin: float, rdelta: float, steps: int):
    """The shared part of Q4_K and Q5_K: sub-block fits, their 6-bit scales and mins, the codes."""
    blocks = x.shape[0]
    sub = x.reshape(blocks * 8, 32)  # (N*8, 32)
    mean_square = sub.square().mean(dim=1, keepdim=True)
    weights = mean_square.sqrt() + sub.abs()
    scales, mins, first_codes = _asymmetric_fit(sub, weights, nmax, rmin, rdelta, steps)
    scales, mins = scales.reshape(blocks, 8), mins.reshape(blocks, 8)
    max_scale, max_min = scales.amax(dim=1), mins.amax(dim=1)  # (N,)
    inv_scale = torch.where(max_scale > 0, 63.0 / torch.where(max_scale > 0, max_scale, 1.0), 0.0)
    inv_min = torch.where(max_min > 0, 63.0 / torch.where(max_min > 0, max_min, 1.0), 0.0)
    ls = _nearest(inv_scale[:, None] * scales).clamp_(max=63).to(torch.uint8)  # (N, 8)
    lm = _nearest(inv_min[:, None] * mins).clamp_(max=63).to(torch.uint8)
    d, dmin = _half(max_scale / 63.0), _half(max_min / 63.0)

    step = d[:, None] * ls.to(torch.float32)  # (N, 8)
    shift = dmin[:, None] * lm.to(torch.float32)
    safe = torch.where(step != 0, step, 1.0)
    codes = _nearest((x.reshape(blocks, 8, 32) + shift[..., None]) / safe[..., None]).clamp_(0, nmax)
    codes = torch.where((step != 0)[..., None], codes.to(torch.uint8), first_codes.reshape(blocks, 8, 32))

    packed = torch.empty(blocks, 12, dtype=torch.uint8)
    packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    head = torch.cat([_f16_bytes(d), _f16_bytes(dmin), packed], dim=1)  # (N, 16)
    return head, codes.reshape(
        blocks, 4, 2, 32
    )  # codes[b, pair, half, l] = code of weight 64*pair + 32*half + l


def _q4_k(x: Tensor) -> Tensor:
    """(N, 256) float32 -> (N, 144) uint8: block_q4_K {d, dmin, scales[12], qs[128]}."""
    head, codes = _scales_and_mins(x, 15, -1.0, 0.1, 20)
    qs = codes[:, :, 0] | (codes[:, :, 1] << 4)  # (N, 4, 32): low nibble the first 32 of each 64
    return torch.cat([head, qs.reshape(-1, 128)], dim=1)


def _q5_k(x: Tensor) -> Tensor:
    """(N, 256) float32 -> (N, 176) uint8: block_q5_K {d, dmin, scales[12], qh[32], qs[128]}."""
    head, codes = _scales_and_mins(x, 31, -0.5, 0.1, 15)
    qs = (codes[:, :, 0] & 0xF) | ((codes[:, :, 1] & 0xF) << 4)  # (N, 4, 32)
    high = (codes >> 4).to(torch.int32)  # (N, 4, 2, 32): the fifth bit
    bit = (torch.arange(4).reshape(1, 4, 1, 1) * 2 + torch.arange(2).reshape(1, 1, 2, 1)).to(torch.int32)
    qh = (high << bit).sum(dim=(1, 2)).to(torch.uint8)  # (N, 32): bit 2*pair + half
    return torch.cat([head, qh, qs.reshape(-1, 128)], dim=1)


# ---- Q6_K: ql[128], qh[64], scales[16] (int8), d (float16) ----


def _q6_k(x: Tensor) -> Tensor:
    """(N, 256) float32 -> (N, 210) uint8: block_q6_K {ql[128], qh[64], scales[16], d}."""
    blocks = x.shape[0]
    scales, first_codes = _symmetric_fit(x.reshape(blocks * 16, 16), 32)
    scales = scales.reshape(blocks, 16)
    index = scales.abs().argmax(dim=1, keepdim=True)
    max_scale = scales.gather(1, index).squeeze(1)  # (N,) signed
    empty = max_scale.abs() < GROUP_MAX_EPS
    inverse = -128.0 / torch.where(empty, torch.ones_like(max_scale), max_scale)
    d = _half(1.0 / inverse)
    sc = _nearest(inverse[:, None] * scales).clamp_(max=127)  # (N, 16), may reach -128
    step = d[:, None] * sc
    safe = torch.where(step != 0, step, 1.0)
    codes = _nearest(x.reshape(blocks, 16, 16) / safe[..., None]).clamp_(-32, 31) + 32
    codes = torch.where((step != 0)[..., None], codes.to(torch.uint8), first_codes.reshape(blocks, 16, 16))
    codes = torch.where(empty[:, None, None], torch.zeros_like(codes), codes)
    sc = torch.where(empty[:, None], torch.zeros_like(sc), sc)
    d = torch.where(empty, torch.zeros_like(d), d)

    q = codes.reshape(blocks, 2, 4, 32)  # [half of 128, quarter, l]: weight 128*half + 32*quarter + l
    low, high = q & 0xF, (q >> 4).to(torch.int32)
    ql = torch.cat(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], dim=2
    )  # (N, 2, 64)
    shifts = (torch.arange(4, dtype=torch.int32) * 2).reshape(1, 1, 4, 1)
    qh = (high << shifts).sum(dim=2).to(torch.uint8)  # (N, 2, 32)
    scale_bytes = sc.to(torch.int8).view(torch.uint8)  # (N, 16)
    return torch.cat([ql.reshape(blocks, 128), qh.reshape(blocks, 64), scale_bytes, _f16_bytes(d)], dim=1)


def _f16_bytes(values: Tensor) -> Tensor:
    """(N,) float32 -> (N, 2) uint8, the little-endian float16 (values already on its grid)."""
    return values.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)
