"""A small decoder of Gemma 3's shape, built from a ModelConfig with random weights: two
sliding-window layers with their own RoPE base, then a full one; q/k norms, sandwich norms,
softcaps. The generate and serve tests run it past the window."""

from __future__ import annotations

import torch

import flashformer
from flashformer.model.config import ModelConfig

WINDOW = 4


def sliding_model(**changes) -> flashformer.DecoderModel:
    torch.manual_seed(0)
    fields = dict(
        arch="decoder",
        vocab_size=300,
        d_model=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        d_ff=96,
        max_seq_len=128,
        position="rope",
        rope_theta=1e6,
        rope_local_theta=10000.0,
        norm="rmsnorm",
        activation="gelu_tanh",
        gated_ffn=True,
        attention_bias=False,
        ffn_bias=False,
        qk_norm=True,
        sandwich_norm=True,
        scale_embeddings=True,
        attention_softcap=5.0,
        final_logit_softcap=3.0,
        sliding_window=WINDOW,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
        dropout=0.0,
        attention_dropout=0.0,
    )
    return flashformer.build(ModelConfig(**{**fields, **changes})).eval()
