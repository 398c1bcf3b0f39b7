"""qwen3: LLaMA's layer with q/k head norms (attn_q_norm, attn_k_norm, RMSNorm over head_dim
before RoPE), a head_dim of its own (attention.key_length), no biases, half-split RoPE (its q/k
rows are not permuted in the file)."""

from __future__ import annotations

from flashformer.checkpoints.gguf.common import (
    LLAMA_SHAPED_KEYS,
    ROPE_SCALING_KEYS,
    decoder_specs,
    linear_rope_scaling,
    llama_shaped_config,
    refuse_unread_keys,
    summary,
)
from flashformer.checkpoints.gguf.reader import GGUFFile


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
