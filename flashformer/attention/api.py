"""`attention()`: the one place where attention scores are computed.

It checks every argument against the contract (the signature and rules in the docstring of
attention() below, and docs/flashattention.md's first section), turns the masks
and biases into one `ScoreRules` description, picks a backend and runs it.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from flashformer.attention import cpu_kernel
from flashformer.attention.checks import (
    check_and_describe,
    check_dropout,
    check_scale,
    dropout_seed_for,
    is_float16_cache,
)
from flashformer.attention.flash import flash_attention
from flashformer.attention.masks import ScoreRules
from flashformer.attention.reference import eager_attention
from flashformer.attention.torch_sdpa import needs_materialized_mask, sdpa_attention
from flashformer.kernels.cpu import attention_compute_dtype

BACKENDS = ("auto", "eager", "flash", "triton", "torch", "cpu")


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
    global_tokens: int = 0,
    sinks: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    return_probs: bool = False,
):
    """Exact scaled dot-product attention, softmax(scale * q @ k^T + bias) @ v.

    Shapes: q (B, Hq, Lq, D); k (B, Hk, Lk, D); v (B, Hk, Lk, Dv); Hq % Hk == 0
    (MHA, GQA, MQA). k and v have q's dtype, or are float16 with a float32 q (a
    half-size KV cache): they are then widened to float32, exactly, and the
    "cpu" backend widens them as it reads them (no float32 copy). Returns out (B, Hq, Lq, Dv) in q's dtype; with
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
    global_tokens: key positions 0 .. global_tokens - 1 are visible to every query and the
        queries at those positions see every key, beyond the window (Longformer / BigBird's
        global tokens); causality still holds. The tiled backend visits the window's tiles and
        the global rows and columns only.
    sinks: (Hq,) float, a learned logit per query head that joins every row's softmax
        denominator and attends to nothing (gpt-oss's attention sinks): p_j = exp(s_j) /
        (exp(sink) + sum_k exp(s_k)); the lse includes it, and a row with no allowed key gets
        output 0 and lse = sink. A trainable tensor gets its gradient (eager, flash). The
        "torch", "cpu" and "triton" backends have no sinks: named, they refuse; auto avoids them.
    scale: defaults to 1 / sqrt(D).
    dropout_p, dropout_seed: dropout on the attention weights, a pure
        function of (seed, b, h, i, j); without a seed one is drawn from
        torch's default generator.
    backend: "auto" picks the fastest exact backend (choose_backend); on a CPU
        without bf16/fp16 matrix units it also computes bf16/fp16 inputs in
        float32 (an exact widening) and returns q's dtype. A named backend runs
        in the dtype it is given.
    A query row with no allowed key gets output 0, lse -inf, gradient 0.
    """
    rules = check_and_describe(
        q, k, v, causal, key_padding_mask, mask, bias, alibi_slopes, window, softcap, global_tokens, sinks
    )
    scale = check_scale(scale, q.shape[-1])
    check_dropout(dropout_p, dropout_seed)
    dropout_seed = dropout_seed_for(dropout_p, dropout_seed)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")

    out_dtype = q.dtype
    if backend == "auto":
        q = q.to(attention_compute_dtype(q))
        if not (q.is_cpu and is_float16_cache(q.dtype, k.dtype)):  # the CPU kernel may read that as it is
            k, v = k.to(q.dtype), v.to(q.dtype)
        backend = choose_backend(q, k, v, rules, dropout_p, return_lse, return_probs)
    elif backend == "cpu" and (missing := cpu_kernel.unsupported(q, k, v, rules, dropout_p)) is not None:
        raise NotImplementedError(f"backend='cpu' does not support {missing}")  # auto asked already
    _refuse_unsupported(backend, rules, dropout_p, return_lse, return_probs)
    if backend != "cpu":  # the kernel reads a float16 cache in place; the others take q's dtype
        k, v = k.to(q.dtype), v.to(q.dtype)

    probs = None
    if backend == "eager":
        out, lse, probs = eager_attention(q, k, v, rules, scale, dropout_p, dropout_seed)
    elif backend == "flash":
        out, lse = flash_attention(q, k, v, rules, scale, dropout_p, dropout_seed)
    elif backend == "torch":
        out, lse = sdpa_attention(q, k, v, rules, scale), None
    elif backend == "cpu":
        out, lse = cpu_kernel.cpu_attention(q, k, v, rules, scale)
    else:  # triton; imported here so that flashformer never needs Triton unless asked for it
        from flashformer.attention.triton import triton_attention

        out, lse = triton_attention(q, k, v, rules, scale, dropout_p, dropout_seed)

    out = out.to(out_dtype)
    results = (out,) + ((lse,) if return_lse else ()) + ((probs,) if return_probs else ())
    return results[0] if len(results) == 1 else results


def choose_backend(
    q: Tensor, k: Tensor, v: Tensor, rules: ScoreRules, dropout_p: float, return_lse: bool, return_probs: bool
) -> str:
    """The fastest exact backend for this request on this device.

    On the CPU (measured with the backends timed in turns; the figures are in
    docs/benchmarks.md, "How auto chooses" and "Decode attention on the CPU"):
    - up to cpu_kernel.MAX_Q_LEN queries a row in float32 without gradients
      (a decode step), with no mask or bias beyond causal, key padding,
      window, ALiBi and softcap: the C++ kernel ("cpu"), 1.0-2.2x SDPA's speed
      and one task per (row, KV head), so a row's result does not depend on
      the batch.
    - what SDPA takes as is (no mask, causal with Lq == Lk, key padding, a
      given mask or bias tensor): torch is faster at every n measured.
    - what SDPA needs an (Lq, Lk) mask or bias built for (ALiBi, bias
      functions, windows, causal with padding or with Lq != Lk): torch wins
      while Lq * Lk <= 512^2, flash beyond, as it skips tiles and builds nothing.
    - attention sinks: flash (SDPA and the C++ kernel have none).
    - bf16/fp16 on a CPU that emulates them reach this function widened to
      float32 (attention() asks kernels.cpu.attention_compute_dtype), so the
      rules above are the float32 ones.

    On CUDA, every request the Triton kernels support goes to them: they are
    the IO-aware kernels written for GPUs, and they support every feature
    (softcap, seeded dropout, the LSE) that SDPA lacks. This is a choice by
    design, pending GPU measurements (scripts/gpu_check.sh measures them
    against SDPA's backends).
    """
    if return_probs:
        return "eager"
    if q.device.type == "cuda":
        from flashformer.attention.triton import unsupported

        if unsupported(q, k, v, rules) is None:
            return "triton"
    if rules.q_len <= cpu_kernel.MAX_Q_LEN and cpu_kernel.unsupported(q, k, v, rules, dropout_p) is None:
        return "cpu"
    if dropout_p > 0 or return_lse or rules.softcap is not None or rules.sinks is not None:
        return "flash"
    if needs_materialized_mask(rules) and rules.q_len * rules.k_len > 512 * 512:
        return "flash"
    return "torch"


def _refuse_unsupported(backend, rules: ScoreRules, dropout_p, return_lse, return_probs) -> None:
    if return_probs and backend != "eager":
        raise NotImplementedError(f"return_probs is only available with backend='eager', not {backend!r}")
    if backend == "torch":
        if rules.sinks is not None:
            raise NotImplementedError("backend='torch' does not support attention sinks (sinks); use 'flash'")
        if rules.softcap is not None:
            raise NotImplementedError("backend='torch' does not support softcap")
        if dropout_p > 0:
            raise NotImplementedError(
                "backend='torch' does not support seeded dropout (its dropout draws other entries)"
            )
        if return_lse:
            raise NotImplementedError("backend='torch' does not support return_lse")
