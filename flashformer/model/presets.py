"""The presets: named ModelConfigs (plain dictionaries of its fields) and `preset()`.

config = preset("gpt2", n_layers=6)          # a preset with fields overridden
"""

from __future__ import annotations

import dataclasses

from flashformer.model.config import ModelConfig

_BERT = dict(
    arch="encoder",
    vocab_size=30522,
    max_seq_len=512,
    position="learned",
    norm="layernorm",
    norm_eps=1e-12,
    prenorm=False,
    embedding_norm=True,
    activation="gelu",
    type_vocab_size=2,
    mlm_head=True,
    pooler=True,
    pad_token_id=0,
    hf_model_type="bert",
)
_GPT2 = dict(
    arch="decoder",
    vocab_size=50257,
    max_seq_len=1024,
    position="learned",
    norm="layernorm",
    norm_eps=1e-5,
    activation="gelu_tanh",
    bos_token_id=50256,
    eos_token_id=50256,
    hf_model_type="gpt2",
)
_T5 = dict(
    arch="encoder-decoder",
    vocab_size=32128,
    position="relative",
    max_seq_len=512,
    norm="rmsnorm",
    norm_eps=1e-6,
    activation="relu",
    attention_bias=False,
    ffn_bias=False,
    attention_scale=1.0,
    tie_word_embeddings=True,
    scale_decoder_output=True,
    activation_dropout=0.1,
    dropout_after_final_norm=True,
    pad_token_id=0,
    eos_token_id=1,
    decoder_start_token_id=0,
    hf_model_type="t5",
)
_LLAMA = dict(
    arch="decoder",
    vocab_size=32000,
    max_seq_len=2048,
    position="rope",
    rope_theta=10000.0,
    norm="rmsnorm",
    norm_eps=1e-5,
    activation="silu",
    gated_ffn=True,
    attention_bias=False,
    ffn_bias=False,
    tie_word_embeddings=False,
    dropout=0.0,
    attention_dropout=0.0,
    bos_token_id=1,
    eos_token_id=2,
    hf_model_type="llama",
)
# recurrent language models: no positions (the recurrence orders the tokens), no attention
_RECURRENT = dict(
    n_heads=1,  # not read: no attention (n_heads only has to divide d_model)
    vocab_size=2048,
    max_seq_len=256,
    position="none",
    dropout=0.0,
    attention_dropout=0.0,
    tie_word_embeddings=True,
)
_TINY = dict(d_model=64, n_layers=2, n_heads=4, d_ff=128, vocab_size=1000, max_seq_len=128)

PRESETS: dict[str, dict] = {
    "bert-base": dict(_BERT, d_model=768, n_layers=12, n_heads=12, d_ff=3072),
    "gpt2": dict(_GPT2, d_model=768, n_layers=12, n_heads=12, d_ff=3072),
    "t5-small": dict(_T5, d_model=512, n_layers=6, n_heads=8, head_dim=64, d_ff=2048),
    # about 110M parameters: GPT-2-small's width with LLaMA's design (GQA 12/4, SwiGLU, RoPE, RMSNorm)
    "llama-small": dict(_LLAMA, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, d_ff=2048),
    # the default of `flashformer train`: a GPT-2-style model small enough to
    # learn Python's stdlib visibly in a few minutes on two CPU cores
    "gpt-mini": dict(
        _GPT2,
        d_model=192,
        n_layers=4,
        n_heads=4,
        d_ff=768,
        max_seq_len=256,
        vocab_size=2048,
        dropout=0.0,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,
    ),
    "bert-tiny": dict(_BERT, **_TINY),
    "gpt2-tiny": dict(_GPT2, **_TINY),
    "t5-tiny": dict(_T5, **dict(_TINY, head_dim=16)),
    "llama-tiny": dict(_LLAMA, **dict(_TINY, n_kv_heads=2, d_ff=96)),
    # the alternatives of docs/alternatives.md, gpt-mini's vocabulary and training defaults
    "lstm-mini": dict(_RECURRENT, arch="lstm", d_model=256, n_layers=2),
    "gru-mini": dict(_RECURRENT, arch="gru", d_model=288, n_layers=2),
    "mamba-mini": dict(_RECURRENT, arch="ssm", d_model=192, n_layers=6, norm="rmsnorm"),
    "lstm-tiny": dict(_RECURRENT, **dict(_TINY, arch="lstm")),
    "gru-tiny": dict(_RECURRENT, **dict(_TINY, arch="gru")),
    "mamba-tiny": dict(_RECURRENT, **dict(_TINY, arch="ssm", norm="rmsnorm", ssm_state=8)),
}


def preset(name: str, **overrides) -> ModelConfig:
    """The ModelConfig of a preset, with any fields overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    known = {f.name for f in dataclasses.fields(ModelConfig) if f.init}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown ModelConfig fields: {unknown}")
    return ModelConfig(**dict(PRESETS[name], **overrides))
