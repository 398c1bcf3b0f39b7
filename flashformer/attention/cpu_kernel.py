"""The C++ attention kernel for a few queries over cached keys (backend "cpu").

A decode step asks for one query (or a few) per row against all the keys so
far, in every layer: SDPA's CPU kernels spend most of such a call around the
arithmetic, and more for each row of a batch (docs/benchmarks.md, "Decode
attention on the CPU"). The kernel
(kernels/csrc/paged_attention_cpu.cpp) runs one task per (row, KV head): the
row's query heads share each key and value as it is read, and the keys are
read in place, whatever their strides (a static cache's view, or a paged
pool through its block table). One thread computes a task in a fixed order,
so a row's result does not depend on the rest of the batch.

Both entry points use it: attention()'s backend "cpu" (a static KV cache,
api.py) and paged_attention's (paged.py). It computes float32 on the CPU, in
inference only (no backward), with the rules a decoder's attention needs:
causal (bottom-right), a key padding mask, windows, softcap and ALiBi; not
general masks, biases or dropout. Keys and values may be float16 (a half-size
cache: half the bytes a decode step streams) or uint8 rows of q8_0 / q4_0
blocks (kernels/kv_blocks.py), each its own type; each span of 64 keys is
widened to float32 once per task, so the result is that of a float32 cache
holding the values they stand for, bit for bit.

The operators' schemas and fakes are declared with the others in kernels/operators.py; this
module is their callers' side: when the kernel takes a request, and its arguments from a
request's rules.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashformer.attention.masks import ScoreRules
from flashformer.kernels import extension

# attention() with backend "auto" uses the kernel for up to this many queries a row, where it beats
# SDPA; beyond, SDPA's matrix products win (docs/benchmarks.md, "Decode attention on the CPU").
# paged_attention has its own limit (paged.CPU_KERNEL_MAX_Q_LEN)
MAX_Q_LEN = 4


def cpu_kernel_runs(q: Tensor) -> bool:
    """Whether the kernel can take q: float32 on the CPU, the C++ kernels built."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and extension.cpp_kernels()


def unsupported(q: Tensor, k: Tensor, v: Tensor, rules: ScoreRules, dropout_p: float) -> str | None:
    """The first feature of this request the kernel lacks (for NotImplementedError), or None."""
    if q.device.type != "cpu" or q.dtype != torch.float32:
        return f"{q.dtype} tensors on {q.device} (it takes float32 on the CPU)"
    if rules.mask is not None or rules.bias is not None or rules.bias_fn is not None:
        return "masks and biases other than causal, key padding, window and ALiBi"
    if dropout_p > 0:
        return "dropout"
    if rules.global_tokens:
        return "global tokens"
    if rules.sinks is not None:
        return "attention sinks (its softmax has no sink term)"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return "gradients (it has no backward)"
    if not extension.cpp_kernels():
        return "running without flashformer's C++ CPU kernels, which could not be built here"
    return None


def cpu_attention(q: Tensor, k: Tensor, v: Tensor, rules: ScoreRules, scale: float) -> tuple[Tensor, Tensor]:
    """attention() on the kernel: q (B, Hq, Lq, D), k (B, Hk, Lk, D), v (B, Hk, Lk, Dv), read in
    place (a static cache's view needs no copy). Returns out (B, Hq, Lq, Dv), lse (B, Hq, Lq)."""
    slopes, padding = rules.alibi_slopes, rules.key_padding_mask  # (B|1, Hq, 1, 1), (B, 1, 1, Lk)
    return torch.ops.flashformer.attention_cpu(
        q,
        k,
        v,
        scale,
        0.0 if rules.softcap is None else float(rules.softcap),
        rules.causal,
        None if slopes is None else slopes[:, :, 0, 0],
        None if padding is None else padding[:, 0, 0, :],
        -1 if rules.window_left is None else rules.window_left,
        -1 if rules.window_right is None else rules.window_right,
    )


def run_batched(q, k_pool, v_pool, block_tables, seq_lens, rules: ScoreRules, scale: float, key_padding=None):
    """q (B, Hq, Lq, D), Lq queries a row -> out (B, Hq, Lq, Dv), lse (B, Hq, Lq)."""
    batch, q_heads, q_len, dim = q.shape
    packed = q.transpose(1, 2).reshape(batch * q_len, q_heads, dim)  # (B * Lq, Hq, D)
    starts = torch.arange(0, batch * q_len + 1, q_len, device=q.device)  # (B + 1,)
    out, lse = run_packed(packed, k_pool, v_pool, block_tables, seq_lens, starts, rules, scale, key_padding)
    out = out.view(batch, q_len, q_heads, -1).transpose(1, 2)  # (B, Hq, Lq, Dv)
    return out, lse.view(batch, q_len, q_heads).transpose(1, 2)  # (B, Hq, Lq)


def run_packed(
    q, k_pool, v_pool, block_tables, seq_lens, q_starts, rules: ScoreRules, scale: float, key_padding=None
):
    """q (T, Hq, D) packed (sequence s's rows q_starts[s] .. q_starts[s + 1] - 1) ->
    out (T, Hq, Dv), lse (T, Hq). k_pool (Hk, num_blocks, block_size, D) in any strides."""
    slopes = rules.alibi_slopes  # (B|1, Hq, 1, 1) or None
    return torch.ops.flashformer.paged_attention_cpu(
        q,
        k_pool,
        v_pool,
        block_tables,
        seq_lens,
        q_starts,
        scale,
        0.0 if rules.softcap is None else float(rules.softcap),
        rules.causal,
        None if slopes is None else slopes[:, :, 0, 0],
        key_padding,
        -1 if rules.window_left is None else rules.window_left,
        -1 if rules.window_right is None else rules.window_right,
    )
