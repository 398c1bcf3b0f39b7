"""gemma, gemma2, gemma3: the GGUF metadata of Google's Gemma models in transformers' terms.

What the file holds differently from transformers (llama.cpp's converter):
- every RMSNorm weight is stored as 1 + w (transformers keeps w and computes x * (1 + w)):
  read back as w, as transformers' GGUF loader does, for model.hf.gemma to load;
- q and k rows are not permuted (Gemma's RoPE is the half-split layout transformers uses).

What the metadata leaves implicit, taken from llama.cpp's loader (src/llama-model.cpp):
- the attention scale is 1/sqrt(head_dim), except for the 27B models (gemma2 with 46
  layers, gemma3 with 62) where it is 1/sqrt(d_model / heads);
- gemma2: a sliding window of 4096 where the key is absent, on every other layer (0, 2, ...);
  attention and final-logit softcaps of 50 and 30 where their keys are absent;
- gemma3: sliding layers in a pattern of 6 (five sliding, then one full) unless
  attention.sliding_window_pattern says otherwise (a period, or one flag per layer);
  the sliding layers' RoPE base is 10,000 (rope.freq_base_swa where given) without scaling,
  the full layers' is rope.freq_base, with the file's linear scaling.
"""

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
from flashformer.checkpoints.gguf.reader import GGUFError, GGUFFile

# llama.cpp's 27B types, whose attention scale uses d_model / heads instead of head_dim
LAYERS_OF_27B = {"gemma2": 46, "gemma3": 62}
# the keys each version reads beside the LLaMA-shaped ones; any other is refused by name
KEYS = {
    1: (),
    2: ("attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping"),
    3: (
        "attention.sliding_window",
        "attention.sliding_window_pattern",
        "rope.freq_base_swa",
        *ROPE_SCALING_KEYS,
    ),
}


class Gemma:
    """One of gemma (version 1), gemma2 (2), gemma3 (3); see the module docstring."""

    def __init__(self, name: str, version: int):
        self.name, self.version = name, version

    def config(self, file: GGUFFile) -> dict:
        arch, key = self.name, self.name + "."
        refuse_unread_keys(file, arch, LLAMA_SHAPED_KEYS + KEYS[self.version])
        shape = llama_shaped_config(file, arch)  # the sizes and their checks; gemma's own keys below
        n_layers = shape["num_hidden_layers"]
        hf = {
            "architectures": [
                {1: "GemmaForCausalLM", 2: "Gemma2ForCausalLM", 3: "Gemma3ForCausalLM"}[self.version]
            ],
            "model_type": {1: "gemma", 2: "gemma2", 3: "gemma3_text"}[self.version],
            **{k: v for k, v in shape.items() if k not in ("hidden_act", "rope_theta", "rope_parameters")},
            ("hidden_act" if self.version == 1 else "hidden_activation"): "gelu_pytorch_tanh",
            "attention_bias": False,
        }
        if self.version == 1:
            theta = float(file.value(key + "rope.freq_base", (int, float), 10000.0))
            return {**hf, "rope_parameters": self._full_rope(file, theta)}
        scalar = hf["head_dim"]
        if n_layers == LAYERS_OF_27B[arch]:
            scalar = hf["hidden_size"] // hf["num_attention_heads"]
        hf.update(query_pre_attn_scalar=scalar, layer_types=self._layer_types(file, n_layers))
        if self.version == 2:
            theta = float(file.value(key + "rope.freq_base", (int, float), 10000.0))
            return {
                **hf,
                "rope_parameters": self._full_rope(file, theta),
                "sliding_window": file.value(key + "attention.sliding_window", int, 4096),
                "attn_logit_softcapping": float(
                    file.value(key + "attn_logit_softcapping", (int, float), 50.0)
                ),
                "final_logit_softcapping": float(
                    file.value(key + "final_logit_softcapping", (int, float), 30.0)
                ),
            }
        local_theta = float(file.value(key + "rope.freq_base_swa", (int, float), 10000.0))
        return {
            **hf,
            "rope_parameters": {
                "full_attention": self._full_rope(
                    file, float(file.value(key + "rope.freq_base", (int, float)))
                ),
                "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
            },
            "sliding_window": file.value(key + "attention.sliding_window", int),
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
        }

    def _full_rope(self, file: GGUFFile, theta: float) -> dict:
        scaling = linear_rope_scaling(file, self.name) if self.version == 3 else None  # others: refused keys
        return {"rope_type": "default", "rope_theta": theta, **(scaling or {})}

    def _layer_types(self, file: GGUFFile, n_layers: int) -> list[str]:
        """Which layers slide: gemma2 every other one from layer 0; gemma3 a period of 6
        (layers 0-4 slide, 5 is full, ...) or the file's attention.sliding_window_pattern."""
        name = f"{self.name}.attention.sliding_window_pattern"
        pattern = file.value(name, (int, list), 2 if self.version == 2 else 6)
        if isinstance(pattern, int):
            if pattern < 1:
                raise GGUFError(f"{file.path}: {name}={pattern}; expected a period >= 1")
            return [
                "sliding_attention" if i % pattern < pattern - 1 else "full_attention"
                for i in range(n_layers)
            ]
        if len(pattern) != n_layers or not all(isinstance(flag, bool) for flag in pattern):
            raise GGUFError(
                f"{file.path}: {name} lists {len(pattern)} values; expected one bool per layer ({n_layers})"
            )
        return ["sliding_attention" if flag else "full_attention" for flag in pattern]

    def tensors(self, hf: dict):
        norms = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
        if self.version >= 2:
            norms = {
                "attn_norm": "input_layernorm",
                "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm",
            }
        if self.version == 3:
            norms.update(attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm")
        return decoder_specs(hf, norms, plus_one=True)

    def summary(self, hf: dict) -> str:
        return summary(hf)
