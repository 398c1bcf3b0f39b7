"""qwen2: Qwen2 and Qwen2.5, LLaMA's blocks with q/k/v biases, read and written."""

from __future__ import annotations

from flashformer.checkpoints.gguf.common import (
    LLAMA_SHAPED_KEYS,
    TensorSpec,
    llama_shaped_config,
    llama_shaped_summary,
    llama_shaped_tensors,
    refuse_unread_keys,
    require_config_value,
)
from flashformer.checkpoints.gguf.llama import LlamaWriter
from flashformer.checkpoints.gguf.reader import GGUFFile


class Qwen2:
    """Qwen2 and Qwen2.5: LLaMA's blocks with biases on q, k and v, none on the output. ggml
    rotates these in the rotate-half ("NEOX") layout, as transformers does, so the q/k rows
    are stored as transformers has them: no permutation to undo."""

    name = "qwen2"
    keys = LLAMA_SHAPED_KEYS

    def config(self, file: GGUFFile) -> dict:
        refuse_unread_keys(file, "qwen2", self.keys)
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            **llama_shaped_config(file, "qwen2"),
            "use_sliding_window": False,
        }

    def tensors(self, hf: dict) -> list[TensorSpec]:
        return llama_shaped_tensors(hf, False, qkv_bias=True)

    def summary(self, hf: dict) -> str:
        return llama_shaped_summary(hf)


class Qwen2Writer(LlamaWriter):
    """transformers' qwen2 (Qwen2, Qwen2.5) as GGUF "qwen2": LLaMA's keys, q/k/v biases (the
    reader's table), rotate-half RoPE (rows unpermuted), no RoPE scaling or sliding window."""

    model_type = "qwen2"
    architecture = "qwen2"
    scalings = ("default",)

    def metadata(self, hf: dict) -> dict:
        require_config_value(hf, "use_sliding_window", (False,))
        return super().metadata(hf)
