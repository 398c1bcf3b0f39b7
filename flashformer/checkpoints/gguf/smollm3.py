"""smollm3: SmolLM3, read and written. LLaMA's tensors (q and k rows reordered for ggml's
interleaved RoPE, as llama.cpp's converter writes every LLaMA-derived file) with every fourth
layer rotating nothing: the file cannot say which, llama.cpp's smollm3 fixes the step at 4
(layers 3, 7, 11, ...), and so the config read here says no_rope_layer_interval=4."""

from __future__ import annotations

from flashformer.checkpoints.gguf.common import (
    LLAMA_SHAPED_KEYS,
    ROPE_SCALING_KEYS,
    TensorSpec,
    linear_rope_scaling,
    llama_shaped_config,
    llama_shaped_summary,
    llama_shaped_tensors,
    refuse_unread_keys,
)
from flashformer.checkpoints.gguf.llama import LlamaWriter
from flashformer.checkpoints.gguf.reader import GGUFError, GGUFFile

NO_ROPE_LAYER_STEP = 4  # llama.cpp's smollm3: n_no_rope_layer_step


class SmolLM3:
    name = "smollm3"
    keys = LLAMA_SHAPED_KEYS + ROPE_SCALING_KEYS

    def config(self, file: GGUFFile) -> dict:
        refuse_unread_keys(file, "smollm3", self.keys)
        hf = llama_shaped_config(file, "smollm3")
        hf["rope_parameters"].update(linear_rope_scaling(file, "smollm3") or {})
        for name in ("blk.0.attn_q.bias", "blk.0.ffn_up.bias"):
            if name in file.tensors:
                raise GGUFError(f"{file.path}: tensor {name!r}: smollm3 has no biases")
        n_layers = hf["num_hidden_layers"]
        return {
            "architectures": ["SmolLM3ForCausalLM"],
            "model_type": "smollm3",
            **hf,
            "no_rope_layers": [int((i + 1) % NO_ROPE_LAYER_STEP != 0) for i in range(n_layers)],
            "use_sliding_window": False,
        }

    def tensors(self, hf: dict) -> list[TensorSpec]:
        return llama_shaped_tensors(hf, True)

    def summary(self, hf: dict) -> str:
        return llama_shaped_summary(hf)


class SmolLM3Writer(LlamaWriter):
    """transformers' smollm3 as GGUF "smollm3" (what llama.cpp reads back: NoPE every fourth layer,
    so a model whose NoPE layers differ is refused)."""

    model_type = "smollm3"
    architecture = "smollm3"
    scalings = ("default", "linear")

    def metadata(self, hf: dict) -> dict:
        n_layers = hf["num_hidden_layers"]
        expected = [int((i + 1) % NO_ROPE_LAYER_STEP != 0) for i in range(n_layers)]
        if list(hf.get("no_rope_layers", expected))[:n_layers] != expected:
            raise ValueError(
                f"config.json: no_rope_layers={hf['no_rope_layers']!r} cannot be written to GGUF smollm3 "
                f"(llama.cpp rotates nothing in every fourth layer exactly: {expected})"
            )
        return super().metadata(hf)
