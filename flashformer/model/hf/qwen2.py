"""Qwen2 / Qwen2.5: LLaMA's layout with biases on q, k and v (none on the output projection).

Its sliding-window layers (`use_sliding_window`, from layer `max_window_layers` on) are not
implemented: a config.json that turns them on for any layer is refused. The released Qwen2 and
Qwen2.5 checkpoints all ship with use_sliding_window false.
"""

from __future__ import annotations

from flashformer.model.hf.llama import Llama, decoder_config, decoder_to_hf, rope_fraction
from flashformer.model.hf.mapping import require


def sliding_layers(hf: dict) -> list[int]:
    """The layers transformers' Qwen2 runs with a sliding window, by its own rule."""
    layers = hf.get("num_hidden_layers", 32)
    types = hf.get("layer_types")
    if types is None:
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
        first = hf.get("max_window_layers", 28)
        types = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(layers)
        ]
    return [i for i, kind in enumerate(types) if kind == "sliding_attention"]


class Qwen2(Llama):
    model_type = "qwen2"

    def config_from_hf(self, hf, weights):
        sliding = sliding_layers(hf)
        if sliding:
            raise ValueError(
                f"config.json: use_sliding_window={hf.get('use_sliding_window')!r} (layer_types "
                f"{hf.get('layer_types')!r}) gives layers {sliding[:4]}... a sliding window, which flashformer's "
                f"qwen2 does not implement (supported: use_sliding_window false, every layer full attention)"
            )
        partial = rope_fraction(hf)
        if partial != 1.0:
            raise ValueError(
                f"config.json: partial_rotary_factor={partial} is not supported for qwen2 models"
            )
        return decoder_config(
            hf,
            weights,
            "qwen2",
            attention_bias=True,
            attention_out_bias=False,
            ffn_bias=False,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            vocab_size=hf.get("vocab_size", 151936),
        )

    def config_to_hf(self, config):
        require(
            config,
            "qwen2",
            rotary_fraction=1.0,
            fused_gate_up=False,
            attention_bias=True,
            attention_out_bias=False,
            ffn_bias=False,
        )
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            **decoder_to_hf(config, "qwen2"),
            "use_sliding_window": False,
        }
