"""The argument checks of attention's entry points, and the dropout seed they draw.

`attention()` (api.py) and the Triton entry points (`varlen_attention`,
`decode_attention`) take the same kinds of arguments; each is checked here,
once, with errors that name the argument, what it received and what was
expected.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flashformer.attention.masks import ScoreRules

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_float16_cache(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether keys and values of kv_dtype are a half-size cache for float32 queries (a quantized
    model's, as llama.cpp keeps one), which attention widens to float32, exactly, as it reads it."""
    return q_dtype == torch.float32 and kv_dtype == torch.float16


def check_kv_dtypes(q_dtype, k_dtype, v_dtype, k_name: str, v_name: str) -> None:
    """k and v share q's dtype, or are both a float16 cache for a float32 q (is_float16_cache)."""
    if k_dtype == v_dtype and (k_dtype == q_dtype or is_float16_cache(q_dtype, k_dtype)):
        return
    raise TypeError(
        f"q, {k_name} and {v_name} must share a dtype (or be float32 q with float16 {k_name} and {v_name}); "
        f"got q {q_dtype}, {k_name} {k_dtype}, {v_name} {v_dtype}"
    )


def check_and_describe(
    q, k, v, causal, key_padding_mask, mask, bias, alibi_slopes, window, softcap, global_tokens=0, sinks=None
):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims (B, H, L, D); got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64; got {t.dtype}")
        if 0 in t.shape:
            raise ValueError(f"{name} must not have an empty dimension; got shape {tuple(t.shape)}")
    check_kv_dtypes(q.dtype, k.dtype, v.dtype, "k", "v")
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
        alibi_slopes = check_alibi(alibi_slopes, batch, q_heads, q.device)
    window_left, window_right = check_window(window)
    softcap = check_softcap(softcap)
    if isinstance(global_tokens, bool) or not isinstance(global_tokens, int) or global_tokens < 0:
        raise ValueError(f"global_tokens must be an int >= 0; got {global_tokens!r}")
    if sinks is not None:
        sinks = check_sinks(sinks, q_heads, q.device)
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
        softcap=softcap,
        global_tokens=global_tokens,
        sinks=sinks,
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


def check_alibi(slopes, batch: int, heads: int, device) -> Tensor:
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


def check_sinks(sinks, heads: int, device) -> Tensor:
    """A float tensor (Hq,), one logit per query head, kept as it is (it may be a trainable
    parameter, whose gradient the backends give) and viewed as (1, Hq, 1, 1)."""
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point():
        raise TypeError(f"sinks must be a float tensor of shape (Hq,) = {(heads,)}; got {_describe(sinks)}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape (Hq,) = {(heads,)}; got {tuple(sinks.shape)}")
    if sinks.device != device:
        raise ValueError(f"sinks must be on {device}; got {sinks.device}")
    return sinks.view(1, heads, 1, 1)


def check_window(window) -> tuple[int | None, int | None]:
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


def check_scale(scale, dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None; got {scale!r}")
    return float(scale)


def check_dropout(dropout_p, dropout_seed) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"dropout_p must be a float in [0, 1); got {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p!r}")
    if dropout_seed is not None and (isinstance(dropout_seed, bool) or not isinstance(dropout_seed, int)):
        raise TypeError(f"dropout_seed must be an int or None; got {dropout_seed!r}")
    if dropout_seed is not None and not 0 <= dropout_seed < 2**64:
        raise ValueError(f"dropout_seed must be in [0, 2**64); got {dropout_seed}")


def check_softcap(softcap) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None; got {softcap!r}")
    return float(softcap)


def dropout_seed_for(dropout_p: float, dropout_seed: int | None) -> int | None:
    """The seed dropout will use: the given one, or one drawn from torch's
    default generator (so torch.manual_seed makes an unseeded call repeatable)."""
    if dropout_p > 0 and dropout_seed is None:
        return int(torch.randint(0, 2**62, (), dtype=torch.int64))
    return dropout_seed
