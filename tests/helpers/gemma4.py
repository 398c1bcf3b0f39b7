"""A small random Gemma 4 text model of transformers' own class, for the gemma4 tests: sliding
and full layers (the full ones' heads 512 wide, past the attention kernels' 256), per-layer
inputs, the last two layers reading the keys and values of earlier ones with double-wide
feed-forwards, a final-logit softcap small enough to bend the logits, and every weight, norm and
layer scale moved away from its initial value so that no part is an identity."""

from __future__ import annotations

import torch

LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def tiny_gemma4(seed: int = 0, **overrides):
    """transformers' Gemma4ForCausalLM (eager attention, eval mode) with random weights."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    sizes = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=512,
        sliding_window=5,
        layer_types=LAYER_TYPES,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=160,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        final_logit_softcapping=3.0,
        max_position_embeddings=256,
    )
    sizes.update(overrides)
    config = Gemma4TextConfig(**sizes)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:  # Gemma 4 scales by w itself: 0.5..1.5
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0.0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    return model
