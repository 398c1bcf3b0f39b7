"""GPT-2: Conv1D weights stored (in, out) with q, k, v fused in c_attn; old mask buffers; the head tied to wte."""

from __future__ import annotations

from flashformer.model.config import ModelConfig
from flashformer.model.hf.mapping import (
    ACTIVATION_TO_HF,
    Family,
    Rule,
    activation_from_hf,
    is_tied,
    linear,
    norm,
    plain_layers,
    refuse,
    require,
    standard_heads,
    strip,
)


class GPT2(Family):
    model_type = "gpt2"
    ignored = (r"^h\.\d+\.attn\.bias$", r"^h\.\d+\.attn\.masked_bias$")  # causal-mask buffers of old files

    def strip_prefix(self, weights):
        return strip(weights, "transformer.")

    def add_prefix(self, weights, config):
        return {
            (name if name.startswith("lm_head.") else "transformer." + name): t for name, t in weights.items()
        }

    def config_from_hf(self, hf, weights):
        refuse(hf, "gpt2", scale_attn_by_inverse_layer_idx=(False,), add_cross_attention=(False,))
        d_model = hf.get("n_embd", 768)
        return ModelConfig(
            arch="decoder",
            vocab_size=hf.get("vocab_size", 50257),
            d_model=d_model,
            n_layers=hf.get("n_layer", 12),
            n_heads=hf.get("n_head", 12),
            d_ff=hf.get("n_inner") or 4 * d_model,
            max_seq_len=hf.get("n_positions", 1024),
            position="learned",
            norm="layernorm",
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            prenorm=True,
            activation=activation_from_hf(hf, "activation_function", "gelu_new"),
            attention_scale=None if hf.get("scale_attn_weights", True) else 1.0,
            tie_word_embeddings=is_tied(weights, "lm_head.weight", "wte.weight", hf, True),
            dropout=hf.get("resid_pdrop", 0.1),
            attention_dropout=hf.get("attn_pdrop", 0.1),
            bos_token_id=hf.get("bos_token_id", 50256),
            eos_token_id=hf.get("eos_token_id", 50256),
            pad_token_id=hf.get("pad_token_id"),
            hf_model_type="gpt2",
        )

    def config_to_hf(self, config):
        plain_layers(config, "gpt2")
        require(
            config,
            "gpt2",
            arch="decoder",
            position="learned",
            norm="layernorm",
            prenorm=True,
            embedding_norm=False,
            gated_ffn=False,
            attention_bias=True,
            ffn_bias=True,
            type_vocab_size=0,
        )
        standard_heads(config, "gpt2")
        if config.attention_scale not in (None, 1.0):
            raise ValueError(f"ModelConfig.attention_scale={config.attention_scale} cannot be saved as gpt2")
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": config.vocab_size,
            "n_embd": config.d_model,
            "n_layer": config.n_layers,
            "n_head": config.n_heads,
            "n_inner": config.d_ff,
            "n_positions": config.max_seq_len,
            "activation_function": ACTIVATION_TO_HF[config.activation],
            "layer_norm_epsilon": config.norm_eps,
            "scale_attn_weights": config.attention_scale is None,
            "resid_pdrop": config.dropout,
            "embd_pdrop": config.dropout,
            "attn_pdrop": config.attention_dropout,
            "bos_token_id": config.bos_token_id,
            "eos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id,
            "tie_word_embeddings": config.tie_word_embeddings,
        }

    def rules(self, config):
        rules = [
            Rule("embeddings.tokens.weight", ("wte.weight",)),
            Rule("embeddings.positions.weight", ("wpe.weight",)),
        ]
        for i in range(config.n_layers):
            ours, theirs = f"decoder.blocks.{i}", f"h.{i}"
            rules += [
                *norm(f"{ours}.attn_norm", f"{theirs}.ln_1"),
                *linear(f"{ours}.attn.qkv", f"{theirs}.attn.c_attn", kind="t"),  # fused q, k, v, (in, out)
                *linear(f"{ours}.attn.out", f"{theirs}.attn.c_proj", kind="t"),
                *norm(f"{ours}.ffn_norm", f"{theirs}.ln_2"),
                *linear(f"{ours}.ffn.up", f"{theirs}.mlp.c_fc", kind="t"),
                *linear(f"{ours}.ffn.down", f"{theirs}.mlp.c_proj", kind="t"),
            ]
        rules += norm("decoder.final_norm", "ln_f")
        if not config.tie_word_embeddings:
            rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
        return rules

    def tied_aliases(self, config):
        return {"lm_head.weight": "wte.weight"}
