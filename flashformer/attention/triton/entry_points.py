"""The Triton backend's host-side entry points: what the kernels refuse (unsupported), the
backends of attention() and paged_attention() (triton_attention, triton_paged_attention), and
varlen_attention and decode_attention with their argument checks. Each checks, then imports
launch.py (and with it Triton) only when a kernel is actually asked for: see the package
docstring.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

from flashformer.attention.checks import (
    check_alibi,
    check_dropout,
    check_scale,
    check_softcap,
    check_window,
    dropout_seed_for,
)
from flashformer.attention.masks import ScoreRules

MAX_HEAD_DIM = 256


def is_available() -> bool:
    """True if Triton can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unsupported(q: Tensor, k: Tensor, v: Tensor, rules: ScoreRules | None = None) -> str | None:
    """Why backend='triton' cannot run this request, or None if it can."""
    if not is_available():
        return "backend='triton' needs the triton package (pip install flashformer[triton])"
    if q.device.type != "cuda" and not _interpreting():
        return (
            f"backend='triton' runs on CUDA tensors (got {q.device}); on the CPU only through "
            "Triton's interpreter (TRITON_INTERPRET=1 set before triton is imported)"
        )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"backend='triton' supports float16, bfloat16 and float32 inputs; got {q.dtype}"
    if q.shape[-1] > MAX_HEAD_DIM or v.shape[-1] > MAX_HEAD_DIM:
        return f"backend='triton' supports head dims up to {MAX_HEAD_DIM}; got q {tuple(q.shape)}, v {tuple(v.shape)}"
    if rules is not None and rules.global_tokens:
        return "backend='triton' does not support global tokens; use backend='flash'"
    if rules is not None and rules.sinks is not None:
        return "backend='triton' does not support attention sinks (sinks); use backend='flash'"
    if rules is not None and rules.bias_fn is not None:
        return (
            "backend='triton' does not support a bias function of positions (the kernel cannot call "
            "Python per tile); pass the bias as a tensor, or use backend='flash'"
        )
    return None


def _refuse(q: Tensor, k: Tensor, v: Tensor, rules: ScoreRules | None = None) -> None:
    reason = unsupported(q, k, v, rules)
    if reason is not None:
        raise NotImplementedError(reason)


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rules: ScoreRules,
    scale: float,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The backend of attention(): (out (B, Hq, Lq, Dv) in q's dtype, lse (B, Hq, Lq) float32).

    Arguments are already checked by attention(); differentiable in q, k, v
    and a bias tensor. Deterministic: no two programs add into the same memory.
    """
    _refuse(q, k, v, rules)
    from flashformer.attention.triton.launch import Plan, TritonAttention

    plan = Plan(
        batch=q.shape[0],
        q_heads=q.shape[1],
        kv_heads=k.shape[1],
        max_q_len=q.shape[2],
        max_k_len=k.shape[2],
        scale=scale,
        softcap=rules.softcap,
        window_left=rules.window_left,
        right_limit=rules.right_limit,
        key_padding_mask=rules.key_padding_mask,
        mask=rules.mask,
        alibi_slopes=None if rules.alibi_slopes is None else rules.alibi_slopes.float(),
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
    )
    return TritonAttention.apply(q, k, v, rules.bias, plan)


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    alibi_slopes: Tensor | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    return_lse: bool = False,
):
    """Attention over a packed batch of sequences of different lengths.

    q: (total_q, Hq, D), k: (total_k, Hk, D), v: (total_k, Hk, Dv): the
    sequences laid end to end, sequence b at rows cu_seqlens_q[b] :
    cu_seqlens_q[b + 1] (int32, (B + 1,), starting at 0). No padding is
    stored or computed. Each sequence is attended on its own with the rules of
    attention(): causal aligned bottom-right per sequence (query i of a
    sequence of Lq_b queries and Lk_b keys sees key j iff
    j <= i + Lk_b - Lq_b), window, ALiBi slopes (Hq,) or (B, Hq), softcap,
    dropout with the same entries as attention() would drop for sequence b as
    batch row b. Returns out (total_q, Hq, Dv), and with return_lse also lse
    (Hq, total_q) float32. Differentiable in q, k and v.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor (total, H, D); got {_shape(t)}")
    total_q, q_heads, dim = q.shape
    total_k, kv_heads, _ = k.shape
    if k.shape[2] != dim or v.shape[:2] != k.shape[:2] or q_heads % kv_heads:
        raise ValueError(
            f"q (total_q, Hq, D), k (total_k, Hk, D), v (total_k, Hk, Dv) with Hq % Hk == 0; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share a dtype; got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    batch = _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", total_q, max_seqlen_q, "max_seqlen_q", q.device)
    if (
        _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", total_k, max_seqlen_k, "max_seqlen_k", q.device)
        != batch
    ):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe as many sequences; got shapes "
            f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}"
        )
    window_left, window_right = check_window(window)
    rules = ScoreRules(batch, q_heads, max_seqlen_q, max_seqlen_k, bool(causal), window_left, window_right)
    scale = check_scale(scale, dim)
    check_dropout(dropout_p, dropout_seed)
    dropout_seed = dropout_seed_for(dropout_p, dropout_seed)
    softcap = check_softcap(softcap)
    slopes = None if alibi_slopes is None else check_alibi(alibi_slopes, batch, q_heads, q.device).float()
    _refuse(q, k, v)
    from flashformer.attention.triton.launch import Plan, TritonAttention

    plan = Plan(
        batch=batch,
        q_heads=q_heads,
        kv_heads=kv_heads,
        max_q_len=max_seqlen_q,
        max_k_len=max_seqlen_k,
        scale=scale,
        softcap=softcap,
        window_left=rules.window_left,
        right_limit=rules.right_limit,
        alibi_slopes=slopes,
        dropout_p=float(dropout_p),
        dropout_seed=dropout_seed,
        cu_q=cu_seqlens_q,
        cu_k=cu_seqlens_k,
    )
    out, lse = TritonAttention.apply(q, k, v, None, plan)
    return (out, lse) if return_lse else out


def decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    *,
    causal: bool = True,
    window: tuple[int | None, int | None] | None = None,
    alibi_slopes: Tensor | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    return_lse: bool = False,
):
    """Attention of a few new queries against a KV cache, split over the keys.

    q: (B, Hq, Lq, D), the Lq newest positions of each sequence (Lq = 1 for
    one decode step); k_cache: (B, Hk, L_max, D) and v_cache (B, Hk, L_max,
    Dv), any strides, of which the first cache_seqlens[b] positions are valid
    (those include the Lq new tokens, already written). cache_seqlens: (B,)
    int32 or int64 on q's device, each in [0, L_max]. Query i of sequence b
    sits at key position cache_seqlens[b] - Lq + i (bottom-right, as in
    attention()); causal is on by default, as decoding needs. num_splits: key
    ranges processed in parallel (default: enough to fill the GPU). Inference
    only (no gradient). Returns out (B, Hq, Lq, Dv) in q's dtype, and with
    return_lse also lse (B, Hq, Lq) float32.
    """
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, H, L, D); got {_shape(t)}")
    batch, q_heads, _, dim = q.shape
    _, kv_heads, max_k_len, _ = k_cache.shape
    if (
        k_cache.shape[0] != batch
        or k_cache.shape[3] != dim
        or v_cache.shape[:3] != k_cache.shape[:3]
        or q_heads % kv_heads
    ):
        raise ValueError(
            f"q (B, Hq, Lq, D), k_cache (B, Hk, L_max, D), v_cache (B, Hk, L_max, Dv) with Hq % Hk == 0; "
            f"got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(
            f"q and the caches must share a dtype; got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if (
        not isinstance(cache_seqlens, Tensor)
        or cache_seqlens.shape != (batch,)
        or cache_seqlens.dtype not in (torch.int32, torch.int64)
        or cache_seqlens.device != q.device
    ):
        raise ValueError(
            f"cache_seqlens must be an int32/int64 tensor of shape (B,) = ({batch},) on {q.device}; "
            f"got {_shape(cache_seqlens)}"
        )
    if cache_seqlens.numel() and (int(cache_seqlens.min()) < 0 or int(cache_seqlens.max()) > max_k_len):
        raise ValueError(
            f"cache_seqlens must lie in [0, L_max = {max_k_len}]; got {cache_seqlens.tolist()[:16]}"
        )
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None; got {num_splits!r}")
    softcap = check_softcap(softcap)
    window_left, window_right = check_window(window)
    rules = ScoreRules(batch, q_heads, q.shape[2], max_k_len, bool(causal), window_left, window_right)
    slopes = None if alibi_slopes is None else check_alibi(alibi_slopes, batch, q_heads, q.device).float()
    _refuse(q, k_cache, v_cache)
    from flashformer.attention.triton.launch import Plan, decode

    plan = Plan(
        batch=batch,
        q_heads=q_heads,
        kv_heads=kv_heads,
        max_q_len=q.shape[2],
        max_k_len=max_k_len,
        scale=check_scale(scale, dim),
        softcap=softcap,
        window_left=rules.window_left,
        right_limit=rules.right_limit,
        alibi_slopes=slopes,
    )
    with torch.no_grad():
        out, lse = decode(q, k_cache, v_cache, cache_seqlens, plan, num_splits)
    return (out, lse) if return_lse else out


def triton_paged_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    rules: ScoreRules,
    scale: float,
    split_len: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The backend of paged_attention(): (out (B, Hq, Lq, Dv) in q's dtype, lse (B, Hq, Lq) float32).

    Arguments are already checked by paged_attention(); rules gives causal,
    window, ALiBi and softcap (its k_len is unused: each sequence has its own).
    The split kernel of decode_attention reads the keys through the block
    table, in splits of a fixed split_len keys (launch.PAGED_SPLIT_LEN by
    default). Inference only (no gradient).
    """
    _refuse(q, k_pool, v_pool, rules)
    from flashformer.attention.triton.launch import Plan, paged_decode

    plan = Plan(
        batch=q.shape[0],
        q_heads=q.shape[1],
        kv_heads=k_pool.shape[0],
        max_q_len=q.shape[2],
        max_k_len=block_tables.shape[1] * k_pool.shape[2],
        scale=scale,
        softcap=rules.softcap,
        window_left=rules.window_left,
        right_limit=rules.right_limit,
        alibi_slopes=None if rules.alibi_slopes is None else rules.alibi_slopes.float(),
    )
    with torch.no_grad():
        return paged_decode(q, k_pool, v_pool, block_tables, seq_lens, plan, split_len)


def _shape(t) -> str:
    return f"shape {tuple(t.shape)} ({t.dtype})" if isinstance(t, Tensor) else type(t).__name__


def _check_cu_seqlens(cu: Tensor, name: str, total: int, max_len: int, max_name: str, device) -> int:
    """Checks offsets (B + 1,) int32 from 0 to total; returns B."""
    if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.dtype != torch.int32 or cu.numel() < 2:
        raise ValueError(f"{name} must be a 1-D int32 tensor of B + 1 offsets; got {_shape(cu)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on {device}; got {cu.device}")
    offsets = cu.tolist()
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    if offsets[0] != 0 or offsets[-1] != total or min(lengths) < 0:
        raise ValueError(
            f"{name} must rise from 0 to the packed length {total}; got {offsets[:8]}{'...' if len(offsets) > 8 else ''}"
        )
    if not isinstance(max_len, int) or max_len < max(lengths):
        raise ValueError(
            f"{max_name} must be an int >= the longest sequence ({max(lengths)}); got {max_len!r}"
        )
    return len(offsets) - 1
