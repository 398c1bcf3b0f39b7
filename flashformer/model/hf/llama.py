"""LLaMA: grouped KV heads, rope_theta, rope_scaling (linear, llama3)."""

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


class Llama(Family):
    model_type = "llama"
    ignored = (r"^layers\.\d+\.self_attn\.rotary_emb\.inv_freq$",)  # a buffer of old files

    def strip_prefix(self, weights):
        return strip(weights, "model.")

    def add_prefix(self, weights, config):
        return {(name if name.startswith("lm_head.") else "model." + name): t for name, t in weights.items()}

    def config_from_hf(self, hf, weights):
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        max_seq_len = hf.get("max_position_embeddings", 2048)
        if rope_type == "default":
            scaling = None
        elif rope_type == "linear":
            scaling = RopeScaling("linear", float(rope["factor"]))
        elif rope_type == "llama3":
            scaling = RopeScaling(
                "llama3",
                float(rope["factor"]),
                float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]),
                int(rope.get("original_max_position_embeddings", max_seq_len)),
            )
        else:
            raise ValueError(
                f"config.json: rope type {rope_type!r} is not supported (supported: 'default', 'linear', 'llama3')"
            )
        partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
        if partial not in (None, 1, 1.0):
            raise ValueError(
                f"config.json: partial_rotary_factor={partial} is not supported for llama models"
            )
        n_heads = hf.get("num_attention_heads", 32)
        d_model = hf.get("hidden_size", 4096)
        return ModelConfig(
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
            rope_theta=float(theta),
            rope_scaling=scaling,
            norm="rmsnorm",
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            prenorm=True,
            activation=activation_from_hf(hf, "hidden_act", "silu"),
            gated_ffn=True,
            attention_bias=bool(hf.get("attention_bias", False)),
            ffn_bias=bool(hf.get("mlp_bias", False)),
            tie_word_embeddings=is_tied(weights, "lm_head.weight", "embed_tokens.weight", hf, False),
            dropout=0.0,
            attention_dropout=float(hf.get("attention_dropout", 0.0)),
            bos_token_id=hf.get("bos_token_id", 1),
            eos_token_id=hf.get("eos_token_id", 2),
            pad_token_id=hf.get("pad_token_id"),
            hf_model_type="llama",
        )

    def config_to_hf(self, config):
        plain_layers(config, "llama")
        require(
            config,
            "llama",
            arch="decoder",
            position="rope",
            rotary_fraction=1.0,
            norm="rmsnorm",
            prenorm=True,
            embedding_norm=False,
            gated_ffn=True,
            attention_scale=None,
            type_vocab_size=0,
            dropout=0.0,
        )
        rope = {"rope_type": "default", "rope_theta": config.rope_theta}
        scaling = config.rope_scaling
        if scaling is not None and scaling.kind == "linear":
            rope.update(rope_type="linear", factor=scaling.factor)
        elif scaling is not None:
            rope.update(
                rope_type="llama3",
                factor=scaling.factor,
                low_freq_factor=scaling.low_freq_factor,
                high_freq_factor=scaling.high_freq_factor,
                original_max_position_embeddings=scaling.original_max_seq_len,
            )
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
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
            "rope_parameters": rope,
            "attention_bias": config.attention_bias,
            "mlp_bias": config.ffn_bias,
            "attention_dropout": config.attention_dropout,
            "tie_word_embeddings": config.tie_word_embeddings,
            "bos_token_id": config.bos_token_id,
            "eos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id,
        }

    def rules(self, config):
        rules = [Rule("embeddings.tokens.weight", ("embed_tokens.weight",))]
        for i in range(config.n_layers):
            ours, theirs = f"decoder.blocks.{i}", f"layers.{i}"
            attention = f"{theirs}.self_attn"
            rules += [
                *norm(f"{ours}.attn_norm", f"{theirs}.input_layernorm", bias=False),
                *fused(f"{ours}.attn.qkv", [f"{attention}.{p}_proj" for p in "qkv"], config.attention_bias),
                *linear(f"{ours}.attn.out", f"{attention}.o_proj", config.attention_bias),
                *norm(f"{ours}.ffn_norm", f"{theirs}.post_attention_layernorm", bias=False),
                *linear(f"{ours}.ffn.gate", f"{theirs}.mlp.gate_proj", config.ffn_bias),
                *linear(f"{ours}.ffn.up", f"{theirs}.mlp.up_proj", config.ffn_bias),
                *linear(f"{ours}.ffn.down", f"{theirs}.mlp.down_proj", config.ffn_bias),
            ]
        rules += norm("decoder.final_norm", "norm", bias=False)
        if not config.tie_word_embeddings:
            rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
        return rules

    def tied_aliases(self, config):
        return {"lm_head.weight": "embed_tokens.weight"}
