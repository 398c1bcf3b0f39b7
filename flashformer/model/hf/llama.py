"""LLaMA: grouped KV heads, rope_theta, rope_scaling (linear, llama3, yarn, longrope)."""

from __future__ import annotations

from flashformer.model.config import ModelConfig
from flashformer.model.hf.mapping import (
    ACTIVATION_TO_HF,
    Family,
    Rule,
    activation_from_hf,
    fused,
    is_tied,
    linear,
    norm,
    plain_layers,
    require,
    strip,
)
from flashformer.model.positional import RopeScaling


def rope_fraction(hf: dict) -> float:
    """partial_rotary_factor, in rope_parameters (transformers 5) or at the top (older files)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    return 1.0 if partial is None else float(partial)


def rope_from_hf(hf: dict, max_seq_len: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) of a config.json: default, linear or Llama 3.1's rule."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(rope["factor"]))
    if rope_type == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(rope["factor"]),
            float(rope["low_freq_factor"]),
            float(rope["high_freq_factor"]),
            int(rope.get("original_max_position_embeddings", max_seq_len)),
        )
    if rope_type == "yarn":
        for key in ("mscale", "mscale_all_dim"):  # DeepSeek's variant of the attention factor
            if rope.get(key):
                raise ValueError(
                    f"config.json: YaRN's {key}={rope[key]!r} is not supported (supported: absent)"
                )
        attention_factor = rope.get("attention_factor")
        return theta, RopeScaling(
            "yarn",
            float(rope["factor"]),
            original_max_seq_len=int(rope["original_max_position_embeddings"]),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            truncate=bool(rope.get("truncate", True)),
            attention_factor=None if attention_factor is None else float(attention_factor),
        )
    if rope_type == "longrope":
        return theta, longrope_from_hf(hf, rope, max_seq_len)
    raise ValueError(
        f"config.json: rope type {rope_type!r} is not supported (supported: 'default', 'linear', 'llama3', "
        f"'yarn', 'longrope')"
    )


def longrope_from_hf(hf: dict, rope: dict, max_seq_len: int) -> RopeScaling:
    """LongRoPE's factors, original context (Phi-3 keeps it at the top of config.json, and
    transformers prefers that one) and factor (absent: context / original context, as
    transformers derives it)."""
    for key in ("short_factor", "long_factor"):
        if not isinstance(rope.get(key), list):
            raise ValueError(
                f"config.json: LongRoPE needs rope_parameters.{key}, a list; got {rope.get(key)!r}"
            )
    original = hf.get("original_max_position_embeddings", rope.get("original_max_position_embeddings"))
    if not isinstance(original, int) or original < 1:
        raise ValueError(
            f"config.json: LongRoPE needs original_max_position_embeddings >= 1; got {original!r}"
        )
    factor = rope.get("factor")
    attention_factor = rope.get("attention_factor")
    return RopeScaling(
        "longrope",
        float(max_seq_len / original if factor is None else factor),
        original_max_seq_len=original,
        attention_factor=None if attention_factor is None else float(attention_factor),
        short_factor=tuple(rope["short_factor"]),
        long_factor=tuple(rope["long_factor"]),
    )


def rope_to_hf(config: ModelConfig) -> dict:
    """rope_parameters for our RoPE settings (the inverse of rope_from_hf)."""
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    scaling = config.rope_scaling
    if scaling is not None and scaling.kind == "linear":
        rope.update(rope_type="linear", factor=scaling.factor)
    elif scaling is not None and scaling.kind == "yarn":
        rope.update(
            rope_type="yarn",
            factor=scaling.factor,
            original_max_position_embeddings=scaling.original_max_seq_len,
            beta_fast=scaling.beta_fast,
            beta_slow=scaling.beta_slow,
            truncate=scaling.truncate,
        )
        if scaling.attention_factor is not None:
            rope["attention_factor"] = scaling.attention_factor
    elif scaling is not None and scaling.kind == "longrope":
        rope.update(
            rope_type="longrope",
            factor=scaling.factor,
            original_max_position_embeddings=scaling.original_max_seq_len,
            short_factor=list(scaling.short_factor),
            long_factor=list(scaling.long_factor),
        )
        if scaling.attention_factor is not None:
            rope["attention_factor"] = scaling.attention_factor
    elif scaling is not None:
        rope.update(
            rope_type="llama3",
            factor=scaling.factor,
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_seq_len,
        )
    return rope


def decoder_config(hf: dict, weights: dict, family: str, **fields) -> ModelConfig:
    """Our config of a LLaMA-shaped config.json (RMSNorm, gated SiLU MLP, RoPE, GQA), the
    fields where a family differs (biases, rotary fraction) given by the caller."""
    max_seq_len = hf.get("max_position_embeddings", 2048)
    theta, scaling = rope_from_hf(hf, max_seq_len)
    n_heads = hf.get("num_attention_heads", 32)
    d_model = hf.get("hidden_size", 4096)
    values = dict(
        arch="decoder",
        vocab_size=hf.get("vocab_size", 32000),
        d_model=d_model,
        n_layers=hf.get("num_hidden_layers", 32),
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or d_model // n_heads,
        d_ff=hf.get("intermediate_size", 11008),
        max_seq_len=max_seq_len,
        position="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        prenorm=True,
        activation=activation_from_hf(hf, "hidden_act", "silu"),
        gated_ffn=True,
        tie_word_embeddings=is_tied(weights, "lm_head.weight", "embed_tokens.weight", hf, False),
        dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        bos_token_id=hf.get("bos_token_id", 1),
        eos_token_id=hf.get("eos_token_id", 2),
        pad_token_id=hf.get("pad_token_id"),
        hf_model_type=family,
    )
    return ModelConfig(**dict(values, **fields))


def decoder_to_hf(config: ModelConfig, family: str) -> dict:
    """The config.json keys a LLaMA-shaped family shares; raises for what none of them express."""
    require(
        config,
        family,
        arch="decoder",
        position="rope",
        norm="rmsnorm",
        prenorm=True,
        embedding_norm=False,
        gated_ffn=True,
        attention_scale=None,
        type_vocab_size=0,
        dropout=0.0,
    )
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": ACTIVATION_TO_HF[config.activation],
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": rope_to_hf(config),
        "attention_dropout": config.attention_dropout,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
    }


class Llama(Family):
    model_type = "llama"
    ignored = (r"^layers\.\d+\.self_attn\.rotary_emb\.inv_freq$",)  # a buffer of old files

    def strip_prefix(self, weights):
        return strip(weights, "model.")

    def add_prefix(self, weights, config):
        return {(name if name.startswith("lm_head.") else "model." + name): t for name, t in weights.items()}

    def config_from_hf(self, hf, weights):
        partial = rope_fraction(hf)
        if partial != 1.0:
            raise ValueError(
                f"config.json: partial_rotary_factor={partial} is not supported for llama models"
            )
        return decoder_config(
            hf,
            weights,
            "llama",
            attention_bias=bool(hf.get("attention_bias", False)),
            ffn_bias=bool(hf.get("mlp_bias", False)),
        )

    def config_to_hf(self, config):
        plain_layers(config, "llama")
        require(
            config,
            "llama",
            rotary_fraction=1.0,
            fused_gate_up=False,
            attention_out_bias=config.attention_bias,  # llama's attention_bias covers q, k, v and o
        )
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **decoder_to_hf(config, "llama"),
            "attention_bias": config.attention_bias,
            "mlp_bias": config.ffn_bias,
        }

    def rules(self, config):
        rules = [Rule("embeddings.tokens.weight", ("embed_tokens.weight",))]
        for i in range(config.n_layers):
            ours, theirs = f"decoder.blocks.{i}", f"layers.{i}"
            attention = f"{theirs}.self_attn"
            rules += [
                *norm(f"{ours}.attn_norm", f"{theirs}.input_layernorm", bias=False),
                *fused(f"{ours}.attn.qkv", [f"{attention}.{p}_proj" for p in "qkv"], config.attention_bias),
                *linear(f"{ours}.attn.out", f"{attention}.o_proj", config.attention_out_bias),
                *norm(f"{ours}.ffn_norm", f"{theirs}.post_attention_layernorm", bias=False),
                *self.feed_forward_rules(config, f"{ours}.ffn", f"{theirs}.mlp"),
            ]
        rules += norm("decoder.final_norm", "norm", bias=False)
        if not config.tie_word_embeddings:
            rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
        return rules

    def feed_forward_rules(self, config: ModelConfig, ours: str, theirs: str) -> list[Rule]:
        """One layer's feed-forward (ours: decoder.blocks.{i}.ffn, theirs: layers.{i}.mlp)."""
        return [
            *linear(f"{ours}.gate", f"{theirs}.gate_proj", config.ffn_bias),
            *linear(f"{ours}.up", f"{theirs}.up_proj", config.ffn_bias),
            *linear(f"{ours}.down", f"{theirs}.down_proj", config.ffn_bias),
        ]

    def tied_aliases(self, config):
        return {"lm_head.weight": "embed_tokens.weight"}
