"""The pieces of a Transformer block: projections, norms, feed-forward,
attention sub-layers, and the encoder and decoder blocks built from them.

Variants are chosen at construction (`make_norm`, `make_feed_forward`, the
residual rule of a block); forward methods only compute. Every attention
score is computed by `flashformer.attention`.

A KV cache plugs into `MultiHeadAttention.forward(x, kv_cache=..., cache_position=...)`:
any object with

    update(k, v, cache_position) -> (k_all, v_all)

that stores the new keys and values (B, Hk, L, D) at positions
cache_position .. cache_position + L - 1 and returns every key and value so
far, (B, Hk, cache_position + L, D). The new queries then attend with causal
alignment at the bottom right, which is exactly "L new tokens after
cache_position cached ones".
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashformer.attention import attention
from flashformer.config import ModelConfig
from flashformer.positional import apply_rotary

# ---- projections ----


@functools.cache
def _cpu_lacks_fast_low_precision_matmul(dtype: torch.dtype) -> bool:
    """True on CPUs where oneDNN has no bf16/fp16 matrix path (AVX2 machines).

    There a bf16 GEMM runs 4-100x slower than a float32 one (measured on a
    2-core AMD EPYC with AVX2, torch 2.13, 2048 x 768 x 3072: float32 21
    GFLOP/s in every layout; bf16 4.8 GFLOP/s for x @ W^T, 0.6 for x @ W and
    0.2 with both operands transposed, the layouts of the backward pass).
    """
    if dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return not torch.ops.mkldnn._is_mkldnn_fp16_supported()


def _emulate_low_precision_matmul(dtype: torch.dtype) -> bool:
    """FLASHFORMER_NATIVE_LOW_PRECISION_MATMUL=1 turns the emulation off (to measure the difference)."""
    if os.environ.get("FLASHFORMER_NATIVE_LOW_PRECISION_MATMUL") == "1":
        return False
    return _cpu_lacks_fast_low_precision_matmul(dtype)


class _LowPrecisionLinear(torch.autograd.Function):
    """x @ W^T + b in bf16/fp16 semantics, computed by a float32 GEMM.

    The operands are rounded to the low precision first, exactly as autocast
    rounds them. A product of two bf16 (or fp16) numbers is exact in float32,
    and a bf16 GEMM accumulates in float32, so this computes the same numbers
    as a native low-precision GEMM, up to the order of summation; the output
    and the gradients are rounded back to the low precision as autocast's
    would be. What is saved for the backward pass stays in low precision.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
        x_low, weight_low = x.to(dtype), weight.to(dtype)
        bias32 = None if bias is None else bias.to(dtype).float()
        out = F.linear(x_low.float(), weight_low.float(), bias32)  # float32 GEMM of low-precision values
        ctx.save_for_backward(x_low, weight_low)
        ctx.dtype, ctx.x_dtype, ctx.has_bias = dtype, x.dtype, bias is not None
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x_low, weight_low = ctx.saved_tensors
        grad = grad_out.to(ctx.dtype).float()  # (*, out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad @ weight_low.float()).to(ctx.dtype).to(ctx.x_dtype)  # (*, in)
        if ctx.needs_input_grad[1]:
            grad_2d, x_2d = grad.reshape(-1, grad.shape[-1]), x_low.reshape(-1, x_low.shape[-1]).float()
            grad_w = (grad_2d.T @ x_2d).to(ctx.dtype).float()  # (out, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.dtype).float()
        return grad_x, grad_w, grad_b, None


FEW_ROWS = 128  # up to here (rows of x) the CPU inference path below beats F.linear
ROW_BLOCKS = 16  # one-row products: W's rows in this many blocks, one bmm


def _few_rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ W^T + b for a few rows of x (decoding), on the CPU, without autograd.

    A decode step multiplies 1 to B rows by every weight matrix, so its time
    is the time to stream the weights from memory. F.linear computes it as
    x @ W^T, and for so few rows MKL runs that slowly on the CPU we measured
    (2-core AMD EPYC, torch 2.13, W 50257 x 768, the GPT-2 head): 1 row 15 ms,
    on one thread; 8 rows 68 ms. Here:
    - 1 row: W's rows are cut into ROW_BLOCKS contiguous blocks and the
      products run as one bmm, which torch spreads over its threads: 9 ms.
      Over GPT-2-small's 61 matrices of one step, 2 to 16 blocks all stream
      15-18 GB/s (F.linear: 10), and 20-21.5 GB/s under torch.compile, whose
      generated kernels follow the blocks. 16 leaves room for more threads.
    - 2 to FEW_ROWS rows: out^T = W @ x^T, the same product with W as the left
      operand, which MKL runs as a threaded GEMM: 8 rows 18 ms. Measured gains
      for GPT-2-small's shapes shrink with the rows: 1.7-3.9x at 8, 1.1-1.2x at
      128, none at 256.
    The sums are the same up to their order (float32 rounding).
    """
    rows, n_in = x.numel() // x.shape[-1], x.shape[-1]
    n_out = weight.shape[0]
    x2 = x.reshape(rows, n_in)  # (M, in)
    if rows == 1 and n_out >= 2 * ROW_BLOCKS:
        split = n_out - n_out % ROW_BLOCKS
        blocks = weight[:split].view(ROW_BLOCKS, split // ROW_BLOCKS, n_in)  # (blocks, out / blocks, in)
        out = torch.bmm(x2.expand(ROW_BLOCKS, 1, n_in), blocks.transpose(1, 2)).view(1, split)
        if split < n_out:
            out = torch.cat([out, x2 @ weight[split:].t()], dim=1)  # (1, out)
        if bias is not None:
            out += bias
    elif bias is not None:
        out = torch.addmm(bias[:, None], weight, x2.t()).t().contiguous()  # (M, out)
    else:
        out = torch.mm(weight, x2.t()).t().contiguous()  # (M, out)
    return out.view(*x.shape[:-1], n_out)


def _is_cpu_float32_inference(x: Tensor, weight: Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.is_contiguous()
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, with two CPU exceptions: under autocast to bf16/fp16 on a CPU
    without a fast low-precision GEMM, the same numbers come from a float32
    GEMM; and in float32 inference on a few rows (decoding), a faster
    arrangement of the same product (_few_rows_linear)."""
    if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        if dtype in (torch.bfloat16, torch.float16) and _emulate_low_precision_matmul(dtype):
            with torch.autocast("cpu", enabled=False):
                return _LowPrecisionLinear.apply(x, weight, bias, dtype)
    elif 0 < x.numel() <= FEW_ROWS * x.shape[-1] and _is_cpu_float32_inference(x, weight):
        return _few_rows_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear through `linear`: same parameters, same results, fast under CPU autocast."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


# ---- norms ----


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight: no mean subtracted, no bias (T5, LLaMA).

    The statistic is taken in float32 whatever the input dtype, as T5 does,
    so that bf16/fp16 activations do not lose the normalization.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, eps=config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps)


# ---- feed-forward ----

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,  # exact, with erf (BERT)
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),  # GPT-2's "gelu_new", T5 v1.1's gated-gelu
    "silu": nn.SiLU,  # SwiGLU's gate (LLaMA)
}


class FeedForward(nn.Module):
    """down(act(up(x))): the position-wise MLP of BERT, GPT-2 and T5 v1.0."""

    def __init__(self, d_model: int, d_ff: int, activation: str, bias: bool, dropout: float = 0.0):
        super().__init__()
        self.up = Linear(d_model, d_ff, bias=bias)
        self.act = ACTIVATIONS[activation]()
        self.dropout = nn.Dropout(dropout)
        self.down = Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:  # (B, L, d_model) -> (B, L, d_model)
        return self.down(self.dropout(self.act(self.up(x))))


class GatedFeedForward(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (LLaMA) with silu, gated-gelu (T5 v1.1) with gelu_tanh."""

    def __init__(self, d_model: int, d_ff: int, activation: str, bias: bool, dropout: float = 0.0):
        super().__init__()
        self.gate = Linear(d_model, d_ff, bias=bias)
        self.up = Linear(d_model, d_ff, bias=bias)
        self.act = ACTIVATIONS[activation]()
        self.dropout = nn.Dropout(dropout)
        self.down = Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:  # (B, L, d_model) -> (B, L, d_model)
        return self.down(self.dropout(self.act(self.gate(x)) * self.up(x)))


def make_feed_forward(config: ModelConfig) -> nn.Module:
    kind = GatedFeedForward if config.gated_ffn else FeedForward
    return kind(config.d_model, config.d_ff, config.activation, config.ffn_bias, config.activation_dropout)


# ---- attention ----


class AttentionMaps:
    """Attention probabilities (B, H, Lq, Lk), one per attention call, in call
    order: a model's forward with output_attentions=True collects them here."""

    def __init__(self):
        self.encoder: list[Tensor] = []  # bidirectional self-attention
        self.decoder: list[Tensor] = []  # causal self-attention
        self.cross: list[Tensor] = []  # a decoder's attention to the encoder's output


_attention_maps: ContextVar[AttentionMaps | None] = ContextVar("attention_maps", default=None)


@contextlib.contextmanager
def recording_attention(enabled: bool = True) -> Iterator[AttentionMaps | None]:
    """While active, every `attend` runs the eager backend and records its
    probabilities (the only backend that forms them). Scoped to this context
    (a ContextVar), so the layers' signatures need not carry a flag."""
    if not enabled:
        yield None
        return
    maps = AttentionMaps()
    token = _attention_maps.set(maps)
    try:
        yield maps
    finally:
        _attention_maps.reset(token)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    key_padding_mask: Tensor | None,
    scale: float,
    dropout_p: float,
    backend: str,
    bias: Callable[[Tensor, Tensor], Tensor] | Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    cross: bool = False,
) -> Tensor:
    """flashformer.attention with the layers' dtype rule; returns (B, Hq, Lq, Dv) in q's dtype.

    Inside `recording_attention()` the probabilities are recorded as well
    (cross: this is a decoder's cross-attention).

    On the CPU, bf16/fp16 queries, keys and values are given to attention in
    float32 (exact: a widening): there its fastest path is float32 SDPA.
    Measured for GPT-2-small shapes (B=8, H=12, L=256, D=64, causal,
    forward + backward, 2-core AVX2 EPYC): SDPA float32 420 ms, flash bf16
    970 ms, SDPA bf16 1350 ms. Autocast is switched off around the call so
    that the backends run in the dtype they were handed.
    """
    out_dtype = q.dtype
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        q, k, v = q.float(), k.float(), v.float()
    # torch.compile cannot trace a ContextVar; a compiled forward does not record
    maps = None if torch.compiler.is_compiling() else _attention_maps.get()
    with torch.autocast(q.device.type, enabled=False):
        out = attention(
            q,
            k,
            v,
            causal=causal,
            key_padding_mask=key_padding_mask,
            bias=bias,
            alibi_slopes=alibi_slopes,
            scale=scale,
            dropout_p=dropout_p,
            backend=backend if maps is None else "eager",
            return_probs=maps is not None,
        )
    if maps is not None:
        out, probs = out
        (maps.cross if cross else maps.decoder if causal else maps.encoder).append(probs)
    return out.to(out_dtype)


class MultiHeadAttention(nn.Module):
    """Self-attention with Hq query heads and Hk key/value heads (MHA, GQA, MQA).

    q, k and v come from one fused projection (one GEMM instead of three).
    Positions enter through the keyword arguments the stack passes: `rotary`
    (cos, sin) for RoPE, `bias` (T5's relative bias function) or
    `alibi_slopes`. A KV cache enters through `kv_cache` and `cache_position`
    (see the module docstring).
    """

    def __init__(self, config: ModelConfig, causal: bool):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.dim_per_head
        self.causal = causal
        self.scale = config.attention_scale if config.attention_scale is not None else self.head_dim**-0.5
        self.dropout_p = config.attention_dropout
        self.backend = config.attention_backend
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.split_sizes = (q_width, kv_width, kv_width)
        self.qkv = Linear(config.d_model, q_width + 2 * kv_width, bias=config.attention_bias)
        self.out = Linear(q_width, config.d_model, bias=config.attention_bias)

    def forward(
        self,
        x: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        rotary: tuple[Tensor, Tensor] | None = None,
        bias: Callable[[Tensor, Tensor], Tensor] | None = None,
        alibi_slopes: Tensor | None = None,
        kv_cache=None,
        cache_position: int = 0,
    ) -> Tensor:
        """x (B, L, d_model) -> (B, L, d_model).

        key_padding_mask: (B, cache_position + L) bool, True = a real token.
        """
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).split(self.split_sizes, dim=-1)
        q = q.view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)  # (B, Hq, L, D)
        k = k.view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hk, L, D)
        v = v.view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hk, L, D)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v, cache_position)  # (B, Hk, cache_position + L, D)
        out = attend(
            q,
            k,
            v,
            causal=self.causal,
            key_padding_mask=key_padding_mask,
            bias=bias,
            alibi_slopes=alibi_slopes,
            scale=self.scale,
            dropout_p=self.dropout_p if self.training else 0.0,
            backend=self.backend,
        )  # (B, Hq, L, D)
        return self.out(out.transpose(1, 2).reshape(batch, length, -1))


class CrossAttention(nn.Module):
    """Queries from the decoder, keys and values from the encoder's output ("memory").

    The memory's keys and values do not change while a decoder generates;
    `project_memory` computes them once so that a cache can keep them and
    pass them back as `memory_kv`.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.dim_per_head
        self.scale = config.attention_scale if config.attention_scale is not None else self.head_dim**-0.5
        self.dropout_p = config.attention_dropout
        self.backend = config.attention_backend
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q = Linear(config.d_model, q_width, bias=config.attention_bias)
        self.kv = Linear(config.d_model, 2 * kv_width, bias=config.attention_bias)
        self.out = Linear(q_width, config.d_model, bias=config.attention_bias)

    def project_memory(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """memory (B, M, d_model) -> k, v, each (B, Hk, M, D)."""
        batch, length, _ = memory.shape
        kv = self.kv(memory).view(batch, length, 2, self.n_kv_heads, self.head_dim)
        return kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        memory_padding_mask: Tensor | None = None,
        memory_kv: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """x (B, L, d_model), memory (B, M, d_model) -> (B, L, d_model).

        memory_padding_mask: (B, M) bool, True = a real token.
        """
        batch, length, _ = x.shape
        k, v = memory_kv if memory_kv is not None else self.project_memory(memory)  # (B, Hk, M, D)
        q = self.q(x).view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)  # (B, Hq, L, D)
        out = attend(
            q,
            k,
            v,
            causal=False,
            key_padding_mask=memory_padding_mask,
            scale=self.scale,
            dropout_p=self.dropout_p if self.training else 0.0,
            backend=self.backend,
            cross=True,
        )  # (B, Hq, L, D)
        return self.out(out.transpose(1, 2).reshape(batch, length, -1))


# ---- blocks ----


def pre_norm_residual(x: Tensor, norm: nn.Module, sublayer: Callable, dropout: nn.Module) -> Tensor:
    """x + dropout(sublayer(norm(x))): GPT-2, T5, LLaMA. The residual stream is never normalized."""
    return x + dropout(sublayer(norm(x)))


def post_norm_residual(x: Tensor, norm: nn.Module, sublayer: Callable, dropout: nn.Module) -> Tensor:
    """norm(x + dropout(sublayer(x))): the original Transformer and BERT."""
    return norm(x + dropout(sublayer(x)))


class EncoderBlock(nn.Module):
    """Bidirectional self-attention, then the feed-forward, each with a residual and a norm."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attn_norm = make_norm(config)
        self.attn = MultiHeadAttention(config, causal=False)
        self.ffn_norm = make_norm(config)
        self.ffn = make_feed_forward(config)
        self.dropout = nn.Dropout(config.dropout)
        self.residual = pre_norm_residual if config.prenorm else post_norm_residual

    def forward(self, x: Tensor, padding_mask: Tensor | None = None, **position_args) -> Tensor:
        """x (B, L, d_model) -> (B, L, d_model); padding_mask (B, L) bool, True = real token."""

        def self_attention(h: Tensor) -> Tensor:
            return self.attn(h, key_padding_mask=padding_mask, **position_args)

        x = self.residual(x, self.attn_norm, self_attention, self.dropout)
        return self.residual(x, self.ffn_norm, self.ffn, self.dropout)


class DecoderBlock(nn.Module):
    """Causal self-attention, then (in an encoder-decoder) cross-attention to
    the encoder's output, then the feed-forward."""

    def __init__(self, config: ModelConfig, cross_attention: bool = False):
        super().__init__()
        self.has_cross_attention = cross_attention
        self.attn_norm = make_norm(config)
        self.attn = MultiHeadAttention(config, causal=True)
        if cross_attention:
            self.cross_norm = make_norm(config)
            self.cross_attn = CrossAttention(config)
        self.ffn_norm = make_norm(config)
        self.ffn = make_feed_forward(config)
        self.dropout = nn.Dropout(config.dropout)
        self.residual = pre_norm_residual if config.prenorm else post_norm_residual

    def forward(
        self,
        x: Tensor,
        padding_mask: Tensor | None = None,
        memory: Tensor | None = None,
        memory_padding_mask: Tensor | None = None,
        memory_kv: tuple[Tensor, Tensor] | None = None,
        kv_cache=None,
        cache_position: int = 0,
        **position_args,
    ) -> Tensor:
        """x (B, L, d_model) -> (B, L, d_model).

        padding_mask: (B, cache_position + L) bool over the self-attention keys.
        memory, memory_padding_mask: the encoder's output (B, M, d_model) and its (B, M) mask.
        """

        def self_attention(h: Tensor) -> Tensor:
            return self.attn(
                h,
                key_padding_mask=padding_mask,
                kv_cache=kv_cache,
                cache_position=cache_position,
                **position_args,
            )

        def cross_attention(h: Tensor) -> Tensor:
            return self.cross_attn(h, memory, memory_padding_mask=memory_padding_mask, memory_kv=memory_kv)

        x = self.residual(x, self.attn_norm, self_attention, self.dropout)
        if self.has_cross_attention:
            x = self.residual(x, self.cross_norm, cross_attention, self.dropout)
        return self.residual(x, self.ffn_norm, self.ffn, self.dropout)
