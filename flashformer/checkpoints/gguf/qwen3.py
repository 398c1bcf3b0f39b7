"""qwen3: LLaMA's layer with q/k head norms (attn_q_norm, attn_k_norm, RMSNorm over head_dim
before RoPE), a head_dim of its own (attention.key_length), no biases, half-split RoPE (its q/k
rows are not permuted in the file).

qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): qwen3's attention, and a mixture of experts in place
of every layer's MLP: the router (ffn_gate_inp, (experts, d_model), kept F32 by llama.cpp's
quantizer) and the experts' SwiGLU projections stacked in three 3-D tensors (ffn_gate_exps,
ffn_up_exps: (experts, expert_feed_forward_length, d_model); ffn_down_exps: (experts, d_model,
expert_feed_forward_length)), read as one matrix per expert under transformers' per-expert names.
The file has no key for Qwen3 MoE's norm_topk_prob: llama.cpp's qwen3moe graph always
renormalizes the chosen experts' weights, and so does the model read here (as transformers' GGUF
loader also sets it)."""

from __future__ import annotations

from flashformer.checkpoints.gguf.common import (
    LLAMA_SHAPED_KEYS,
    ROPE_SCALING_KEYS,
    TensorSpec,
    decoder_specs,
    linear_rope_scaling,
    llama_shaped_config,
    refuse_unread_keys,
    summary,
)
from flashformer.checkpoints.gguf.reader import GGUFError, GGUFFile


class Qwen3:
    name = "qwen3"
    keys = LLAMA_SHAPED_KEYS + ROPE_SCALING_KEYS

    def config(self, file: GGUFFile) -> dict:
        refuse_unread_keys(file, "qwen3", self.keys)
        hf = llama_shaped_config(file, "qwen3")
        hf["rope_parameters"].update(linear_rope_scaling(file, "qwen3") or {})
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **hf,
            "attention_bias": False,
            "use_sliding_window": False,
        }

    def tensors(self, hf: dict):
        norms = {
            "attn_norm": "input_layernorm",
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
            "ffn_norm": "post_attention_layernorm",
        }
        return decoder_specs(hf, norms)

    def summary(self, hf: dict) -> str:
        return summary(hf)


class Qwen3Moe(Qwen3):
    name = "qwen3moe"
    keys = Qwen3.keys + ("expert_feed_forward_length",)

    def config(self, file: GGUFFile) -> dict:
        key = self.name + "."
        refuse_unread_keys(file, self.name, self.keys)
        hf = llama_shaped_config(file, self.name, experts=True)
        hf["rope_parameters"].update(linear_rope_scaling(file, self.name) or {})
        if any(name.endswith(".ffn_gate_up_exps.weight") for name in file.tensors):
            raise GGUFError(
                f"{file.path}: the experts' gate and up projections are one tensor (ffn_gate_up_exps, "
                f"convert_hf_to_gguf.py --fuse-gate-up-exps), which flashformer's qwen3moe does not read "
                f"(supported: ffn_gate_exps and ffn_up_exps apart, the converter's default)"
            )
        n_expert, used = file.value(key + "expert_count", int), file.value(key + "expert_used_count", int)
        if not 1 <= used <= n_expert:
            raise GGUFError(
                f"{file.path}: {key}expert_used_count={used} must be in [1, {key}expert_count={n_expert}]"
            )
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            **hf,
            "attention_bias": False,
            "use_sliding_window": False,
            "num_experts": n_expert,
            "num_experts_per_tok": used,
            "moe_intermediate_size": file.value(key + "expert_feed_forward_length", int),
            "norm_topk_prob": True,  # what llama.cpp's qwen3moe computes (the module docstring)
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }

    def tensors(self, hf: dict):
        dense = ("ffn_gate", "ffn_up", "ffn_down")  # no dense MLP: the experts take its place
        specs = [spec for spec in super().tensors(hf) if spec.gguf.split(".")[-2] not in dense]
        d, ff, n_expert = hf["hidden_size"], hf["moe_intermediate_size"], hf["num_experts"]
        for i in range(hf["num_hidden_layers"]):
            mlp = f"model.layers.{i}.mlp"
            specs.append(TensorSpec(f"blk.{i}.ffn_gate_inp.weight", f"{mlp}.gate.weight", (n_expert, d)))
            for gguf_name, hf_name, shape in (
                ("ffn_gate_exps", "gate_proj", (n_expert, ff, d)),
                ("ffn_up_exps", "up_proj", (n_expert, ff, d)),
                ("ffn_down_exps", "down_proj", (n_expert, d, ff)),
            ):
                their_name = f"{mlp}.experts.{{expert}}.{hf_name}.weight"
                specs.append(TensorSpec(f"blk.{i}.{gguf_name}.weight", their_name, shape, experts=n_expert))
        return specs

    def summary(self, hf: dict) -> str:
        return (
            f"{summary(hf)}, {hf['num_experts']} experts of {hf['moe_intermediate_size']}, "
            f"{hf['num_experts_per_tok']} per token"
        )
