"""gpt-oss (llama.cpp's LLM_ARCH_OPENAI_MOE, general.architecture "gpt-oss"): a LLaMA-shaped
attention with biases on q, k, v and o (half-split RoPE: the q/k rows are not permuted), one
learned sink per query head (attn_sinks.weight, (heads,)), every other layer a sliding window
(attention.sliding_window keys; llama.cpp fixes the pattern at sliding, full, sliding, ... and
writes no key for it), YaRN RoPE (rope.scaling.*), and a mixture of experts in every layer: the
router with its bias (ffn_gate_inp), the experts' projections stacked in 3-D tensors
(ffn_gate_exps, ffn_up_exps: (experts, expert_feed_forward_length, d_model); ffn_down_exps:
(experts, d_model, expert_feed_forward_length)), each with a bias (experts, out), the norm before
them named post_attention_norm. The converter de-interleaved transformers' fused gate_up_proj
into gate and up, and the experts are read as one matrix per expert under the per-expert names
that the gpt_oss Hugging Face family maps (model/hf/gpt_oss.py).

What the file does not say, and is read as gpt-oss's released config says it: the clamped
SwiGLU's limit 7.0 and alpha 1.702 (llama.cpp's graph hard-codes the same), and YaRN's
truncate=False (transformers' ramp; llama.cpp always rounds the ramp's ends outwards, so its own
logits differ slightly from transformers' at long positions). MXFP4 experts (the type gpt-oss
ships in) are read as any other block type: each expert's blocks sliced from the 3-D tensor, run
by the MXFP4 kernels (kernels/csrc/mxfp4_cpu.cpp) with quantize="gguf", dequantized without.
"""

from __future__ import annotations

from flashformer.checkpoints.gguf.common import (
    LLAMA_SHAPED_KEYS,
    TensorSpec,
    embedding_and_head_specs,
    llama_shaped_config,
    refuse_unread_keys,
    summary,
)
from flashformer.checkpoints.gguf.reader import GGUFError, GGUFFile

YARN_KEYS = tuple(
    f"rope.scaling.{key}"
    for key in (
        "type",
        "factor",
        "original_context_length",
        "yarn_beta_fast",
        "yarn_beta_slow",
        "yarn_attn_factor",
        "yarn_ext_factor",
    )
)


class GptOss:
    name = "gpt-oss"
    keys = LLAMA_SHAPED_KEYS + YARN_KEYS + ("expert_feed_forward_length", "attention.sliding_window")

    def config(self, file: GGUFFile) -> dict:
        key = self.name + "."
        refuse_unread_keys(file, self.name, self.keys)
        hf = llama_shaped_config(file, self.name, experts=True)
        if any(name.endswith(".ffn_gate_up_exps.weight") for name in file.tensors):
            raise GGUFError(
                f"{file.path}: the experts' gate and up projections are one tensor (ffn_gate_up_exps), which "
                f"flashformer's gpt-oss does not read (supported: ffn_gate_exps and ffn_up_exps apart)"
            )
        n_expert, used = file.value(key + "expert_count", int), file.value(key + "expert_used_count", int)
        if not 1 <= used <= n_expert:
            raise GGUFError(
                f"{file.path}: {key}expert_used_count={used} must be in [1, {key}expert_count={n_expert}]"
            )
        n_layers = hf["num_hidden_layers"]
        return {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            **hf,
            "intermediate_size": file.value(key + "expert_feed_forward_length", int),
            "rope_parameters": {**hf["rope_parameters"], **self.yarn(file)},
            "attention_bias": True,
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)],
            "sliding_window": file.value(key + "attention.sliding_window", int),
            "num_local_experts": n_expert,
            "num_experts_per_tok": used,
            "swiglu_limit": 7.0,  # what llama.cpp's graph hard-codes (the module docstring)
            "swiglu_alpha": 1.702,
        }

    def yarn(self, file: GGUFFile) -> dict:
        """transformers' rope_parameters for the file's rope.scaling.*: YaRN, or none at all."""
        key = self.name + ".rope.scaling."
        kind = file.value(key + "type", str, "none")
        if kind == "none":
            return {}
        if kind != "yarn":
            raise GGUFError(f"{file.path}: {key}type={kind!r} is not supported for gpt-oss ('none', 'yarn')")
        extrapolation = file.value(key + "yarn_ext_factor", (int, float), 1.0)
        if extrapolation != 1.0:
            raise GGUFError(
                f"{file.path}: {key}yarn_ext_factor={extrapolation} is not supported (supported: 1.0)"
            )
        rope = {
            "rope_type": "yarn",
            "factor": float(file.value(key + "factor", (int, float))),
            "original_max_position_embeddings": file.value(key + "original_context_length", int),
            "beta_fast": float(file.value(key + "yarn_beta_fast", (int, float), 32.0)),
            "beta_slow": float(file.value(key + "yarn_beta_slow", (int, float), 1.0)),
            "truncate": False,  # gpt-oss's config (the module docstring)
        }
        attention_factor = file.value(key + "yarn_attn_factor", (int, float), None)
        if attention_factor is not None:
            rope["attention_factor"] = float(attention_factor)
        return rope

    def tensors(self, hf: dict):
        d, ff, n_expert = hf["hidden_size"], hf["intermediate_size"], hf["num_local_experts"]
        heads, q_rows = hf["num_attention_heads"], hf["num_attention_heads"] * hf["head_dim"]
        kv_rows = hf["num_key_value_heads"] * hf["head_dim"]
        specs = embedding_and_head_specs(hf)
        for i in range(hf["num_hidden_layers"]):
            blk, layer = f"blk.{i}", f"model.layers.{i}"
            attn, mlp = f"{layer}.self_attn", f"{layer}.mlp"
            specs += [
                TensorSpec(f"{blk}.attn_norm.weight", f"{layer}.input_layernorm.weight", (d,)),
                TensorSpec(
                    f"{blk}.post_attention_norm.weight", f"{layer}.post_attention_layernorm.weight", (d,)
                ),
                TensorSpec(f"{blk}.attn_sinks.weight", f"{attn}.sinks", (heads,)),
            ]
            for gguf_name, hf_name, shape in (
                ("attn_q", f"{attn}.q_proj", (q_rows, d)),
                ("attn_k", f"{attn}.k_proj", (kv_rows, d)),
                ("attn_v", f"{attn}.v_proj", (kv_rows, d)),
                ("attn_output", f"{attn}.o_proj", (d, q_rows)),
                ("ffn_gate_inp", f"{mlp}.router", (n_expert, d)),
            ):
                specs.append(TensorSpec(f"{blk}.{gguf_name}.weight", f"{hf_name}.weight", shape))
                specs.append(TensorSpec(f"{blk}.{gguf_name}.bias", f"{hf_name}.bias", shape[:1]))
            for gguf_name, hf_name, shape in (
                ("ffn_gate_exps", "gate_proj", (n_expert, ff, d)),
                ("ffn_up_exps", "up_proj", (n_expert, ff, d)),
                ("ffn_down_exps", "down_proj", (n_expert, d, ff)),
            ):
                their = f"{mlp}.experts.{{expert}}.{hf_name}"
                specs.append(
                    TensorSpec(f"{blk}.{gguf_name}.weight", f"{their}.weight", shape, experts=n_expert)
                )
                specs.append(
                    TensorSpec(f"{blk}.{gguf_name}.bias", f"{their}.bias", shape[:2], experts=n_expert)
                )
        return specs

    def summary(self, hf: dict) -> str:
        return (
            f"{summary(hf)}, {hf['num_local_experts']} experts of {hf['intermediate_size']}, "
            f"{hf['num_experts_per_tok']} per token, sliding window {hf['sliding_window']}"
        )
