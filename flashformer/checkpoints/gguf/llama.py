"""llama: LLaMA and the models llama.cpp files under it (SmolLM, TinyLlama, Mistral-style GQA,
Llama 3.1/3.2), read and written.

llama.cpp's converter reordered the rows of the q and k projections per head, from transformers'
rotate-half layout to interleaved pairs (what ggml's RoPE reads): the reader puts them back
(rope_permuted tensors, common.rope_row_permutation), the writer reorders them again. Llama 3's
rope scaling was written as per-frequency divisors (rope_freqs.weight): see rope_freqs.py.
"""

from __future__ import annotations

from torch import Tensor

from flashformer.checkpoints.gguf.common import (
    LLAMA_SHAPED_KEYS,
    TensorSpec,
    llama_shaped_config,
    llama_shaped_summary,
    llama_shaped_tensors,
    refuse_unread_keys,
    require_config_value,
)
from flashformer.checkpoints.gguf.reader import GGUFError, GGUFFile
from flashformer.checkpoints.gguf.rope_freqs import llama3_rope_parameters
from flashformer.model.positional import RopeScaling, rope_inverse_frequencies


class Llama:
    """LLaMA and the models llama.cpp files under it: SmolLM, TinyLlama, Mistral-style GQA, and
    Llama 3.1/3.2 with their per-frequency RoPE divisors (`rope_freqs.weight`)."""

    name = "llama"
    keys = LLAMA_SHAPED_KEYS + (
        "rope.scaling.type",
        "rope.scaling.factor",
        "rope.scale_linear",
        # informational beside linear scaling (yarn, which reads them, is refused)
        "rope.scaling.original_context_length",
        "rope.scaling.finetuned",
        "tensor_data_layout",  # older files: "Meta AI original pth", the same interleaved q/k rows
    )

    def config(self, file: GGUFFile) -> dict:
        key = "llama."
        refuse_unread_keys(file, "llama", self.keys)
        hf = llama_shaped_config(file, "llama")
        layout = file.value(key + "tensor_data_layout", str, "Meta AI original pth")
        if layout != "Meta AI original pth":
            raise GGUFError(
                f"{file.path}: llama.tensor_data_layout={layout!r} is not supported ('Meta AI original pth')"
            )
        rope = hf["rope_parameters"]
        scaling = file.value(key + "rope.scaling.type", str, "none")
        factor = file.value(key + "rope.scaling.factor", (int, float), None)
        if scaling == "none" and key + "rope.scale_linear" in file.metadata:  # older files
            scaling, factor = "linear", file.value(key + "rope.scale_linear", (int, float))
        if scaling == "linear" and factor not in (None, 1, 1.0):
            rope.update(rope_type="linear", factor=float(factor))
        elif scaling not in ("none", "linear"):
            raise GGUFError(
                f"{file.path}: llama.rope.scaling.type={scaling!r} is not supported ('none', 'linear')"
            )
        if "rope_freqs.weight" in file.tensors:
            raw = file.tensors["rope_freqs.weight"]
            if raw.shape != (hf["head_dim"] // 2,):
                raise GGUFError(
                    f"{file.path}: tensor 'rope_freqs.weight' has shape {raw.shape}; the metadata implies "
                    f"({hf['head_dim'] // 2},), one divisor per RoPE channel pair"
                )
            if rope["rope_type"] != "default":
                raise GGUFError(
                    f"{file.path}: tensor 'rope_freqs.weight' together with llama.rope.scaling.type="
                    f"{scaling!r} is not supported (one RoPE scaling at a time)"
                )
            llama3 = llama3_rope_parameters(raw.to_float(), hf["head_dim"], hf["rope_theta"], str(file.path))
            rope.update(llama3 or {})
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **hf,
            "attention_bias": "blk.0.attn_q.bias" in file.tensors,
            "mlp_bias": "blk.0.ffn_up.bias" in file.tensors,
        }

    def tensors(self, hf: dict) -> list[TensorSpec]:
        bias = hf["attention_bias"]
        specs = llama_shaped_tensors(hf, True, qkv_bias=bias, out_bias=bias, mlp_bias=hf["mlp_bias"])
        # read into the config (the llama3 rope parameters, or none for divisors of 1), not a weight
        return specs + [TensorSpec("rope_freqs.weight", None, (hf["head_dim"] // 2,), optional=True)]

    def summary(self, hf: dict) -> str:
        return llama_shaped_summary(hf)


class LlamaWriter:
    """transformers' llama as GGUF "llama" (SmolLM, TinyLlama, Mistral-style GQA, Llama 3.x)."""

    model_type = "llama"
    architecture = "llama"
    scalings = ("default", "linear", "llama3")

    def metadata(self, hf: dict) -> dict:
        key = self.architecture + "."
        require_config_value(hf, "hidden_act", ("silu",))
        rope = self.rope(hf)
        values = {
            key + "vocab_size": hf["vocab_size"],
            key + "context_length": hf["max_position_embeddings"],
            key + "embedding_length": hf["hidden_size"],
            key + "block_count": hf["num_hidden_layers"],
            key + "feed_forward_length": hf["intermediate_size"],
            key + "attention.head_count": hf["num_attention_heads"],
            key + "attention.head_count_kv": hf["num_key_value_heads"],
            key + "attention.layer_norm_rms_epsilon": float(hf["rms_norm_eps"]),
            key + "rope.freq_base": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            key + "rope.dimension_count": hf["head_dim"],
        }
        if hf["head_dim"] * hf["num_attention_heads"] != hf["hidden_size"]:
            values[key + "attention.key_length"] = values[key + "attention.value_length"] = hf["head_dim"]
        if rope["rope_type"] == "linear":
            values[key + "rope.scaling.type"] = "linear"
            values[key + "rope.scaling.factor"] = float(rope["factor"])
        return values  # llama3 scaling is the tensor rope_freqs.weight (extra_tensor)

    def rope(self, hf: dict) -> dict:
        rope = dict(hf.get("rope_parameters") or {"rope_type": "default"})
        if rope["rope_type"] not in self.scalings:
            raise ValueError(
                f"config.json: rope type {rope['rope_type']!r} cannot be written to GGUF {self.architecture} "
                f"(supported: {', '.join(map(repr, self.scalings))})"
            )
        return rope

    def extra_tensor(self, spec: TensorSpec, hf: dict) -> Tensor | None:
        """A tensor not among transformers' weights: Llama 3.1's RoPE scaling as llama.cpp's
        converter stores it, one divisor per channel pair (None: the file goes without it)."""
        rope = self.rope(hf)
        if spec.gguf != "rope_freqs.weight" or rope["rope_type"] != "llama3":
            return None
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        scaling = RopeScaling(
            "llama3",
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope.get("original_max_position_embeddings", hf["max_position_embeddings"])),
        )
        plain = rope_inverse_frequencies(hf["head_dim"], theta).double()
        return (plain / rope_inverse_frequencies(hf["head_dim"], theta, scaling).double()).float()
