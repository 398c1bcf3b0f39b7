"""phi3: Phi-3, Phi-3.5 and Phi-4-mini (fused qkv and gate/up, partial rotary, LongRoPE), read."""

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
    loader does not read it, so both compute full causal attention.

    LongRoPE (the 128k-context Phi-3, Phi-3.5, Phi-4-mini): the converter wrote the short and long
    factors as the tensors rope_factors_short/long (one per rotated channel pair) and the
    attention factor as rope.scaling.attn_factor; they become transformers' longrope
    rope_parameters (positional.RopeScaling says when each set applies).
    """

    name = "phi3"
    keys = LLAMA_SHAPED_KEYS + (
        "rope.scaling.original_context_length",
        "rope.scaling.attn_factor",
        "attention.sliding_window",
    )
    factor_tensors = ("rope_factors_short.weight", "rope_factors_long.weight")

    def config(self, file: GGUFFile) -> dict:
        key = "phi3."
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
        original = file.value(
            key + "rope.scaling.original_context_length", int, hf["max_position_embeddings"]
        )
        hf["rope_parameters"].update(self.longrope(file, rotary, original))
        return {
            "architectures": ["Phi3ForCausalLM"],
            "model_type": "phi3",
            **hf,
            "original_max_position_embeddings": original,
            "sliding_window": None,
        }

    def longrope(self, file: GGUFFile, rotary: int, original: int) -> dict:
        """The longrope rope_parameters of a file with rope_factors_short/long, else {}."""
        found = [name for name in self.factor_tensors if name in file.tensors]
        if not found:
            if "phi3.rope.scaling.attn_factor" in file.metadata:
                raise GGUFError(
                    f"{file.path}: phi3.rope.scaling.attn_factor without the LongRoPE factor tensors "
                    f"{self.factor_tensors}"
                )
            return {}
        if len(found) == 1:
            raise GGUFError(
                f"{file.path}: tensor {found[0]!r} without its pair (LongRoPE needs both of "
                f"{self.factor_tensors})"
            )
        factors = {}
        for name, field in zip(self.factor_tensors, ("short_factor", "long_factor"), strict=True):
            raw = file.tensors[name]
            if raw.shape != (rotary // 2,):
                raise GGUFError(
                    f"{file.path}: tensor {name!r} has shape {raw.shape}; phi3.rope.dimension_count={rotary} "
                    f"implies ({rotary // 2},), one factor per rotated channel pair"
                )
            factors[field] = raw.to_float().tolist()
        return {
            "rope_type": "longrope",
            **factors,
            "original_max_position_embeddings": original,
            # absent: 1, as llama.cpp reads it
            "attention_factor": float(file.value("phi3.rope.scaling.attn_factor", (int, float), 1.0)),
        }

    def tensors(self, hf: dict) -> list[TensorSpec]:
        d, ff = hf["hidden_size"], hf["intermediate_size"]
        head_dim = d // hf["num_attention_heads"]
        qkv_rows = (hf["num_attention_heads"] + 2 * hf["num_key_value_heads"]) * head_dim
        specs = embedding_and_head_specs(hf)
        rotary = int(head_dim * hf["rope_parameters"]["partial_rotary_factor"])
        # read into the config (its longrope rope_parameters), not weights
        specs += [TensorSpec(name, None, (rotary // 2,), optional=True) for name in self.factor_tensors]
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
