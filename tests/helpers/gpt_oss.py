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


# e2m1's 16 codes' values (bit 3 the sign), as the OCP Microscaling spec defines them
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def mxfp4_quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float (..., rows, K) -> MXFP4 as transformers' folders store it (openai's layout):
    blocks uint8 (..., rows, K / 32, 16), byte j holding value 2j in its low nibble and 2j + 1 in
    its high, and scales uint8 (..., rows, K / 32), the e8m0 exponent e of 2^(e - 127). Written
    from the spec: a block's scale is 2^(floor(log2(amax)) - 2) (e2m1's largest exponent is 2),
    each value rounded to the nearest e2m1 value, those past 6 times the scale to 6 (the spec's
    conversion clamps them)."""
    *lead, k = weight.shape
    groups = weight.reshape(*lead, k // 32, 32).astype(np.float32)
    amax = np.abs(groups).max(-1)  # (..., K / 32)
    exponent = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, -127).astype(np.int32)
    exponent = np.clip(exponent, -127, 127)
    scaled = groups / np.ldexp(np.float32(1), exponent)[..., None]
    codes = np.abs(np.abs(scaled)[..., None] - E2M1[:8]).argmin(-1).astype(np.uint8)  # nearest magnitude
    codes |= np.where((scaled < 0) & (codes > 0), 8, 0).astype(np.uint8)  # the sign bit
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # (..., K / 32, 16)
    # C order: safetensors.numpy writes an array's buffer as it lies, strides ignored
    return np.ascontiguousarray(blocks, np.uint8), np.ascontiguousarray(exponent + 127, np.uint8)


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The inverse of mxfp4_quantize's layout: (..., rows, K / 32, 16), (..., rows, K / 32) ->
    float32 (..., rows, K)."""
    codes = np.stack((blocks & 15, blocks >> 4), -1).reshape(*blocks.shape[:-1], 32)
    values = E2M1[codes] * np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
    return values.reshape(*blocks.shape[:-2], -1).astype(np.float32)


def save_mxfp4_folder(model, folder) -> dict[str, np.ndarray]:
    """`model` saved as openai's gpt-oss checkpoints are: config.json with quantization_config
    {quant_method: mxfp4}, every expert projection as mlp.experts.{gate_up,down}_proj_blocks and
    _scales (the (out, in) matrix of each expert, (experts, out, in / 32, 16) and (experts, out,
    in / 32)), their biases and every other tensor as the model holds them (its dtype). Returns the
    dequantized expert weights in transformers' in-memory layout ({name: (experts, in, out)}
    float32), the float weights the folder means."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    folder = Path(folder)
    model.save_pretrained(folder)
    tensors, meant = {}, {}
    for name, tensor in model.state_dict().items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = tensor.detach().contiguous()
            continue
        matrices = tensor.detach().float().numpy().transpose(0, 2, 1)  # (experts, out, in)
        blocks, scales = mxfp4_quantize(matrices)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = (
            torch.from_numpy(blocks),
            torch.from_numpy(scales),
        )
        meant[name] = mxfp4_dequantize(blocks, scales).transpose(0, 2, 1)  # (experts, in, out)
    for old in folder.glob("model*.safetensors*"):
        old.unlink()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return meant
