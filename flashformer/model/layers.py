"""The pieces of a Transformer block: projections, norms, attention sub-layers, and the
encoder and decoder blocks built from them, with the feed-forward each block picks
(feed_forward.py's dense MLPs, experts.py's mixture of experts).

Variants are chosen at construction (`make_norm`, `make_feed_forward`, the
residual rule of a block); forward methods only compute. Every attention
score is computed by `flashformer.attention`.

A KV cache plugs into `MultiHeadAttention.forward(x, kv_cache=..., cache_position=...)`:
a paged one (serve.paged_cache: `paged = True`) takes the new keys and values
and the queries in `attend(q, k, v, scale, window, softcap)`; any other object with

    update(k, v, cache_position) -> (k_all, v_all)

that stores the new keys and values (B, Hk, L, D) at positions
cache_position .. cache_position + L - 1 and returns every key and value so
far, (B, Hk, cache_position + L, D). The new queries then attend with causal
alignment at the bottom right, which is exactly "L new tokens after
cache_position cached ones".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashformer.attention import attention
from flashformer.attention.linear import causal_linear_attention, linear_attention_step, make_feature_map
from flashformer.generate.cache import RecurrentState
from flashformer.kernels.cpu import Linear
from flashformer.model.config import ModelConfig
from flashformer.model.experts import MixtureOfExperts
from flashformer.model.feed_forward import (
    ACTIVATIONS,
    FeedForward,
    FusedGatedFeedForward,
    gated_feed_forward,
)
from flashformer.model.positional import apply_rotary
from flashformer.model.short_conv import ShortConv

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


class UnitRMSNorm(nn.Module):
    """RMSNorm without a weight (Gemma 4's value heads): x / sqrt(mean(x^2) + eps)."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, eps=config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps)


def make_output_norm(config: ModelConfig) -> nn.Module:
    """The norm of a sub-layer's output before the residual add (sandwich_norm: Gemma 2 and 3),
    or nothing."""
    return make_norm(config) if config.sandwich_norm else nn.Identity()


def make_head_norm(config: ModelConfig, head_dim: int) -> nn.Module:
    """qk_norm (Qwen3, Gemma 3): an RMSNorm over each head's head_dim channels, or nothing."""
    return RMSNorm(head_dim, eps=config.norm_eps) if config.qk_norm else nn.Identity()


class Softcap(nn.Module):
    """cap * tanh(x / cap): values squashed smoothly into (-cap, cap) (Gemma 2's final logits)."""

    def __init__(self, cap: float):
        super().__init__()
        self.cap = cap

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x / self.cap) * self.cap

    def extra_repr(self) -> str:
        return f"cap={self.cap}"


def attention_window(config: ModelConfig, index: int, causal: bool) -> tuple[int, int | None] | None:
    """The keys layer `index` sees around the diagonal, as attention()'s window: a sliding
    layer sees its sliding_window most recent keys, itself included (key j for query i iff
    i - sliding_window < j <= i, as transformers and llama.cpp mask); a full layer, None."""
    if config.layer_type(index) != "sliding_attention":
        return None
    return (config.sliding_window - 1, None if causal else config.sliding_window - 1)


# ---- feed-forward ----


def make_feed_forward(config: ModelConfig, index: int = 0) -> nn.Module:
    """Block `index`'s feed-forward: a mixture of experts (config.n_expert), or one dense MLP."""
    if config.n_expert:
        return MixtureOfExperts(config)
    width = config.layer_ffn_width(index)
    if config.gated_ffn and not config.fused_gate_up:
        return gated_feed_forward(config, width, config.ffn_bias)  # clamped or plain
    kind = FusedGatedFeedForward if config.gated_ffn else FeedForward
    return kind(config.d_model, width, config.activation, config.ffn_bias, config.activation_dropout)


class PerLayerGate(nn.Module):
    """x + norm(up(act(gate(x)) * per_layer_input)): Gemma 4's per-layer input (per_layer.py),
    gated by the layer's output, added back to the residual stream."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = Linear(config.d_model, config.per_layer_input_dim, bias=False)
        self.act = ACTIVATIONS[config.activation]()
        self.projection = Linear(config.per_layer_input_dim, config.d_model, bias=False)
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)

    def forward(self, x: Tensor, per_layer_input: Tensor) -> Tensor:
        """x (B, L, d_model), per_layer_input (B, L, width) -> (B, L, d_model)."""
        gated = self.act(self.gate(x)) * per_layer_input  # (B, L, width)
        return x + self.norm(self.projection(gated))


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
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    global_tokens: int = 0,
    sinks: Tensor | None = None,
    cross: bool = False,
) -> Tensor:
    """flashformer.attention for the layers; returns (B, Hq, Lq, Dv) in q's dtype.

    Inside `recording_attention()` the probabilities are recorded as well
    (cross: this is a decoder's cross-attention). Autocast is switched off
    around the call so that the backends run in the dtype they are handed
    (attention itself decides the dtype it computes in).
    """
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
            window=window,
            softcap=softcap,
            global_tokens=global_tokens,
            sinks=sinks,
            scale=scale,
            dropout_p=dropout_p,
            backend=backend if maps is None else "eager",
            return_probs=maps is not None,
        )
    if maps is not None:
        out, probs = out
        (maps.cross if cross else maps.decoder if causal else maps.encoder).append(probs)
    return out


class MultiHeadAttention(nn.Module):
    """Self-attention with Hq query heads and Hk key/value heads (MHA, GQA, MQA).

    q, k and v come from one fused projection (one GEMM instead of three).
    Positions enter through the keyword arguments the stack passes: `rotary`
    (cos, sin) for RoPE, `bias` (T5's relative bias function) or
    `alibi_slopes`. A KV cache enters through `kv_cache` and `cache_position`
    (see the module docstring).

    What differs between layers of one model (Gemma's sliding-window layers) is fixed here,
    at construction: `window` (attention_window), the softcap, the q/k head norms, the head
    width (config.layer_head_dim: Gemma 4's wider full layers), and the global tokens a
    windowed layer adds (config.global_tokens: Longformer / BigBird). A layer whose keys and
    values later layers read (config.kv_sharers: Gemma 4) leaves them in the `shared_kv` dict the
    stack hands every layer, under its layer type.
    """

    def __init__(
        self,
        config: ModelConfig,
        causal: bool,
        window: tuple[int, int | None] | None = None,
        index: int = 0,
        kv_projections: bool = True,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim = config.layer_head_dim(index)
        self.causal, self.window, self.softcap = causal, window, config.attention_softcap
        self.global_tokens = config.global_tokens if window is not None else 0
        self.scale = config.attention_scale if config.attention_scale is not None else self.head_dim**-0.5
        self.dropout_p = config.attention_dropout
        self.backend = config.attention_backend
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.split_sizes = (q_width, kv_width, kv_width) if kv_projections else (q_width,)
        self.qkv = Linear(config.d_model, sum(self.split_sizes), bias=config.attention_bias)
        self.q_norm = make_head_norm(config, self.head_dim)
        if kv_projections:
            self.k_norm = make_head_norm(config, self.head_dim)
            self.v_norm = UnitRMSNorm(config.norm_eps) if config.v_norm else nn.Identity()
        self.shares_kv_as = config.kv_sharers().get(index)  # a layer type, or None
        self.out = Linear(q_width, config.d_model, bias=config.attention_out_bias)
        # gpt-oss's attention sinks: a logit per query head in every softmax's denominator
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if config.attention_sinks else None

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
        shared_kv: dict | None = None,
    ) -> Tensor:
        """x (B, L, d_model) -> (B, L, d_model).

        key_padding_mask: (B, cache_position + L) bool, True = a real token.
        shared_kv: layer type -> (k, v) of every position so far, for the layers that read them.
        """
        batch, length, _ = x.shape
        q, k, v = self.project(x, rotary)
        if getattr(kv_cache, "paged", False):  # a paged cache attends over each row's own blocks
            if self.global_tokens or self.sinks is not None or self.shares_kv_as is not None:
                raise NotImplementedError(
                    "a paged KV cache does not serve global tokens (config.global_tokens), "
                    "attention sinks (config.attention_sinks) or keys and values shared across "
                    "layers (config.kv_shared_layers)"
                )
            out = kv_cache.attend(
                q, k, v, scale=self.scale, window=self.window, softcap=self.softcap
            )  # (B, Hq, L, D)
            return self.out(out.transpose(1, 2).reshape(batch, length, -1))
        if kv_cache is not None:
            k, v = kv_cache.update(k, v, cache_position)  # (B, Hk, cache_position + L, D)
        if self.shares_kv_as is not None:
            shared_kv[self.shares_kv_as] = (k, v)
        return self.attend_over(q, k, v, batch, length, key_padding_mask, bias, alibi_slopes)

    def attend_over(self, q, k, v, batch, length, key_padding_mask, bias, alibi_slopes) -> Tensor:
        """q (B, Hq, L, D) over k, v (B, Hk, Lk, D), then the output projection -> (B, L, d_model)."""
        out = attend(
            q,
            k,
            v,
            causal=self.causal,
            key_padding_mask=key_padding_mask,
            bias=bias,
            alibi_slopes=alibi_slopes,
            window=self.window,
            softcap=self.softcap,
            global_tokens=self.global_tokens,
            sinks=self.sinks,
            scale=self.scale,
            dropout_p=self.dropout_p if self.training else 0.0,
            backend=self.backend,
        )  # (B, Hq, L, D)
        return self.out(out.transpose(1, 2).reshape(batch, length, -1))

    def project(self, x: Tensor, rotary: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, L, d_model) -> q (B, Hq, L, D), k, v (B, Hk, L, D), with the head norms and RoPE."""
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).split(self.split_sizes, dim=-1)
        q = q.view(batch, length, self.n_heads, self.head_dim).transpose(1, 2)  # (B, Hq, L, D)
        k = k.view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hk, L, D)
        q, k = self.q_norm(q), self.k_norm(k)  # per head, over D (qk_norm), before RoPE
        v = v.view(batch, length, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hk, L, D)
        v = self.v_norm(v)  # v_norm (Gemma 4): unit RMS per head
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        return q, k, v


class SharedKVAttention(MultiHeadAttention):
    """Self-attention over the keys and values of an earlier layer (config.kv_source: Gemma 4's
    last layers): its own queries (their norm and RoPE), and no key or value projection. The
    earlier layer left its keys and values of every position so far in `shared_kv`."""

    def __init__(self, config: ModelConfig, window: tuple[int, int | None] | None, index: int):
        super().__init__(config, causal=True, window=window, index=index, kv_projections=False)
        self.reads_kv_of = config.layer_type(index)

    def forward(self, x: Tensor, *, key_padding_mask=None, rotary=None, shared_kv=None, **cache) -> Tensor:
        """x (B, L, d_model) -> (B, L, d_model); its own kv_cache (in `cache`) is left untouched."""
        if getattr(cache.get("kv_cache"), "paged", False):
            raise NotImplementedError(
                "a paged KV cache does not serve keys and values shared across layers (config.kv_shared_layers)"
            )
        batch, length, _ = x.shape
        (q,) = self.qkv(x).split(self.split_sizes, dim=-1)
        q = self.q_norm(q.view(batch, length, self.n_heads, self.head_dim).transpose(1, 2))  # (B, Hq, L, D)
        if rotary is not None:
            q = apply_rotary(q, *rotary)
        k, v = shared_kv[self.reads_kv_of]  # (B, Hk, cache_position + L, D)
        return self.attend_over(q, k, v, batch, length, key_padding_mask, None, None)


class LinearSelfAttention(MultiHeadAttention):
    """Causal self-attention through a feature map (attention_kind="linear"; attention/linear.py):
    phi(q) (sum phi(k) v^T) / (phi(q) · sum phi(k)), no score matrix, so no mask, bias or
    window. Its decoding cache is a state of fixed size (generate.cache.make_caches: S, z per
    layer), advanced by the recurrent step. Performer's random features are drawn per layer
    (seed = the layer's index) and saved with the weights."""

    def __init__(self, config: ModelConfig, index: int = 0):
        super().__init__(config, causal=True)
        self.feature_map = make_feature_map(
            config.linear_feature_map, config.head_dim, config.linear_features, seed=index
        )

    def forward(
        self,
        x: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        rotary: tuple[Tensor, Tensor] | None = None,
        kv_cache=None,
        cache_position: int = 0,
        **no_scores,  # bias, alibi_slopes: score rules, which a linear attention has none of
    ) -> Tensor:
        """x (B, L, d_model) -> (B, L, d_model); kv_cache: a RecurrentState holding S and z."""
        if key_padding_mask is not None and not bool(key_padding_mask.all()):
            raise ValueError("linear attention sums over every earlier token and takes no key padding")
        if kv_cache is not None and not isinstance(kv_cache, RecurrentState):
            raise ValueError(
                "linear attention keeps a fixed-size state (generate.cache.make_caches gives a RecurrentState), "
                f"not a KV cache; got {type(kv_cache).__name__}"
            )
        batch, length, _ = x.shape
        q, k, v = self.project(x, rotary)
        phi_q, phi_k = self.feature_map(q, True), self.feature_map(k, False)  # (B, Hq | Hk, L, F)
        if kv_cache is None:
            out, _ = causal_linear_attention(phi_q, phi_k, v)  # (B, Hq, L, D)
        else:
            kv_cache.check_position(cache_position)
            state = (kv_cache["S"].to(v.dtype), kv_cache["z"].to(v.dtype))
            step = linear_attention_step if length == 1 else causal_linear_attention
            out, (s, z) = step(phi_q, phi_k, v, state)
            kv_cache.advance(length, S=s, z=z)
        return self.out(out.transpose(1, 2).reshape(batch, length, -1))


def make_self_attention(config: ModelConfig, index: int, causal: bool) -> nn.Module:
    """Layer `index`'s token mixer: exact self-attention (with its window and global tokens; over an
    earlier layer's keys and values where config.kv_source says so), linear attention, or a conv
    layer's short convolution (LFM2: short_conv.py)."""
    if config.layer_type(index) == "conv":
        return ShortConv(config)
    if config.attention_kind == "linear":
        return LinearSelfAttention(config, index)
    window = attention_window(config, index, causal)
    if config.kv_source(index) is not None:
        return SharedKVAttention(config, window, index)
    return MultiHeadAttention(config, causal=causal, window=window, index=index)


class CrossAttention(nn.Module):
    """Queries from the decoder, keys and values from the encoder's output ("memory").

    The memory's keys and values do not change while a decoder generates;
    `project_memory` computes them once so that a cache can keep them and
    pass them back as `memory_kv`.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
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
    """Bidirectional self-attention, then the feed-forward, each with a residual and a norm.
    index: the layer's place in its stack (what it attends to: config.layer_types)."""

    def __init__(self, config: ModelConfig, index: int = 0):
        super().__init__()
        self.attn_norm = make_norm(config)
        self.attn = MultiHeadAttention(
            config, causal=False, window=attention_window(config, index, False), index=index
        )
        self.attn_out_norm = make_output_norm(config)
        self.ffn_norm = make_norm(config)
        self.ffn = make_feed_forward(config, index)
        self.ffn_out_norm = make_output_norm(config)
        self.dropout = nn.Dropout(config.dropout)
        self.residual = pre_norm_residual if config.prenorm else post_norm_residual

    def forward(self, x: Tensor, padding_mask: Tensor | None = None, **position_args) -> Tensor:
        """x (B, L, d_model) -> (B, L, d_model); padding_mask (B, L) bool, True = real token."""

        def self_attention(h: Tensor) -> Tensor:
            return self.attn_out_norm(self.attn(h, key_padding_mask=padding_mask, **position_args))

        def feed_forward(h: Tensor) -> Tensor:
            return self.ffn_out_norm(self.ffn(h))

        x = self.residual(x, self.attn_norm, self_attention, self.dropout)
        return self.residual(x, self.ffn_norm, feed_forward, self.dropout)


class DecoderBlock(nn.Module):
    """Causal self-attention, then (in an encoder-decoder) cross-attention to
    the encoder's output, then the feed-forward. index: the layer's place in its stack.
    With sandwich_norm each sub-layer's output is normalized before the residual add.
    Gemma 4 then gates in the layer's per-layer input (per_layer.PerLayerGate) and multiplies
    the block's output by a learned scalar (layer_scale)."""

    def __init__(self, config: ModelConfig, cross_attention: bool = False, index: int = 0):
        super().__init__()
        self.has_cross_attention = cross_attention
        self.attn_norm = make_norm(config)
        self.attn = make_self_attention(config, index, causal=True)
        self.attn_out_norm = make_output_norm(config)
        if cross_attention:
            self.cross_norm = make_norm(config)
            self.cross_attn = CrossAttention(config)
        self.ffn_norm = make_norm(config)
        self.ffn = make_feed_forward(config, index)
        self.ffn_out_norm = make_output_norm(config)
        self.dropout = nn.Dropout(config.dropout)
        self.residual = pre_norm_residual if config.prenorm else post_norm_residual
        self.per_layer = PerLayerGate(config) if config.per_layer_input_dim else None
        self.layer_scale = nn.Parameter(torch.ones(1)) if config.layer_scale else None

    def forward(
        self,
        x: Tensor,
        padding_mask: Tensor | None = None,
        memory: Tensor | None = None,
        memory_padding_mask: Tensor | None = None,
        memory_kv: tuple[Tensor, Tensor] | None = None,
        kv_cache=None,
        cache_position: int = 0,
        per_layer_input: Tensor | None = None,
        **position_args,
    ) -> Tensor:
        """x (B, L, d_model) -> (B, L, d_model).

        padding_mask: (B, cache_position + L) bool over the self-attention keys.
        memory, memory_padding_mask: the encoder's output (B, M, d_model) and its (B, M) mask.
        per_layer_input: (B, L, per_layer_input_dim), this layer's (Gemma 4), or None.
        position_args: the positional arguments of attention, and shared_kv where layers share.
        """

        def self_attention(h: Tensor) -> Tensor:
            out = self.attn(
                h,
                key_padding_mask=padding_mask,
                kv_cache=kv_cache,
                cache_position=cache_position,
                **position_args,
            )
            return self.attn_out_norm(out)

        def feed_forward(h: Tensor) -> Tensor:
            return self.ffn_out_norm(self.ffn(h))

        def cross_attention(h: Tensor) -> Tensor:
            return self.cross_attn(h, memory, memory_padding_mask=memory_padding_mask, memory_kv=memory_kv)

        x = self.residual(x, self.attn_norm, self_attention, self.dropout)
        if self.has_cross_attention:
            x = self.residual(x, self.cross_norm, cross_attention, self.dropout)
        x = self.residual(x, self.ffn_norm, feed_forward, self.dropout)
        if self.per_layer is not None:
            x = self.per_layer(x, per_layer_input)
        return x if self.layer_scale is None else x * self.layer_scale.to(x.dtype)
