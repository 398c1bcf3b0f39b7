"""phi3: Phi-3, Phi-3.5 and Phi-4-mini (fused qkv and gate/up, partial rotary), read."""

from __future__ import annotations

from flashformer.checkpoints.gguf.common import (
    LLAMA_SHAPED_KEYS,
    TensorSpec,
    embedding_and_head_specs,
    llama_shaped_config,
    refuse_unread_keys,
)
from flashformer.checkpoints.gguf.reader import GGUFError, GGUFFile


class Phi3:
    """Phi-3, Phi-3.5 and Phi-4-mini: q, k, v in one tensor (attn_qkv) and gate and up in one
    (ffn_up, gate rows first), as transformers' Phi3 has them (qkv_proj, gate_up_proj); RoPE
    in the rotate-half layout over the first rope.dimension_count channels of a head.

    attention.sliding_window is read and not applied: llama.cpp switches Phi-3's window off
    (its phi3 model sets no sliding window, whatever the file says) and transformers' GGUF
    loader does not read it, so both compute full causal attention. LongRoPE (the
    rope_factors_long/short tensors and rope.scaling.attn_factor of the 128k-context models)
    is refused by name.
    """

    name = "phi3"
    keys = LLAMA_SHAPED_KEYS + ("rope.scaling.original_context_length", "attention.sliding_window")

    def config(self, file: GGUFFile) -> dict:
        key = "phi3."
        longrope = [n for n in ("rope_factors_long.weight", "rope_factors_short.weight") if n in file.tensors]
        if longrope or key + "rope.scaling.attn_factor" in file.metadata:
            found = longrope or [key + "rope.scaling.attn_factor"]
            raise GGUFError(
                f"{file.path}: {', '.join(map(repr, found))}: LongRoPE (Phi-3's 128k context, Phi-3.5, "
                f"Phi-4-mini) is not supported; supported: phi3 files with plain RoPE (Phi-3-mini-4k)"
            )
        refuse_unread_keys(file, "phi3", self.keys)
        hf = llama_shaped_config(file, "phi3", rope_dims="partial")
        if hf["head_dim"] * hf["num_attention_heads"] != hf["hidden_size"]:
            raise GGUFError(
                f"{file.path}: phi3.attention.key_length={hf['head_dim']} is not supported (transformers' "
                f"phi3 has heads of embedding_length / head_count = "
                f"{hf['hidden_size'] // hf['num_attention_heads']})"
            )
        rotary = file.value(key + "rope.dimension_count", int, hf["head_dim"])
        file.value(key + "attention.sliding_window", int, 0)  # read, checked, not applied (docstring)
        hf["rope_parameters"]["partial_rotary_factor"] = rotary / hf["head_dim"]
        del hf["head_dim"]
        return {
            "architectures": ["Phi3ForCausalLM"],
            "model_type": "phi3",
            **hf,
            "original_max_position_embeddings": file.value(
                key + "rope.scaling.original_context_length", int, hf["max_position_embeddings"]
            ),
            "sliding_window": None,
        }

    def tensors(self, hf: dict) -> list[TensorSpec]:
        d, ff = hf["hidden_size"], hf["intermediate_size"]
        head_dim = d // hf["num_attention_heads"]
        qkv_rows = (hf["num_attention_heads"] + 2 * hf["num_key_value_heads"]) * head_dim
        specs = embedding_and_head_specs(hf)
        for i in range(hf["num_hidden_layers"]):
            blk, layer = f"blk.{i}", f"model.layers.{i}"
            specs += [
                TensorSpec(f"{blk}.attn_norm.weight", f"{layer}.input_layernorm.weight", (d,)),
                TensorSpec(f"{blk}.attn_qkv.weight", f"{layer}.self_attn.qkv_proj.weight", (qkv_rows, d)),
                TensorSpec(f"{blk}.attn_output.weight", f"{layer}.self_attn.o_proj.weight", (d, d)),
                TensorSpec(f"{blk}.ffn_norm.weight", f"{layer}.post_attention_layernorm.weight", (d,)),
                TensorSpec(f"{blk}.ffn_up.weight", f"{layer}.mlp.gate_up_proj.weight", (2 * ff, d)),
                TensorSpec(f"{blk}.ffn_down.weight", f"{layer}.mlp.down_proj.weight", (d, ff)),
            ]
        return specs

    def summary(self, hf: dict) -> str:
        return (
            f"vocab {hf['vocab_size']}, d_model {hf['hidden_size']}, {hf['num_attention_heads']} heads "
            f"({hf['num_key_value_heads']} KV), feed-forward {hf['intermediate_size']}"
        )
