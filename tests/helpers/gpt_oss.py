"""gpt-oss for the tests: a random transformers GptOssForCausalLM, and the GGUF tensors and
metadata llama.cpp's converter writes for it (its names and keys, checked against a file of the
converter itself: conversion/gpt_oss.py and the gpt-oss graph of the vendored llama.cpp)."""

from __future__ import annotations

import numpy as np
import torch

from helpers.gguf import decoder_outer_tensors, tiny_vocabulary

# the real model's YaRN (gpt-oss-20b's config.json): 32 x 4096 positions, truncate=False
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def tiny_gpt_oss(seed: int = 0, **overrides):
    """A random GptOssForCausalLM: 2 layers (sliding window 8, then full), 4 query / 2 KV heads of
    16, 8 experts of 32, 2 per token, YaRN as gpt-oss-20b has it. Nudged from init so that no part
    is an identity: sinks ~ N(0, 1), every bias ~ N(0, 0.1), norms in [0.5, 1.5], the router's
    weights large enough that each token's choice is clear (a rounding could swap two at init)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    values = dict(
        vocab_size=len(tiny_vocabulary()["tokenizer.ggml.tokens"]),
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=dict(YARN),
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = GptOssConfig(**{**values, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            elif name.endswith("sinks"):
                parameter.normal_(0.0, 1.0)
            elif name.endswith("router.weight"):
                parameter.normal_(0.0, 0.5)
            elif name.endswith("bias"):
                parameter.normal_(0.0, 0.1)
            else:
                parameter.add_(torch.randn_like(parameter) * 0.05)
    return model


def gpt_oss_tensors(model, expert_types=("F32", "F32", "F32")) -> dict[str, tuple[np.ndarray, str]]:
    """The GGUF tensors llama.cpp's converter writes for a float GptOssForCausalLM: q/k/v/o with
    their biases (no row permutation: half-split RoPE), attn_sinks, the norms (attn_norm, and
    post_attention_norm before the experts), the router ffn_gate_inp with its bias, and the
    experts de-interleaved and stacked (experts, out, in) in ffn_gate_exps / ffn_up_exps /
    ffn_down_exps, stored in expert_types (gate, up, down), each with a bias (experts, out);
    everything else F32."""
    config, state, tensors = decoder_outer_tensors(model)
    types = {}
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        for gguf_name, hf_name in (
            ("attn_q", "self_attn.q_proj"),
            ("attn_k", "self_attn.k_proj"),
            ("attn_v", "self_attn.v_proj"),
            ("attn_output", "self_attn.o_proj"),
            ("ffn_gate_inp", "mlp.router"),
        ):
            tensors[f"blk.{i}.{gguf_name}.weight"] = state[f"{layer}.{hf_name}.weight"]
            tensors[f"blk.{i}.{gguf_name}.bias"] = state[f"{layer}.{hf_name}.bias"]
        tensors[f"blk.{i}.attn_sinks.weight"] = state[f"{layer}.self_attn.sinks"]
        tensors[f"blk.{i}.attn_norm.weight"] = state[f"{layer}.input_layernorm.weight"]
        tensors[f"blk.{i}.post_attention_norm.weight"] = state[f"{layer}.post_attention_layernorm.weight"]
        gate_up = state[f"{layer}.mlp.experts.gate_up_proj"].transpose(0, 2, 1)  # (experts, 2 ff, d)
        gate_up_bias = state[f"{layer}.mlp.experts.gate_up_proj_bias"]  # (experts, 2 ff)
        down = state[f"{layer}.mlp.experts.down_proj"].transpose(0, 2, 1)  # (experts, d, ff)
        parts = {
            "ffn_gate_exps": (gate_up[:, 0::2], gate_up_bias[:, 0::2]),
            "ffn_up_exps": (gate_up[:, 1::2], gate_up_bias[:, 1::2]),
            "ffn_down_exps": (down, state[f"{layer}.mlp.experts.down_proj_bias"]),
        }
        for (gguf_name, (weight, bias)), type_name in zip(parts.items(), expert_types):
            tensors[f"blk.{i}.{gguf_name}.weight"] = np.ascontiguousarray(weight)
            tensors[f"blk.{i}.{gguf_name}.bias"] = np.ascontiguousarray(bias)
            types[f"blk.{i}.{gguf_name}.weight"] = type_name
    return {name: (values, types.get(name, "F32")) for name, values in tensors.items()}


def gpt_oss_metadata(model) -> dict:
    """The metadata llama.cpp's converter writes for a GptOssForCausalLM (its keys; none for the
    layer pattern, which llama.cpp fixes at sliding-then-full, nor for swiglu_limit and
    swiglu_alpha, which it fixes at 7.0 and 1.702, nor for YaRN's truncate)."""
    config = model.config
    rope = config.rope_parameters
    return {
        "gpt-oss.block_count": config.num_hidden_layers,
        "gpt-oss.context_length": config.max_position_embeddings,
        "gpt-oss.embedding_length": config.hidden_size,
        "gpt-oss.feed_forward_length": config.intermediate_size,
        "gpt-oss.attention.head_count": config.num_attention_heads,
        "gpt-oss.attention.head_count_kv": config.num_key_value_heads,
        "gpt-oss.attention.key_length": config.head_dim,
        "gpt-oss.attention.value_length": config.head_dim,
        "gpt-oss.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
        "gpt-oss.rope.freq_base": float(rope["rope_theta"]),
        "gpt-oss.rope.scaling.type": "yarn",
        "gpt-oss.rope.scaling.factor": float(rope["factor"]),
        "gpt-oss.rope.scaling.original_context_length": rope["original_max_position_embeddings"],
        "gpt-oss.rope.scaling.yarn_beta_fast": float(rope["beta_fast"]),
        "gpt-oss.rope.scaling.yarn_beta_slow": float(rope["beta_slow"]),
        "gpt-oss.expert_count": config.num_local_experts,
        "gpt-oss.expert_used_count": config.num_experts_per_tok,
        "gpt-oss.attention.sliding_window": config.sliding_window,
        "gpt-oss.expert_feed_forward_length": config.intermediate_size,
        **tiny_vocabulary(),
    }
