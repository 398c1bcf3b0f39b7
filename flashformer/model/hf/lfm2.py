"""LFM2 (LiquidAI's LFM2 and LFM2.5, transformers' Lfm2ForCausalLM): a decoder whose layers are
of two kinds (layer_types, or the older full_attn_idxs): "conv", a double-gated short
convolution (model/short_conv.py: conv.in_proj, the depthwise conv.conv of conv_L_cache taps,
conv.out_proj), and "full_attention", GQA with an RMSNorm over each query and key head
(q_layernorm, k_layernorm) before RoPE. Every layer has the same pre-norm (operator_norm) before
its mixer and a SwiGLU feed-forward (feed_forward.w1 gate, w3 up, w2 down); the stack closes with
model.embedding_norm (the final norm, despite its name). No biases but conv_bias.

The feed-forward's width is intermediate_size as transformers adjusts it where
block_auto_adjust_ff_dim is on (2/3 of it, times block_ffn_dim_multiplier, rounded up to
block_multiple_of); saving writes the adjusted width with the adjustment off.
"""

from __future__ import annotations

from flashformer.model.hf.llama import Llama, decoder_config, decoder_to_hf, rope_fraction
from flashformer.model.hf.mapping import Rule, fused, linear, norm, plain_layers, refuse, require


def feed_forward_width(hf: dict) -> int:
    """Lfm2MLP's hidden width from config.json (the module docstring's adjustment)."""
    width = hf.get("block_ff_dim", hf.get("intermediate_size", 12288))
    if not hf.get("block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier, multiple = hf.get("block_ffn_dim_multiplier", 1.0), hf.get("block_multiple_of", 256)
    if multiplier is not None:
        width = int(multiplier * width)
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def layer_types(hf: dict) -> tuple[str, ...]:
    """Per layer "conv" or "full_attention": layer_types, else from full_attn_idxs (default: all)."""
    n_layers = hf.get("num_hidden_layers", 32)
    if hf.get("layer_types") is not None:
        kinds = tuple(hf["layer_types"])
    else:
        attention = hf.get("full_attn_idxs")
        attention = range(n_layers) if attention is None else attention
        kinds = tuple("full_attention" if i in attention else "conv" for i in range(n_layers))
    if len(kinds) != n_layers or set(kinds) - {"conv", "full_attention"}:
        raise ValueError(
            f"config.json: layer_types must give 'conv' or 'full_attention' for each of the "
            f"{n_layers} layers (num_hidden_layers); got {list(kinds)}"
        )
    return kinds


class Lfm2(Llama):
    model_type = "lfm2"

    def config_from_hf(self, hf, weights):
        partial = rope_fraction(hf)
        if partial != 1.0:
            raise ValueError(f"config.json: partial_rotary_factor={partial} is not supported for lfm2 models")
        refuse(hf, "lfm2", head_dim=(None, hf.get("hidden_size", 2560) // hf.get("num_attention_heads", 32)))
        hf = {
            "vocab_size": 65536,
            "hidden_size": 2560,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "max_position_embeddings": 128000,
            "tie_word_embeddings": hf.get("tie_embedding", True),
            "rope_theta": 1000000.0,
            "pad_token_id": 0,
            **hf,
        }
        hf["head_dim"] = None  # transformers' Lfm2Attention: hidden_size // num_attention_heads
        kinds = layer_types(hf)
        return decoder_config(
            hf,
            weights,
            "lfm2",
            d_ff=feed_forward_width(hf),
            norm_eps=float(hf.get("norm_eps", 1e-5)),
            attention_bias=False,
            ffn_bias=False,
            qk_norm=True,
            layer_types=None if set(kinds) == {"full_attention"} else kinds,
            short_conv_kernel=int(hf.get("conv_L_cache", 3)),
            short_conv_bias=bool(hf.get("conv_bias", False)),
        )

    def config_to_hf(self, config):
        kinds = config.layer_types or ("full_attention",) * config.n_layers
        plain_layers(config, "lfm2", qk_norm=True, layer_types=config.layer_types)
        if set(kinds) - {"conv", "full_attention"}:
            raise ValueError(
                f"ModelConfig.layer_types={kinds!r} cannot be saved as lfm2 (conv, full_attention)"
            )
        require(
            config,
            "lfm2",
            attention_bias=False,
            attention_out_bias=False,
            ffn_bias=False,
            activation="silu",
            rotary_fraction=1.0,
            fused_gate_up=False,
            head_dim=config.d_model // config.n_heads,
        )
        hf = decoder_to_hf(config, "lfm2")
        for key in ("hidden_act", "rms_norm_eps", "head_dim", "rope_theta", "attention_dropout"):
            del hf[key]  # Lfm2Config has no such fields (strict: it refuses them)
        return {
            "architectures": ["Lfm2ForCausalLM"],
            "model_type": "lfm2",
            **hf,
            "norm_eps": config.norm_eps,
            "block_auto_adjust_ff_dim": False,  # intermediate_size is the width itself
            "conv_L_cache": config.short_conv_kernel,
            "conv_bias": config.short_conv_bias,
            "layer_types": list(kinds),
        }

    def rules(self, config):
        rules = [Rule("embeddings.tokens.weight", ("embed_tokens.weight",))]
        for i in range(config.n_layers):
            ours, theirs = f"decoder.blocks.{i}", f"layers.{i}"
            rules += norm(f"{ours}.attn_norm", f"{theirs}.operator_norm", bias=False)
            if config.layer_type(i) == "conv":
                bias = config.short_conv_bias
                rules += [
                    *linear(f"{ours}.attn.in_proj", f"{theirs}.conv.in_proj", bias),
                    *linear(f"{ours}.attn.conv", f"{theirs}.conv.conv", bias),
                    *linear(f"{ours}.attn.out_proj", f"{theirs}.conv.out_proj", bias),
                ]
            else:
                attention = f"{theirs}.self_attn"
                rules += [
                    *fused(f"{ours}.attn.qkv", [f"{attention}.{p}_proj" for p in "qkv"], False),
                    *linear(f"{ours}.attn.out", f"{attention}.out_proj", False),
                    *norm(f"{ours}.attn.q_norm", f"{attention}.q_layernorm", bias=False),
                    *norm(f"{ours}.attn.k_norm", f"{attention}.k_layernorm", bias=False),
                ]
            rules += [
                *norm(f"{ours}.ffn_norm", f"{theirs}.ffn_norm", bias=False),
                *linear(f"{ours}.ffn.gate", f"{theirs}.feed_forward.w1", False),
                *linear(f"{ours}.ffn.up", f"{theirs}.feed_forward.w3", False),
                *linear(f"{ours}.ffn.down", f"{theirs}.feed_forward.w2", False),
            ]
        rules += norm("decoder.final_norm", "embedding_norm", bias=False)
        if not config.tie_word_embeddings:
            rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
        return rules
