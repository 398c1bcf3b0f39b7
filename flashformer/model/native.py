"""A decoder model as the native decoder runs it (kernels/native_decoder.py): what each layer is,
read once from the built modules, and the reason when some part of a model has no native form.

    decoder = native_decoder(model)        # a NativeDecoder, or None (native_unsupported says why)

What it reads, per layer: the pre-norms (RMSNorm or LayerNorm) and Gemma's sandwich norms, the
q/k/v projection (float32, quantized, or a quantized layer's runs of formats), Qwen3's and
Gemma 3's q/k head norms, RoPE (one table for the model, one of its own for Gemma 3's sliding
layers, none in SmolLM3's NoPE layers; YaRN's and LongRoPE's factor on cos and sin, and
LongRoPE's long table, chosen per sequence as the modules choose it), the attention's scale, softcap and window, the output projection, and the plain or gated
feed-forward with its activation; then the final norm, the head (tied or its own) and Gemma 2's
final-logit softcap. The models of every GGUF architecture flashformer reads have this shape, but
a mixture of experts (qwen3moe, gpt-oss), gpt-oss's attention sinks and clamped SwiGLU, LFM2's
short convolutions, and Gemma 4's per-layer inputs, shared keys and values, wider full-layer
heads, proportional RoPE, value norm and layer scales: they have no native form yet, and
native_unsupported says so.

A model's decoder is built once and kept beside the model (a weak map: copying or pickling the model
never meets it), with the identity and memory
of every tensor it reads: if a module or a tensor is replaced (quantize(), .to(), a load), the next
call builds it again. In-place updates (an optimizer's step) need nothing: the decoder reads the
same memory.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from flashformer.kernels import extension
from flashformer.kernels.native_decoder import NativeDecoder
from flashformer.kernels.quantized import ConcatenatedLinear, QuantizedEmbedding, QuantizedLinear
from flashformer.model.experts import MixtureOfExperts
from flashformer.model.feed_forward import FeedForward, FusedGatedFeedForward, GatedFeedForward
from flashformer.model.layers import MultiHeadAttention, RMSNorm, Softcap, pre_norm_residual
from flashformer.model.positional import LearnedPositions, NoAttentionPositions, RotaryEmbedding
from flashformer.model.stacks import EmbeddingScale

_ACTIVATIONS = {nn.ReLU: "relu", nn.SiLU: "silu"}
# model -> (fingerprint, its NativeDecoder, or None where its layers have no native form)
_BUILT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Unsupported(Exception):
    """A part of the model the native decoder has no form for (the message says which)."""


def native_unsupported(model) -> str | None:
    """Why `model` cannot run natively right now, or None when it can (then native_decoder builds)."""
    reason = _unsupported_now(model)
    if reason is not None:
        return reason
    try:
        _check_shape(model)
    except Unsupported as error:
        return str(error)
    return None


def _unsupported_now(model) -> str | None:
    """What rules the native decoder out whatever the model's layers: its arch, where and how its
    parameters live, its mode, autocast, the C++ kernels."""
    config = model.config
    if config.arch != "decoder":
        return f"arch {config.arch!r} (the native decoder runs decoder-only models)"
    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or parameter.dtype != torch.float32:
        return f"parameters in {parameter.dtype} on {parameter.device} (it runs float32 on the CPU)"
    if any(type(p.data) is not torch.Tensor for p in model.parameters()):
        return "parameters that are not plain tensors (sharded by FSDP, or a tensor subclass)"
    if model.training:
        return "the model is in training mode (dropout)"
    if torch.is_autocast_enabled("cpu"):
        return "autocast is on"
    if not extension.cpp_kernels():
        return "flashformer's C++ kernels could not be built here"
    return None


def native_decoder(model) -> NativeDecoder | None:
    """The model's NativeDecoder (built on first use, rebuilt when its tensors change), or None
    where native_unsupported gives a reason. The layers are read once per set of tensors: a
    session's call on an unchanged model costs the fingerprint only."""
    if _unsupported_now(model) is not None:
        return None
    fingerprint = _fingerprint(model)
    kept = _BUILT.get(model)
    if kept is None or kept[0] != fingerprint:
        try:
            _check_shape(model)
            decoder = _build(model)
        except Unsupported:
            decoder = None
        kept = _BUILT[model] = (fingerprint, decoder)
    return kept[1]


def _fingerprint(model) -> tuple:
    """What the built decoder depends on: every parameter's and buffer's identity and memory."""
    tensors = [*model.parameters(), *model.buffers()]
    return tuple((id(t), t.data_ptr(), t.dtype) for t in tensors)


# ---- what has a native form ----


def _check_shape(model) -> None:
    config = model.config
    embeddings, decoder = model.embeddings, model.decoder
    if embeddings.token_types is not None or not isinstance(embeddings.norm, nn.Identity):
        raise Unsupported("token types or an embedding norm (BERT's)")
    if embeddings.positions is not None and not isinstance(embeddings.positions, LearnedPositions):
        raise Unsupported(f"{type(embeddings.positions).__name__} absolute positions")
    if not isinstance(decoder.positions, RotaryEmbedding | NoAttentionPositions):
        raise Unsupported(f"{type(decoder.positions).__name__} (RoPE or absolute positions only)")
    if config.attention_kind != "softmax" or config.global_tokens:
        raise Unsupported("linear attention or global tokens")
    if "conv" in (config.layer_types or ()):
        raise Unsupported(
            "LFM2's short convolution layers (lfm2, layer_types 'conv'): the native decoder keeps no "
            "conv state yet"
        )
    if config.attention_sinks:
        raise Unsupported("attention sinks (gpt-oss): the native decoder's attention has no sink term")
    gemma4 = {
        "per-layer inputs (per_layer_input_dim)": config.per_layer_input_dim,
        "keys and values shared across layers (kv_shared_layers)": config.kv_shared_layers,
        "a head width of its own on the full layers (global_head_dim)": config.global_head_dim
        not in (None, config.head_dim),
        "proportional RoPE (rope_proportional)": config.rope_proportional,
        "a value norm (v_norm)": config.v_norm,
        "per-layer output scales (layer_scale)": config.layer_scale,
    }
    missing = [name for name, present in gemma4.items() if present]
    if missing:
        raise Unsupported(f"Gemma 4's {', '.join(missing)}: the native decoder has no such step yet")
    if config.swiglu_limit is not None:
        raise Unsupported(
            "the clamped SwiGLU (swiglu_limit, gpt-oss): the native decoder has no such activation"
        )
    if not config.prenorm:
        raise Unsupported("post-norm blocks")
    for index in range(config.n_layers):
        block = decoder.block(index)
        if block.has_cross_attention or block.residual is not pre_norm_residual:
            raise Unsupported(f"layer {index}: cross-attention or a post-norm residual")
        window = getattr(block.attn, "window", None)
        if type(block.attn) is not MultiHeadAttention or (window is not None and window[1] is not None):
            raise Unsupported(f"layer {index}: {type(block.attn).__name__} (causal self-attention only)")
        if isinstance(block.ffn, MixtureOfExperts):  # the eager modules run it
            raise Unsupported(
                f"layer {index}: a mixture of experts ({block.ffn.n_expert} experts, "
                f"{block.ffn.n_expert_used} per token): the native decoder has no expert-grouped products yet"
            )
        for name, module in block.named_modules():
            if isinstance(module, QuantizedLinear) and module._pad_in:  # its x would need zero columns
                raise Unsupported(
                    f"layer {index}: {name} reads {module.in_features} inputs, not whole blocks"
                )
        projections = [
            getattr(block.ffn, n) for n in ("gate", "up", "gate_up", "down") if hasattr(block.ffn, n)
        ]
        for module in (block.attn.qkv, block.attn.out, *projections):
            _linear(module)  # an adapted one (adapters/: LoRA beside it) runs in the eager modules
        _activation(block.ffn.act)


def _activation(module: nn.Module) -> str:
    if isinstance(module, nn.GELU):
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    for kind, name in _ACTIVATIONS.items():
        if isinstance(module, kind):
            return name
    raise Unsupported(f"the activation {type(module).__name__}")


def _norm(decoder: NativeDecoder, layer: int, which: str, module: nn.Module) -> None:
    if isinstance(module, nn.Identity):
        return
    if isinstance(module, RMSNorm):
        decoder.set_norm(layer, which, "rmsnorm", module.weight, None, module.eps)
    elif isinstance(module, nn.LayerNorm) and module.elementwise_affine and module.bias is not None:
        decoder.set_norm(layer, which, "layernorm", module.weight, module.bias, module.eps)
    else:
        raise Unsupported(f"the norm {module!r}")


# ---- building ----


def _build(model) -> NativeDecoder:
    config = model.config
    embeddings, stack = model.embeddings, model.decoder
    decoder = NativeDecoder(
        d_model=config.d_model,
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        n_layers=config.n_layers,
    )
    tokens = embeddings.tokens
    scale = embeddings.token_scale.scale if isinstance(embeddings.token_scale, EmbeddingScale) else 1.0
    # the scale rounded to float32 first, as EmbeddingScale multiplies by a float32 tensor
    scale = float(torch.tensor(scale, dtype=torch.float32))
    decoder.set_embedding(tokens if isinstance(tokens, QuantizedEmbedding) else tokens.weight, scale)
    if embeddings.positions is not None:
        decoder.set_positions(embeddings.positions.weight)
    rope = isinstance(stack.positions, RotaryEmbedding)
    if rope:
        positions = stack.positions
        decoder.set_rotary(0, positions.inv_freq)
        if positions.cos_sin_factor != 1.0 or positions.long_inv_freq is not None:  # YaRN, LongRoPE
            original = 0 if positions.long_inv_freq is None else positions.scaling.original_max_seq_len
            decoder.set_rotary_scaling(positions.cos_sin_factor, positions.long_inv_freq, original)
        if stack.sliding_positions is not None:
            decoder.set_rotary(1, stack.sliding_positions.inv_freq)
    for index in range(config.n_layers):
        block = stack.block(index)
        sliding = stack.layer_types[index] == "sliding_attention" and stack.sliding_positions is not None
        roped = rope and index not in stack.nope_layers  # SmolLM3's NoPE layers: no table
        _layer(decoder, index, block, rope=(1 if sliding else 0) if roped else -1)
    _norm(decoder, -1, "final", stack.final_norm)
    head = model.lm_head if model.lm_head is not None else tokens.weight
    decoder.add_linear(-1, "head", head)
    softcap = model.logit_softcap
    decoder.set_logit_softcap(softcap.cap if isinstance(softcap, Softcap) else None)
    return decoder.finish()


def _layer(decoder: NativeDecoder, index: int, block, rope: int) -> None:
    attn, ffn = block.attn, block.ffn
    _norm(decoder, index, "attn", block.attn_norm)
    _norm(decoder, index, "attn_out", block.attn_out_norm)
    _norm(decoder, index, "ffn", block.ffn_norm)
    _norm(decoder, index, "ffn_out", block.ffn_out_norm)
    _norm(decoder, index, "q", attn.q_norm)
    _norm(decoder, index, "k", attn.k_norm)
    decoder.add_linear(index, "qkv", _linear(attn.qkv))
    decoder.add_linear(index, "out", _linear(attn.out))
    window = None if attn.window is None else attn.window[0]
    decoder.set_attention(index, rope=rope, scale=attn.scale, softcap=attn.softcap, window_left=window)
    if isinstance(ffn, GatedFeedForward):
        decoder.add_linear(index, "up", _linear(ffn.gate))
        decoder.add_linear(index, "up", _linear(ffn.up))
        kind = "gated"
    elif isinstance(ffn, FusedGatedFeedForward):
        decoder.add_linear(index, "up", _linear(ffn.gate_up))  # gate rows first
        kind = "gated"
    elif isinstance(ffn, FeedForward):
        decoder.add_linear(index, "up", _linear(ffn.up))
        kind = "plain"
    else:
        raise Unsupported(f"layer {index}: the feed-forward {type(ffn).__name__}")
    decoder.add_linear(index, "down", _linear(ffn.down))
    decoder.set_feed_forward(index, kind, _activation(ffn.act))


def _linear(module: nn.Module):
    if isinstance(module, QuantizedLinear | ConcatenatedLinear | nn.Linear):
        return module
    raise Unsupported(f"the projection {type(module).__name__}")
