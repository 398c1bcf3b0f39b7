"""Gemma 4's text model (gemma4_text, Gemma4ForCausalLM): what it adds to Gemma 3's layout.

- Its RMSNorms scale by w (not 1 + w, as Gemma 1-3 do): loaded as they are.
- Per-layer inputs (hidden_size_per_layer_input, model/per_layer.py): a second token table
  (embed_tokens_per_layer), a projection of the embeddings (per_layer_model_projection) with its
  norm, and in every layer a gate, a projection and a norm (per_layer_input_gate,
  per_layer_projection, post_per_layer_input_norm) after the feed-forward; then the layer's
  output times its layer_scalar.
- Attention: q and k head norms, a weightless norm on v, a scale of 1 (the norms set the
  scores' size). The full layers' heads are wider (per_layer_config's head_dim, or
  global_head_dim: 512 in the released sizes, 256 on the sliding layers) and turn with
  "proportional" RoPE (base 1e6, a quarter of the pairs); the sliding layers' RoPE is the
  default one, base 10,000, over whole heads.
- The last num_kv_shared_layers layers have no k/v projections: each attends over the keys and
  values of the last earlier layer of its type; with use_double_wide_mlp their feed-forward is
  twice as wide.
- Final logits soft-capped (final_logit_softcapping), no attention softcap.

Refused by name: the mixture of experts (enable_moe_block: 26B-A4B), keys as values
(attention_k_eq_v: 31B), bidirectional attention over text ("all"; "vision" concerns image
tokens only, which a text model never sees).
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
    norm,
    plain_layers,
    refuse,
    require,
    strip,
)
from flashformer.model.positional import RopeScaling

FAMILY = "gemma4_text"


def _layer_types(hf: dict, n_layers: int) -> list[str]:
    """config.json's layer_types, or transformers' default (five sliding, one full); the last layer
    is always full (transformers forces it)."""
    types = list(
        hf.get("layer_types")
        or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)]
    )
    types[-1] = "full_attention"
    return types


def _full_head_dim(hf: dict, layer_types: list[str]) -> int:
    """The full layers' head width: per_layer_config's (one for all of them), else global_head_dim."""
    overrides = hf.get("per_layer_config")
    if not overrides:
        return int(hf.get("global_head_dim", 512))
    widths = set()
    for index, override in overrides.items():
        unknown = set(override) - {"head_dim", "num_key_value_heads"}
        kv_heads = override.get("num_key_value_heads", hf.get("num_key_value_heads", 4))
        if unknown or kv_heads != hf.get("num_key_value_heads", 4):
            raise ValueError(
                f"config.json: per_layer_config[{index!r}]={override!r} is not supported for {FAMILY} "
                f"models (a head_dim of the full layers only)"
            )
        if layer_types[int(index)] == "full_attention":
            widths.add(override.get("head_dim", hf.get("head_dim", 256)))
    if len(widths) != 1:
        raise ValueError(
            f"config.json: per_layer_config gives the full layers head_dims {sorted(widths)}; expected one"
        )
    return int(widths.pop())


def _rope(hf: dict) -> dict:
    """Our RoPE fields from rope_parameters: the full layers' (default, or proportional with its
    partial_rotary_factor and factor) and the sliding layers' base (default only)."""
    parameters = hf.get("rope_parameters") or {}
    full = parameters.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25}
    sliding = parameters.get("sliding_attention") or {"rope_type": "default"}
    if full.get("rope_type", "default") not in ("default", "proportional"):
        raise ValueError(
            f"config.json: rope type {full['rope_type']!r} of the full layers is not supported for {FAMILY} "
            f"models ('default', 'proportional')"
        )
    if sliding.get("rope_type", "default") != "default":
        raise ValueError(
            f"config.json: rope type {sliding['rope_type']!r} of the sliding layers is not supported for "
            f"{FAMILY} models ('default')"
        )
    proportional = full.get("rope_type") == "proportional"
    factor = float(full.get("factor", 1.0)) if proportional else 1.0
    return {
        "rope_theta": float(full.get("rope_theta", 1e6)),
        "rotary_fraction": float(full.get("partial_rotary_factor", 1.0)) if proportional else 1.0,
        "rope_proportional": proportional,
        "rope_scaling": None if factor == 1.0 else RopeScaling("linear", factor),
        "rope_local_theta": float(sliding.get("rope_theta", 10000.0)),
    }


class Gemma4(Family):
    """gemma4_text; see the module docstring."""

    model_type = FAMILY

    def strip_prefix(self, weights):
        return strip(weights, "model.")

    def add_prefix(self, weights, config):
        return {(name if name.startswith("lm_head.") else "model." + name): t for name, t in weights.items()}

    def config_from_hf(self, hf, weights):
        refuse(
            hf,
            FAMILY,
            enable_moe_block=(False, None),
            attention_k_eq_v=(False, None),
            use_bidirectional_attention=(None, "vision"),  # "vision": only image tokens look ahead
            attention_bias=(False,),
        )
        n_layers = hf.get("num_hidden_layers", 30)
        layer_types = _layer_types(hf, n_layers)
        d_ff = hf.get("intermediate_size", 9216)
        shared = hf.get("num_kv_shared_layers", 0) or 0
        layer_d_ff = None
        if hf.get("use_double_wide_mlp") and shared:
            layer_d_ff = tuple(d_ff if i < n_layers - shared else 2 * d_ff for i in range(n_layers))
        per_layer = hf.get("hidden_size_per_layer_input", 256) or 0
        return ModelConfig(
            arch="decoder",
            vocab_size=hf.get("vocab_size", 262144),
            d_model=hf.get("hidden_size", 2304),
            n_layers=n_layers,
            n_heads=hf.get("num_attention_heads", 8),
            n_kv_heads=hf.get("num_key_value_heads", 4),
            head_dim=hf.get("head_dim", 256),
            global_head_dim=_full_head_dim(hf, layer_types),
            d_ff=d_ff,
            layer_d_ff=layer_d_ff,
            max_seq_len=hf.get("max_position_embeddings", 131072),
            position="rope",
            **_rope(hf),
            norm="rmsnorm",
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            activation=activation_from_hf(hf, "hidden_activation", "gelu_pytorch_tanh"),
            gated_ffn=True,
            attention_bias=False,
            ffn_bias=False,
            attention_scale=1.0,
            qk_norm=True,
            v_norm=True,
            sandwich_norm=True,
            layer_scale=True,
            final_logit_softcap=hf.get("final_logit_softcapping"),
            sliding_window=hf.get("sliding_window", 512),
            layer_types=tuple(layer_types),
            kv_shared_layers=shared,
            per_layer_input_dim=per_layer,
            per_layer_vocab_size=hf.get("vocab_size_per_layer_input", 262144) if per_layer else None,
            tie_word_embeddings=is_tied(weights, "lm_head.weight", "embed_tokens.weight", hf, True),
            scale_embeddings=True,
            dropout=0.0,
            attention_dropout=float(hf.get("attention_dropout", 0.0)),
            bos_token_id=hf.get("bos_token_id", 2),
            eos_token_id=hf.get("eos_token_id", 1),
            pad_token_id=hf.get("pad_token_id", 0),
            hf_model_type=FAMILY,
        )

    def config_to_hf(self, config):
        plain_layers(
            config,
            FAMILY,
            qk_norm=True,
            v_norm=True,
            sandwich_norm=True,
            layer_scale=True,
            scale_embeddings=True,
            final_logit_softcap=config.final_logit_softcap,
            layer_types=config.layer_types,
            rope_local_theta=config.rope_local_theta,
            rope_proportional=config.rope_proportional,
            global_head_dim=config.global_head_dim,
            kv_shared_layers=config.kv_shared_layers,
            layer_d_ff=config.layer_d_ff,
            per_layer_input_dim=config.per_layer_input_dim,
        )
        require(
            config,
            FAMILY,
            arch="decoder",
            position="rope",
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
            attention_scale=1.0,
            tie_word_embeddings=True,
        )
        types = list(config.layer_types or ["full_attention"] * config.n_layers)
        shared = config.kv_shared_layers
        double = tuple(
            config.d_ff * (2 if i >= config.n_layers - shared else 1) for i in range(config.n_layers)
        )
        if config.layer_d_ff is not None and (not shared or config.layer_d_ff != double):
            raise ValueError(
                f"ModelConfig.layer_d_ff={config.layer_d_ff} cannot be saved as {FAMILY} (it doubles d_ff on the "
                f"KV-shared layers or nowhere)"
            )
        if config.rope_scaling is not None and (
            config.rope_scaling.kind != "linear" or not config.rope_proportional
        ):
            raise ValueError(f"ModelConfig.rope_scaling={config.rope_scaling} cannot be saved as {FAMILY}")
        full = {"rope_type": "default", "rope_theta": config.rope_theta}
        if config.rope_proportional:
            full.update(rope_type="proportional", partial_rotary_factor=config.rotary_fraction)
            if config.rope_scaling is not None:
                full["factor"] = config.rope_scaling.factor
        elif config.rotary_fraction != 1.0:
            raise ValueError(
                f"ModelConfig.rotary_fraction={config.rotary_fraction} needs rope_proportional in {FAMILY}"
            )
        sliding = {"rope_type": "default", "rope_theta": config.rope_local_theta or config.rope_theta}
        return {
            "architectures": ["Gemma4ForCausalLM"],
            "model_type": FAMILY,
            "vocab_size": config.vocab_size,
            "hidden_size": config.d_model,
            "intermediate_size": config.d_ff,
            "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads,
            "num_key_value_heads": config.n_kv_heads,
            "head_dim": config.head_dim,
            "per_layer_config": {
                str(i): {"head_dim": config.layer_head_dim(i)}
                for i, t in enumerate(types)
                if t == "full_attention"
            },
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": config.max_seq_len,
            "rms_norm_eps": config.norm_eps,
            "rope_parameters": {"full_attention": full, "sliding_attention": sliding},
            "sliding_window": config.sliding_window,
            "layer_types": types,
            "final_logit_softcapping": config.final_logit_softcap,
            "hidden_size_per_layer_input": config.per_layer_input_dim,
            "vocab_size_per_layer_input": config.per_layer_vocab_size,
            "num_kv_shared_layers": shared,
            "use_double_wide_mlp": config.layer_d_ff is not None,
            "attention_bias": False,
            "attention_dropout": config.attention_dropout,
            "tie_word_embeddings": True,
            "bos_token_id": config.bos_token_id,
            "eos_token_id": config.eos_token_id,
            "pad_token_id": config.pad_token_id,
        }

    def rules(self, config):
        rules = [Rule("embeddings.tokens.weight", ("embed_tokens.weight",))]
        if config.per_layer_input_dim:
            rules += [
                Rule("per_layer_inputs.tokens.weight", ("embed_tokens_per_layer.weight",)),
                *linear("per_layer_inputs.projection", "per_layer_model_projection", False),
                *norm("per_layer_inputs.projection_norm", "per_layer_projection_norm", False),
            ]
        for i in range(config.n_layers):
            ours, theirs = f"decoder.blocks.{i}", f"layers.{i}"
            attention = f"{theirs}.self_attn"
            own_kv = config.kv_source(i) is None
            projections = [f"{attention}.{p}_proj" for p in (("q", "k", "v") if own_kv else ("q",))]
            rules += [
                *norm(f"{ours}.attn_norm", f"{theirs}.input_layernorm", False),
                *fused(f"{ours}.attn.qkv", projections, False),
                *norm(f"{ours}.attn.q_norm", f"{attention}.q_norm", False),
                *linear(f"{ours}.attn.out", f"{attention}.o_proj", False),
                *norm(f"{ours}.attn_out_norm", f"{theirs}.post_attention_layernorm", False),
                *norm(f"{ours}.ffn_norm", f"{theirs}.pre_feedforward_layernorm", False),
                *linear(f"{ours}.ffn.gate", f"{theirs}.mlp.gate_proj", False),
                *linear(f"{ours}.ffn.up", f"{theirs}.mlp.up_proj", False),
                *linear(f"{ours}.ffn.down", f"{theirs}.mlp.down_proj", False),
                *norm(f"{ours}.ffn_out_norm", f"{theirs}.post_feedforward_layernorm", False),
                Rule(f"{ours}.layer_scale", (f"{theirs}.layer_scalar",)),
            ]
            if own_kv:
                rules += norm(f"{ours}.attn.k_norm", f"{attention}.k_norm", False)
            if config.per_layer_input_dim:
                rules += [
                    *linear(f"{ours}.per_layer.gate", f"{theirs}.per_layer_input_gate", False),
                    *linear(f"{ours}.per_layer.projection", f"{theirs}.per_layer_projection", False),
                    *norm(f"{ours}.per_layer.norm", f"{theirs}.post_per_layer_input_norm", False),
                ]
        if not config.tie_word_embeddings:
            rules += linear("lm_head", "lm_head", False)
        return rules + norm("decoder.final_norm", "norm", False)

    def tied_aliases(self, config):
        return {"lm_head.weight": "embed_tokens.weight"}


class Gemma4Multimodal(Gemma4):
    """gemma4 (Gemma4ForConditionalGeneration, the released checkpoints): its text model only.
    config.json's text_config is a gemma4_text config; the language model's weights sit under
    model.language_model.; the vision and audio towers and their projections into the text
    model's space are left aside (text in, text out). Saved back as gemma4_text."""

    model_type = "gemma4"
    ignored = (r"^model\.(vision_tower|audio_tower|embed_vision|embed_audio)\.",)

    def strip_prefix(self, weights):
        return {name.removeprefix("model.language_model."): t for name, t in weights.items()}

    def add_prefix(self, weights, config):  # where the names table finds them in such a folder
        prefix = "model.language_model."
        return {(name if name.startswith("lm_head.") else prefix + name): t for name, t in weights.items()}

    def config_from_hf(self, hf, weights):
        text = dict(hf.get("text_config") or {})
        if not text:
            raise ValueError(
                "config.json: a gemma4 (Gemma4ForConditionalGeneration) config needs its text_config"
            )
        text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
        return super().config_from_hf(text, weights)
