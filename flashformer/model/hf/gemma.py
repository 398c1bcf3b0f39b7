"""Gemma 1, 2 and 3 (text): what they add to LLaMA's layout.

- Every RMSNorm scales by 1 + w and the file stores w (loaded here as w + 1, our plain scale).
- The token embeddings are multiplied by sqrt(d_model) (rounded to their dtype), the head is
  tied, the feed-forward is GeGLU (gelu with tanh, gated), head_dim is its own (256).
- Gemma 2 and 3: a norm on each sub-layer's output as well ("sandwich": input_layernorm,
  post_attention_layernorm around the attention; pre_ and post_feedforward_layernorm around
  the feed-forward), an attention scale of query_pre_attn_scalar^-1/2, and sliding-window
  layers (layer_types) beside full ones: every other layer in Gemma 2, five in six in Gemma 3.
- Gemma 2: attention scores and final logits soft-capped (c * tanh(x / c)).
- Gemma 3: q/k head norms, RoPE base 1e6 (and scaling) on the full layers, 10,000 on the
  sliding ones.
"""

from __future__ import annotations

from flashformer.model.config import ModelConfig
from flashformer.model.hf.mapping import (
    Family,
    Rule,
    activation_from_hf,
    fused,
    is_tied,
    linear,
    offset_norm,
    plain_layers,
    refuse,
    require,
    strip,
)
from flashformer.model.positional import RopeScaling


def _rope(parameters: dict, theta: float, family: str) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of one rope_parameters entry; Gemma ships 'default' and 'linear'."""
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    theta = float(parameters.get("rope_theta", theta))
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(parameters["factor"]))
    raise ValueError(
        f"config.json: rope type {kind!r} is not supported for {family} models ('default', 'linear')"
    )


class Gemma(Family):
    """Gemma 1 (version 1), Gemma 2 (2), Gemma 3's text model (3); see the module docstring."""

    def __init__(self, model_type: str = "gemma", version: int = 1):
        self.model_type, self.version = model_type, version

    def strip_prefix(self, weights):
        return strip(weights, "model.")

    def add_prefix(self, weights, config):
        return {(name if name.startswith("lm_head.") else "model." + name): t for name, t in weights.items()}

    def config_from_hf(self, hf, weights):
        family, version = self.model_type, self.version
        refuse(hf, family, use_bidirectional_attention=(False, None), attention_bias=(False,))
        n_layers = hf.get("num_hidden_layers", 26)
        head_dim = hf.get("head_dim", 256)
        theta, scaling = self._positions(hf)
        layer_types = sliding_window = local_theta = None
        if version >= 2:
            pattern = 2 if version == 2 else hf.get("sliding_window_pattern", 6)
            layer_types = hf.get("layer_types") or [
                "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)
            ]
            sliding_window = hf.get("sliding_window", 4096)
        if version == 3:
            parameters = hf.get("rope_parameters") or {}
            local = parameters.get("sliding_attention") or {
                "rope_theta": hf.get("rope_local_base_freq", 10000.0)
            }
            local_theta, local_scaling = _rope(local, 10000.0, family)
            if local_scaling is not None:
                raise ValueError(f"config.json: RoPE scaling on {family}'s sliding layers is not supported")
        softcaps = (50.0, 30.0) if version == 2 else (None, None)
        activation_key = "hidden_act" if version == 1 else "hidden_activation"
        activation = hf.get(activation_key) or hf.get("hidden_act") or "gelu_pytorch_tanh"
        activation = "gelu_pytorch_tanh" if activation == "gelu" else activation  # Gemma 1's legacy value
        return ModelConfig(
            arch="decoder",
            vocab_size=hf.get("vocab_size", 256000),
            d_model=hf.get("hidden_size", 2304),
            n_layers=n_layers,
            n_heads=hf.get("num_attention_heads", 8),
            n_kv_heads=hf.get("num_key_value_heads", 4),
            head_dim=head_dim,
            d_ff=hf.get("intermediate_size", 9216),
            max_seq_len=hf.get("max_position_embeddings", 8192),
            position="rope",
            rope_theta=theta,
            rope_scaling=scaling,
            rope_local_theta=local_theta,
            norm="rmsnorm",
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            activation=activation_from_hf({"act": activation}, "act", "gelu_pytorch_tanh"),
            gated_ffn=True,
            attention_bias=False,
            ffn_bias=False,
            attention_scale=None if version == 1 else float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
            qk_norm=version == 3,
            sandwich_norm=version >= 2,
            attention_softcap=hf.get("attn_logit_softcapping", softcaps[0]),
            final_logit_softcap=hf.get("final_logit_softcapping", softcaps[1]),
            sliding_window=sliding_window,
            layer_types=layer_types,
            tie_word_embeddings=is_tied(weights, "lm_head.weight", "embed_tokens.weight", hf, True),
            scale_embeddings=True,
            dropout=0.0,
            attention_dropout=float(hf.get("attention_dropout", 0.0)),
            bos_token_id=hf.get("bos_token_id", 2),
            eos_token_id=hf.get("eos_token_id", 1),
            pad_token_id=hf.get("pad_token_id", 0),
            hf_model_type=family,
        )

    def _positions(self, hf: dict) -> tuple[float, RopeScaling | None]:
        """The RoPE of the full-attention layers (all layers before Gemma 3)."""
        parameters = dict(hf.get("rope_parameters") or {})
        if self.version == 3:
            parameters = dict(parameters.get("full_attention") or hf.get("rope_scaling") or {})
        return _rope(parameters, hf.get("rope_theta", 1e6 if self.version == 3 else 10000.0), self.model_type)

    def config_to_hf(self, config):
        family, version = self.model_type, self.version
        plain_layers(
            config,
            family,
            qk_norm=version == 3,
            sandwich_norm=version >= 2,
            scale_embeddings=True,
            attention_softcap=config.attention_softcap if version == 2 else None,
            final_logit_softcap=config.final_logit_softcap if version == 2 else None,
            layer_types=config.layer_types if version >= 2 else None,
            rope_local_theta=config.rope_local_theta if version == 3 else None,
        )
        require(
            config,
            family,
            arch="decoder",
            position="rope",
            rotary_fraction=1.0,
            norm="rmsnorm",
            prenorm=True,
            embedding_norm=False,
            gated_ffn=True,
            activation="gelu_tanh",
            attention_bias=False,
            attention_out_bias=False,
            fused_gate_up=False,
            ffn_bias=False,
            type_vocab_size=0,
            dropout=0.0,
            tie_word_embeddings=True,
        )
        if version == 1 and config.attention_scale is not None:
            raise ValueError(
                f"ModelConfig.attention_scale={config.attention_scale} cannot be saved as {family}"
            )
        if config.rope_scaling is not None and (version < 3 or config.rope_scaling.kind != "linear"):
            raise ValueError(f"ModelConfig.rope_scaling={config.rope_scaling} cannot be saved as {family}")
        rope = {"rope_type": "default", "rope_theta": config.rope_theta}
        if config.rope_scaling is not None:
            rope.update(rope_type="linear", factor=config.rope_scaling.factor)
        hf = {
            "architectures": [
                {1: "GemmaForCausalLM", 2: "Gemma2ForCausalLM", 3: "Gemma3ForCausalLM"}[version]
            ],
            "model_type": family,
            "vocab_size": config.vocab_size,
            "hidden_size": config.d_model,
            "intermediate_size": config.d_ff,
            "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads,
            "num_key_value_heads": config.n_kv_heads,
            "head_dim": config.head_dim,
            ("hidden_act" if version == 1 else "hidden_activation"): "gelu_pytorch_tanh",
            "max_position_embeddings": config.max_seq_len,
            "rms_norm_eps": config.norm_eps,
            "rope_parameters": rope,
            "attention_bias": False,
            "attention_dropout": config.attention_dropout,
            "tie_word_embeddings": True,
            "bos_token_id": config.bos_token_id,
            "eos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id,
        }
        if version >= 2:
            scale = config.attention_scale if config.attention_scale is not None else config.head_dim**-0.5
            hf.update(
                query_pre_attn_scalar=round(scale**-2),
                sliding_window=config.sliding_window,
                layer_types=list(config.layer_types or ["full_attention"] * config.n_layers),
                attn_logit_softcapping=config.attention_softcap,
                final_logit_softcapping=config.final_logit_softcap,
            )
        if version == 3:
            local = {"rope_type": "default", "rope_theta": config.rope_local_theta or config.rope_theta}
            hf["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}
        return hf

    def rules(self, config):
        rules = [Rule("embeddings.tokens.weight", ("embed_tokens.weight",))]
        for i in range(config.n_layers):
            ours, theirs = f"decoder.blocks.{i}", f"layers.{i}"
            attention = f"{theirs}.self_attn"
            rules += [
                *offset_norm(f"{ours}.attn_norm", f"{theirs}.input_layernorm"),
                *fused(f"{ours}.attn.qkv", [f"{attention}.{p}_proj" for p in "qkv"], False),
                *linear(f"{ours}.attn.out", f"{attention}.o_proj", False),
                *linear(f"{ours}.ffn.gate", f"{theirs}.mlp.gate_proj", False),
                *linear(f"{ours}.ffn.up", f"{theirs}.mlp.up_proj", False),
                *linear(f"{ours}.ffn.down", f"{theirs}.mlp.down_proj", False),
            ]
            if self.version == 1:
                rules += offset_norm(f"{ours}.ffn_norm", f"{theirs}.post_attention_layernorm")
            else:
                rules += [
                    *offset_norm(f"{ours}.attn_out_norm", f"{theirs}.post_attention_layernorm"),
                    *offset_norm(f"{ours}.ffn_norm", f"{theirs}.pre_feedforward_layernorm"),
                    *offset_norm(f"{ours}.ffn_out_norm", f"{theirs}.post_feedforward_layernorm"),
                ]
            if config.qk_norm:
                rules += offset_norm(f"{ours}.attn.q_norm", f"{attention}.q_norm")
                rules += offset_norm(f"{ours}.attn.k_norm", f"{attention}.k_norm")
        return rules + offset_norm("decoder.final_norm", "norm")

    def tied_aliases(self, config):
        return {"lm_head.weight": "embed_tokens.weight"}
