"""qwen3: LLaMA's layer with q/k head norms (attn_q_norm, attn_k_norm, RMSNorm over head_dim
before RoPE), a head_dim of its own (attention.key_length), no biases, half-split RoPE (its q/k
rows are not permuted in the file)."""

from __future__ import annotations

from flashformer.checkpoints.gguf.architectures import special_token_ids, vocab_size
from flashformer.checkpoints.gguf.common import attention_shape, decoder_specs, linear_rope_scaling, summary
from flashformer.checkpoints.gguf.reader import GGUFFile


class Qwen3:
    name = "qwen3"

    def config(self, file: GGUFFile) -> dict:
        key = "qwen3."
        shape = attention_shape(file, "qwen3")
        theta = float(file.value(key + "rope.freq_base", (int, float), 10000.0))
        rope = {"rope_type": "default", "rope_theta": theta, **(linear_rope_scaling(file, "qwen3") or {})}
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": vocab_size(file, "qwen3"),
            "hidden_size": shape["d_model"],
            "intermediate_size": file.value(key + "feed_forward_length", int),
            "num_hidden_layers": file.value(key + "block_count", int),
            "num_attention_heads": shape["n_heads"],
            "num_key_value_heads": shape["kv_heads"],
            "head_dim": shape["head_dim"],
            "hidden_act": "silu",
            "max_position_embeddings": file.value(key + "context_length", int),
            "rms_norm_eps": float(file.value(key + "attention.layer_norm_rms_epsilon", (int, float))),
            "rope_theta": theta,
            "rope_parameters": rope,
            "attention_bias": False,
            "use_sliding_window": False,
            "tie_word_embeddings": "output.weight" not in file.tensors,
            **special_token_ids(file),
            "torch_dtype": "float32",
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
