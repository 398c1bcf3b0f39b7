"""SmolLM3: LLaMA's layout (separate q/k/v and gate/up projections, GQA, no biases, tied
embeddings) where some layers rotate nothing (NoPE). config.json's `no_rope_layers` says per
layer 1 (RoPE) or 0 (none); without it transformers makes every `no_rope_layer_interval`-th layer
(4: layers 3, 7, 11, ...) a NoPE layer, as llama.cpp's smollm3 always does.

Refused by name: `use_sliding_window` (transformers would window the NoPE layers; SmolLM3-3B
ships with it off and llama.cpp has no window for smollm3).
"""

from __future__ import annotations

from flashformer.model.hf.llama import Llama
from flashformer.model.hf.mapping import plain_layers, refuse

DEFAULT_THETA = 2_000_000.0  # transformers' SmolLM3Config.default_theta


def nope_layers_from_hf(hf: dict) -> tuple[int, ...]:
    """The indices of the NoPE layers of a smollm3 config.json, as transformers' config derives them."""
    n_layers = hf.get("num_hidden_layers", 36)
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = hf.get("no_rope_layer_interval", 4)
        if not isinstance(interval, int) or interval < 1:
            raise ValueError(f"config.json: no_rope_layer_interval must be an int >= 1; got {interval!r}")
        flags = [int((i + 1) % interval != 0) for i in range(n_layers)]
    if len(flags) < n_layers or any(f not in (0, 1) for f in flags):
        raise ValueError(
            f"config.json: no_rope_layers must give 1 (RoPE) or 0 (NoPE) for each of the "
            f"num_hidden_layers={n_layers} layers; got {flags!r}"
        )
    return tuple(i for i in range(n_layers) if flags[i] == 0)


class SmolLM3(Llama):
    model_type = "smollm3"

    def config_from_hf(self, hf, weights):
        refuse(hf, "smollm3", use_sliding_window=(False,))
        hf = {"rope_theta": DEFAULT_THETA, "vocab_size": 128256, "tie_word_embeddings": True, **hf}
        config = super().config_from_hf(hf, weights)
        return config.replace(nope_layers=nope_layers_from_hf(hf), hf_model_type="smollm3")

    def config_to_hf(self, config):
        plain_layers(config, "smollm3", nope_layers=config.nope_layers)
        hf = super().config_to_hf(config.replace(nope_layers=(), hf_model_type="llama"))
        nope = set(config.nope_layers)
        return {
            **hf,
            "architectures": ["SmolLM3ForCausalLM"],
            "model_type": "smollm3",
            "no_rope_layers": [int(i not in nope) for i in range(config.n_layers)],
            "use_sliding_window": False,
        }
