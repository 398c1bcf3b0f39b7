"""T5 v1.0 and v1.1: relative bias in block 0 only, no 1/sqrt(d), the tied head's d_model^-0.5 rescale."""

from __future__ import annotations

import torch

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
    refuse,
    require,
)


class T5(Family):
    model_type = "t5"
    ignored = (
        # transformers creates it, no layer reads it: cross-attention has no position bias
        r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$",
    )

    def config_from_hf(self, hf, weights):
        if "decoder.final_layer_norm.weight" not in weights:
            raise ValueError("a T5 checkpoint without a decoder (T5EncoderModel) is not supported")
        refuse(hf, "t5", is_decoder=(False,))
        for stack in ("encoder", "decoder"):  # both stacks must read the shared embedding
            name = f"{stack}.embed_tokens.weight"
            if (
                name in weights
                and "shared.weight" in weights
                and not torch.equal(weights[name], weights["shared.weight"])
            ):
                raise ValueError(
                    f"{name} differs from shared.weight: untied T5 input embeddings are not supported"
                )
        if "shared.weight" not in weights and "encoder.embed_tokens.weight" in weights:
            weights["shared.weight"] = weights["encoder.embed_tokens.weight"]
        weights.pop("encoder.embed_tokens.weight", None)
        weights.pop("decoder.embed_tokens.weight", None)

        projection = hf.get("feed_forward_proj", "relu")
        parts = projection.split("-")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
            raise ValueError(f"config.json: feed_forward_proj={projection!r} is not supported")
        # transformers maps gated-gelu to the tanh approximation ("gelu_new")
        activation = (
            "gelu_tanh"
            if projection == "gated-gelu"
            else activation_from_hf({"act": parts[-1]}, "act", "relu")
        )
        # T5 v1.0 rescales before its tied head; v1.1 says tie_word_embeddings=false and does not
        rescale = hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False)
        n_layers = hf.get("num_layers", 6)
        dropout = hf.get("dropout_rate", 0.1)
        return ModelConfig(
            arch="encoder-decoder",
            vocab_size=hf.get("vocab_size", 32128),
            d_model=hf.get("d_model", 512),
            n_layers=n_layers,
            n_decoder_layers=hf.get("num_decoder_layers") or n_layers,
            n_heads=hf.get("num_heads", 8),
            head_dim=hf.get("d_kv", 64),
            d_ff=hf.get("d_ff", 2048),
            max_seq_len=512,
            position="relative",
            relative_buckets=hf.get("relative_attention_num_buckets", 32),
            relative_max_distance=hf.get("relative_attention_max_distance", 128),
            norm="rmsnorm",
            norm_eps=hf.get("layer_norm_epsilon", 1e-6),
            prenorm=True,
            activation=activation,
            gated_ffn=parts[0] == "gated" and len(parts) == 2,
            attention_bias=False,
            ffn_bias=False,
            attention_scale=1.0,
            tie_word_embeddings=is_tied(weights, "lm_head.weight", "shared.weight", hf, True),
            scale_decoder_output=bool(rescale),
            dropout=dropout,
            attention_dropout=dropout,
            activation_dropout=dropout,
            dropout_after_final_norm=True,
            pad_token_id=hf.get("pad_token_id", 0),
            eos_token_id=hf.get("eos_token_id", 1),
            decoder_start_token_id=hf.get("decoder_start_token_id", hf.get("pad_token_id", 0)),
            hf_model_type="t5",
        )

    def config_to_hf(self, config):
        plain_layers(config, "t5")
        require(
            config,
            "t5",
            arch="encoder-decoder",
            position="relative",
            norm="rmsnorm",
            prenorm=True,
            embedding_norm=False,
            attention_bias=False,
            ffn_bias=False,
            attention_scale=1.0,
            type_vocab_size=0,
        )
        if config.n_kv_heads != config.n_heads:
            raise ValueError(f"ModelConfig.n_kv_heads={config.n_kv_heads} cannot be saved as a t5 model")
        if config.gated_ffn:
            projection = "gated-gelu" if config.activation == "gelu_tanh" else f"gated-{config.activation}"
        else:
            projection = ACTIVATION_TO_HF[config.activation]
        return {
            "architectures": ["T5ForConditionalGeneration"],
            "model_type": "t5",
            "vocab_size": config.vocab_size,
            "d_model": config.d_model,
            "d_kv": config.head_dim,
            "d_ff": config.d_ff,
            "num_layers": config.n_layers,
            "num_decoder_layers": config.n_decoder_layers,
            "num_heads": config.n_heads,
            "relative_attention_num_buckets": config.relative_buckets,
            "relative_attention_max_distance": config.relative_max_distance,
            "dropout_rate": config.dropout,
            "layer_norm_epsilon": config.norm_eps,
            "feed_forward_proj": projection,
            "is_encoder_decoder": True,
            # the older reading of the flag (rescale iff tied), and the newer explicit one
            "tie_word_embeddings": config.scale_decoder_output,
            "scale_decoder_outputs": config.scale_decoder_output,
            "pad_token_id": config.pad_token_id,
            "eos_token_id": config.eos_token_id,
            "decoder_start_token_id": config.decoder_start_token_id,
        }

    def rules(self, config):
        rules = [Rule("embeddings.tokens.weight", ("shared.weight",))]
        for stack, n_layers in (("encoder", config.n_layers), ("decoder", config.n_decoder_layers)):
            table = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
            rules.append(Rule(f"{stack}.positions.table.weight", (table,)))
            for i in range(n_layers):
                ours, theirs = f"{stack}.blocks.{i}", f"{stack}.block.{i}.layer"
                attention = f"{theirs}.0.SelfAttention"
                rules += [
                    *norm(f"{ours}.attn_norm", f"{theirs}.0.layer_norm", bias=False),
                    *fused(f"{ours}.attn.qkv", [f"{attention}.{p}" for p in "qkv"], bias=False),
                    *linear(f"{ours}.attn.out", f"{attention}.o", bias=False),
                ]
                ffn_index = 1
                if stack == "decoder":
                    cross = f"{theirs}.1.EncDecAttention"
                    rules += [
                        *norm(f"{ours}.cross_norm", f"{theirs}.1.layer_norm", bias=False),
                        *linear(f"{ours}.cross_attn.q", f"{cross}.q", bias=False),
                        *fused(f"{ours}.cross_attn.kv", [f"{cross}.k", f"{cross}.v"], bias=False),
                        *linear(f"{ours}.cross_attn.out", f"{cross}.o", bias=False),
                    ]
                    ffn_index = 2
                ffn = f"{theirs}.{ffn_index}.DenseReluDense"
                rules += norm(f"{ours}.ffn_norm", f"{theirs}.{ffn_index}.layer_norm", bias=False)
                if config.gated_ffn:
                    rules += linear(f"{ours}.ffn.gate", f"{ffn}.wi_0", bias=False)
                    rules += linear(f"{ours}.ffn.up", f"{ffn}.wi_1", bias=False)
                else:
                    rules += linear(f"{ours}.ffn.up", f"{ffn}.wi", bias=False)
                rules += linear(f"{ours}.ffn.down", f"{ffn}.wo", bias=False)
            rules += norm(f"{stack}.final_norm", f"{stack}.final_layer_norm", bias=False)
        if not config.tie_word_embeddings:
            rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
        return rules

    def tied_aliases(self, config):
        return {"lm_head.weight": "shared.weight"}
