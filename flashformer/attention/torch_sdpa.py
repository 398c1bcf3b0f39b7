"""The `torch` backend: PyTorch's fused `F.scaled_dot_product_attention`.

Used only where a request maps onto it exactly. Its `is_causal` is aligned
top-left, so bottom-right causal attention with Lq != Lk, windows, ALiBi and
bias functions are handed to it as a materialized (Lq, Lk) mask or bias. A
query row with no allowed key is given one (any) key to keep the kernel away
from 0/0, and its output is then set to 0, which also zeroes its gradients.
Softcap, seeded dropout and the LSE have no exact counterpart: the caller
refuses them before coming here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from flashformer.attention.masks import ScoreRules


def needs_materialized_mask(rules: ScoreRules) -> bool:
    """True when SDPA can only be given this request as an (Lq, Lk)-sized
    mask or bias that we must build (a mask or bias tensor the caller passed
    goes to SDPA as it is; key padding goes as a (B, 1, 1, Lk) mask)."""
    if rules.bias_fn is not None or rules.alibi_slopes is not None:
        return True
    if rules.window_left is not None or rules.window_right is not None:
        return True
    if not rules.causal or rules.q_len == 1:
        return False
    has_mask = rules.key_padding_mask is not None or rules.mask is not None or rules.bias is not None
    return has_mask or rules.q_len != rules.k_len


def _sdpa_is_causal_exact(rules: ScoreRules) -> bool:
    """SDPA's own is_causal (top-left) equals ours (bottom-right) when Lq == Lk.

    Decided by an `if`: under torch.compile with a symbolic length the bare
    comparison is a SymBool, which SDPA's is_causal does not take.
    """
    if rules.causal and rules.q_len > 1 and rules.q_len == rules.k_len:
        return True
    return False


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, rules: ScoreRules, scale: float) -> Tensor:
    gqa = q.shape[1] != k.shape[1]
    plain = rules.key_padding_mask is None and rules.mask is None and rules.bias is None
    if plain and not needs_materialized_mask(rules):
        is_causal = _sdpa_is_causal_exact(rules)
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa)

    out_dtype = q.dtype
    if _bias_needs_float32(rules, q.dtype):
        # SDPA takes a float mask only in q's dtype; rounding ALiBi or a float32
        # bias to bf16/fp16 would not be exact, so the kernel runs in float32.
        q, k, v = q.float(), k.float(), v.float()
    keep = rules.tile_keep(0, rules.q_len, 0, rules.k_len, q.device)  # (B|1, H|1, Lq, Lk) or None
    bias = rules.tile_bias(0, rules.q_len, 0, rules.k_len, q.device, q.dtype)
    dead_rows = None
    if keep is not None:
        dead_rows = ~keep.any(dim=-1, keepdim=True)  # (B|1, H|1, Lq, 1)
        keep = keep | dead_rows
    if bias is None:
        attn_mask = keep
    else:
        attn_mask = bias if keep is None else bias.masked_fill(~keep, float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=gqa)
    # unconditionally: asking whether any row is dead would sync, and break a compiled graph
    if dead_rows is not None:
        out = out.masked_fill(dead_rows, 0.0)
    return out.to(out_dtype)


def _bias_needs_float32(rules: ScoreRules, dtype: torch.dtype) -> bool:
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    if rules.alibi_slopes is not None or rules.bias_fn is not None:
        return True
    return rules.bias is not None and rules.bias.dtype != dtype
