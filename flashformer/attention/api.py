"""`attention()`: the one place where attention scores are computed.

It checks every argument against the contract (../DESIGN.md), turns the masks
and biases into one `ScoreRules` description, picks a backend and runs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from flashformer.attention.flash import flash_attention
from flashformer.attention.masks import ScoreRules
from flashformer.attention.reference import eager_attention
from flashformer.attention.torch_sdpa import needs_materialized_mask, sdpa_attention

BACKENDS = ("auto", "eager", "flash", "triton", "torch")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    mask: Tensor | None = None,
    bias: Tensor | Callable[[Tensor, Tensor], Tensor] | None = None,
    alibi_slopes: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    return_probs: bool = False,
):
    """Exact scaled dot-product attention, softmax(scale * q @ k^T + bias) @ v.

    Shapes: q (B, Hq, Lq, D); k (B, Hk, Lk, D); v (B, Hk, Lk, Dv); Hq % Hk == 0
    (MHA, GQA, MQA). Returns out (B, Hq, Lq, Dv) in q's dtype; with
    return_lse also lse (B, Hq, Lq) (float32; float64 for float64 inputs);
    with return_probs (eager backend only) also the attention probabilities
    (B, Hq, Lq, Lk) before dropout.

    causal: key j is visible to query i iff j <= i + (Lk - Lq) (bottom-right).
    key_padding_mask: (B, Lk) bool, True = real token.
    mask: bool, broadcastable to (B, Hq, Lq, Lk), True = may attend.
    bias: float tensor broadcastable to (B, Hq, Lq, Lk), or a function
        bias(q_pos, k_pos) of 1-D position tensors returning one tile's bias,
        broadcastable to (B, Hq, len(q_pos), len(k_pos)); tensors it reads
        that require grad receive their gradient.
    alibi_slopes: (Hq,) or (B, Hq); adds -slope * |i + Lk - Lq - j|.
    window: (left, right) keys kept around the aligned diagonal; None for an
        unbounded side.
    softcap: scores become softcap * tanh(scores / softcap), before bias/mask.
    scale: defaults to 1 / sqrt(D).
    dropout_p, dropout_seed: dropout on the attention weights, a pure
        function of (seed, b, h, i, j); without a seed one is drawn from
        torch's default generator.
    A query row with no allowed key gets output 0, lse -inf, gradient 0.
    """
    rules = _check_and_describe(q, k, v, causal, key_padding_mask, mask, bias, alibi_slopes, window, softcap)
    scale = _check_scale(scale, q.shape[-1])
    _check_dropout(dropout_p, dropout_seed)
    if dropout_p > 0 and dropout_seed is None:
        dropout_seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")

    if backend == "auto":
        backend = choose_backend(q, k, v, rules, dropout_p, return_lse, return_probs)
    _refuse_unsupported(backend, rules, dropout_p, return_lse, return_probs)

    probs = None
    if backend == "eager":
        out, lse, probs = eager_attention(q, k, v, rules, scale, dropout_p, dropout_seed)
        out = out.to(q.dtype)
    elif backend == "flash":
        out, lse = flash_attention(q, k, v, rules, scale, dropout_p, dropout_seed)
    elif backend == "torch":
        out, lse = sdpa_attention(q, k, v, rules, scale), None
    else:  # triton; imported here so that flashformer never needs Triton unless asked for it
        from flashformer.attention.triton import triton_attention

        out, lse = triton_attention(q, k, v, rules, scale, dropout_p, dropout_seed)

    results = (out,) + ((lse,) if return_lse else ()) + ((probs,) if return_probs else ())
    return results[0] if len(results) == 1 else results


def choose_backend(
    q: Tensor, k: Tensor, v: Tensor, rules: ScoreRules, dropout_p: float, return_lse: bool, return_probs: bool
) -> str:
    """The fastest exact backend for this request on this device.

    Measured on the CPU (2-core AMD EPYC, AVX2, torch 2.13; B=2, H=8, D=64,
    forward + backward, backends timed in turns in one process):
    - what SDPA takes as is (no mask, causal with Lq == Lk, key padding, a
      given mask or bias tensor): torch is faster at every n (padding,
      n = 2048: torch 1.27 s, flash 2.23 s; causal, n = 8192: about equal).
    - what SDPA needs an (Lq, Lk) mask or bias built for (ALiBi, bias
      functions, windows, causal with padding or with Lq != Lk): torch wins
      while Lq * Lk <= 512^2 (n = 512, window 256: 81 vs 92 ms), flash beyond,
      as it skips tiles and builds nothing (n = 1024: 315 vs 211 ms; n = 2048:
      1.44 s vs 0.44 s).
    - bf16/fp16 with gradients on the CPU: SDPA's low-precision backward is
      slow (causal, n = 1024: torch 404 ms, flash 153 ms; n = 4096: 6.3 s vs
      2.4 s), so flash.

    On CUDA, every request the Triton kernels support goes to them: they are
    the IO-aware kernels written for GPUs, and they support every feature
    (softcap, seeded dropout, the LSE) that SDPA lacks. This is a choice by
    design, pending GPU measurements (none were at hand when it was made;
    scripts/gpu_check.sh measures them against SDPA's backends).
    """
    if return_probs:
        return "eager"
    if q.device.type == "cuda":
        from flashformer.attention.triton import unsupported

        if unsupported(q, k, v, rules) is None:
            return "triton"
    if dropout_p > 0 or return_lse or rules.softcap is not None:
        return "flash"
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if q.device.type == "cpu" and needs_grad and q.dtype in (torch.float16, torch.bfloat16):
        return "flash"
    if needs_materialized_mask(rules) and rules.q_len * rules.k_len > 512 * 512:
        return "flash"
    return "torch"


def _refuse_unsupported(backend, rules: ScoreRules, dropout_p, return_lse, return_probs) -> None:
    if return_probs and backend != "eager":
        raise NotImplementedError(f"return_probs is only available with backend='eager', not {backend!r}")
    if backend == "torch":
        if rules.softcap is not None:
            raise NotImplementedError("backend='torch' does not support softcap")
        if dropout_p > 0:
            raise NotImplementedError(
                "backend='torch' does not support seeded dropout (its dropout draws other entries)"
            )
        if return_lse:
            raise NotImplementedError("backend='torch' does not support return_lse")


# ---- argument checks ----


def _check_and_describe(q, k, v, causal, key_padding_mask, mask, bias, alibi_slopes, window, softcap):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (B, H, L, D); got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64; got {t.dtype}")
        if 0 in t.shape:
            raise ValueError(f"{name} must not have an empty dimension; got shape {tuple(t.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share a dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}")
    batch, q_heads, q_len, dim = q.shape
    _, kv_heads, k_len, _ = k.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(
            f"q, k and v must share the batch size; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[3] != dim:
        raise ValueError(f"q and k must share the head dim D; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if v.shape[1:3] != k.shape[1:3]:
        raise ValueError(
            f"v must have the heads and length of k (B, Hk, Lk, Dv); got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q_heads % kv_heads != 0:
        raise ValueError(
            f"the query heads Hq must be a multiple of the key/value heads Hk; got q {tuple(q.shape)} "
            f"(Hq={q_heads}), k {tuple(k.shape)} (Hk={kv_heads})"
        )

    full = (batch, q_heads, q_len, k_len)
    if key_padding_mask is not None:
        _check_bool(key_padding_mask, "key_padding_mask", q.device)
        if tuple(key_padding_mask.shape) != (batch, k_len):
            raise ValueError(
                f"key_padding_mask must have shape (B, Lk) = {(batch, k_len)}; got {tuple(key_padding_mask.shape)}"
            )
        key_padding_mask = key_padding_mask[:, None, None, :]  # (B, 1, 1, Lk)
    if mask is not None:
        _check_bool(mask, "mask", q.device)
        mask = _as_broadcast_4d(mask, "mask", full)
    bias_fn = None
    if callable(bias) and not isinstance(bias, Tensor):
        bias_fn, bias = bias, None
    elif bias is not None:
        if not isinstance(bias, Tensor) or not bias.is_floating_point():
            raise TypeError(
                f"bias must be a float tensor or a function of (q_pos, k_pos); got {_describe(bias)}"
            )
        if bias.device != q.device:
            raise ValueError(f"bias must be on {q.device}; got {bias.device}")
        bias = _as_broadcast_4d(bias, "bias", full)
    if alibi_slopes is not None:
        alibi_slopes = _check_alibi(alibi_slopes, batch, q_heads, q.device)
    window_left, window_right = _check_window(window)
    if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
        raise ValueError(f"softcap must be a positive number or None; got {softcap!r}")
    return ScoreRules(
        batch=batch,
        q_heads=q_heads,
        q_len=q_len,
        k_len=k_len,
        causal=bool(causal),
        window_left=window_left,
        window_right=window_right,
        key_padding_mask=key_padding_mask,
        mask=mask,
        bias=bias,
        bias_fn=bias_fn,
        alibi_slopes=alibi_slopes,
        softcap=None if softcap is None else float(softcap),
    )


def _describe(x) -> str:
    if isinstance(x, Tensor):
        return f"tensor of dtype {x.dtype} and shape {tuple(x.shape)}"
    return type(x).__name__


def _check_bool(t, name: str, device) -> None:
    if not isinstance(t, Tensor) or t.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (True = may attend); got {_describe(t)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}; got {t.device}")


def _as_broadcast_4d(t: Tensor, name: str, full: tuple[int, int, int, int]) -> Tensor:
    """A view of t with 4 dims, each 1 or full size; never expanded."""
    if t.dim() > 4:
        raise ValueError(
            f"{name} must have at most 4 dims, broadcastable to (B, Hq, Lq, Lk) = {full}; "
            f"got shape {tuple(t.shape)}"
        )
    t4 = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    for size, want in zip(t4.shape, full):
        if size not in (1, want):
            raise ValueError(
                f"{name} of shape {tuple(t.shape)} is not broadcastable to (B, Hq, Lq, Lk) = {full}"
            )
    return t4


def _check_alibi(slopes, batch: int, heads: int, device) -> Tensor:
    if not isinstance(slopes, Tensor) or not slopes.is_floating_point():
        raise TypeError(
            f"alibi_slopes must be a float tensor of shape (Hq,) or (B, Hq); got {_describe(slopes)}"
        )
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(
            f"alibi_slopes must have shape (Hq,) = {(heads,)} or (B, Hq) = {(batch, heads)}; "
            f"got {tuple(slopes.shape)}"
        )
    if slopes.device != device:
        raise ValueError(f"alibi_slopes must be on {device}; got {slopes.device}")
    slopes = slopes.detach()
    slopes = slopes if slopes.dtype == torch.float64 else slopes.float()
    return slopes.reshape(-1, heads, 1, 1)  # (B|1, Hq, 1, 1)


def _check_window(window) -> tuple[int | None, int | None]:
    if window is None:
        return None, None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window must be a (left, right) pair or None; got {window!r}")
    sides = []
    for side_name, side in zip(("left", "right"), window):
        if side is None:
            sides.append(None)
            continue
        if isinstance(side, bool) or not isinstance(side, int):
            raise TypeError(f"window {side_name} size must be an int >= 0 or None; got {side!r}")
        if side < 0:
            raise ValueError(f"window sizes must be >= 0 (None = unbounded); got window={tuple(window)!r}")
        sides.append(side)
    return sides[0], sides[1]


def _check_scale(scale, dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None; got {scale!r}")
    return float(scale)


def _check_dropout(dropout_p, dropout_seed) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float in [0, 1); got {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p!r}")
    if dropout_seed is not None and (isinstance(dropout_seed, bool) or not isinstance(dropout_seed, int)):
        raise TypeError(f"dropout_seed must be an int or None; got {dropout_seed!r}")
    if dropout_seed is not None and not 0 <= dropout_seed < 2**64:
        raise ValueError(f"dropout_seed must be in [0, 2**64); got {dropout_seed}")
