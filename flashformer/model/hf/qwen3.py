"""Qwen3: LLaMA's layout with an RMSNorm over head_dim on every query and key head (q_norm,
k_norm) before RoPE, and a head_dim of its own (128 beside a d_model of 1024 in Qwen3-0.6B)."""

from __future__ import annotations

from flashformer.model.hf.llama import Llama
from flashformer.model.hf.mapping import norm, plain_layers, refuse


class Qwen3(Llama):
    model_type = "qwen3"

    def config_from_hf(self, hf, weights):
        refuse(hf, "qwen3", use_sliding_window=(False,))
        hf = {"vocab_size": 151936, "tie_word_embeddings": False, **hf}
        config = super().config_from_hf(hf, weights)
        return config.replace(qk_norm=True, hf_model_type="qwen3")

    def config_to_hf(self, config):
        plain_layers(config, "qwen3", qk_norm=True)
        hf = super().config_to_hf(config.replace(qk_norm=False, hf_model_type="llama"))
        return {
            **hf,
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "use_sliding_window": False,
        }

    def rules(self, config):
        rules = super().rules(config)
        for i in range(config.n_layers):
            ours, theirs = f"decoder.blocks.{i}.attn", f"layers.{i}.self_attn"
            rules += norm(f"{ours}.q_norm", f"{theirs}.q_norm", bias=False)
            rules += norm(f"{ours}.k_norm", f"{theirs}.k_norm", bias=False)
        return rules
