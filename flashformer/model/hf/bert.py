"""BERT: post-norm, LayerNorm gamma/beta in old files, the MLM head tied to the word embedding;
BertForSequenceClassification / BertForTokenClassification's `classifier` (hf/task_heads.py)."""

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
    refuse,
    require,
    standard_heads,
    strip,
)
from flashformer.model.hf.task_heads import task_from_hf, task_to_hf


class Bert(Family):
    model_type = "bert"
    ignored = (
        r"^embeddings\.position_ids$",
        r"^embeddings\.token_type_ids$",
        r"^cls\.predictions\.decoder\.bias$",  # an alias of cls.predictions.bias
        r"^cls\.seq_relationship\.",  # the next-sentence head: not part of EncoderModel
    )

    def strip_prefix(self, weights):
        return strip(weights, "bert.")

    def add_prefix(self, weights, config):
        # BertForMaskedLM and BertFor*Classification nest the encoder under "bert."; BertModel does not
        nested = config.mlm_head or config.task is not None
        return {
            ("" if name.startswith(("cls.", "classifier.")) or not nested else "bert.") + name: t
            for name, t in weights.items()
        }

    def config_from_hf(self, hf, weights):
        refuse(
            hf,
            "bert",
            position_embedding_type=("absolute",),
            is_decoder=(False,),
            add_cross_attention=(False,),
        )
        if "cls.predictions.bias" not in weights and "cls.predictions.decoder.bias" in weights:
            weights["cls.predictions.bias"] = weights["cls.predictions.decoder.bias"]
        mlm_head = "cls.predictions.transform.dense.weight" in weights
        return ModelConfig(
            arch="encoder",
            vocab_size=hf.get("vocab_size", 30522),
            d_model=hf.get("hidden_size", 768),
            n_layers=hf.get("num_hidden_layers", 12),
            n_heads=hf.get("num_attention_heads", 12),
            d_ff=hf.get("intermediate_size", 3072),
            max_seq_len=hf.get("max_position_embeddings", 512),
            position="learned",
            norm="layernorm",
            norm_eps=hf.get("layer_norm_eps", 1e-12),
            prenorm=False,
            embedding_norm=True,
            activation=activation_from_hf(hf, "hidden_act", "gelu"),
            type_vocab_size=hf.get("type_vocab_size", 2),
            tie_word_embeddings=not mlm_head
            or is_tied(
                weights, "cls.predictions.decoder.weight", "embeddings.word_embeddings.weight", hf, True
            ),
            mlm_head=mlm_head,
            pooler="pooler.dense.weight" in weights,
            dropout=hf.get("hidden_dropout_prob", 0.1),
            attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
            pad_token_id=hf.get("pad_token_id", 0),
            init_std=hf.get("initializer_range", 0.02),
            hf_model_type="bert",
            **task_from_hf(hf, weights, "Bert", "classifier.weight"),
        )

    def config_to_hf(self, config):
        plain_layers(config, "bert")
        require(
            config,
            "bert",
            arch="encoder",
            position="learned",
            norm="layernorm",
            prenorm=False,
            embedding_norm=True,
            gated_ffn=False,
            attention_bias=True,
            ffn_bias=True,
            attention_scale=None,
        )
        standard_heads(config, "bert")
        hf = {
            "architectures": ["BertForMaskedLM" if config.mlm_head else "BertModel"],
            "model_type": "bert",
            "vocab_size": config.vocab_size,
            "hidden_size": config.d_model,
            "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads,
            "intermediate_size": config.d_ff,
            "hidden_act": ACTIVATION_TO_HF[config.activation],
            "hidden_dropout_prob": config.dropout,
            "attention_probs_dropout_prob": config.attention_dropout,
            "max_position_embeddings": config.max_seq_len,
            "type_vocab_size": config.type_vocab_size,
            "layer_norm_eps": config.norm_eps,
            "pad_token_id": config.pad_token_id,
            "position_embedding_type": "absolute",
            "tie_word_embeddings": config.tie_word_embeddings,
            "initializer_range": config.init_std,
        }
        return hf | task_to_hf(config, "Bert")

    def rules(self, config):
        rules = [
            Rule("embeddings.tokens.weight", ("embeddings.word_embeddings.weight",)),
            Rule("embeddings.positions.weight", ("embeddings.position_embeddings.weight",)),
            *norm("embeddings.norm", "embeddings.LayerNorm"),
        ]
        if config.type_vocab_size:
            rules.append(Rule("embeddings.token_types.weight", ("embeddings.token_type_embeddings.weight",)))
        for i in range(config.n_layers):
            ours, theirs = f"encoder.blocks.{i}", f"encoder.layer.{i}"
            rules += [
                *fused(
                    f"{ours}.attn.qkv",
                    [f"{theirs}.attention.self.{p}" for p in ("query", "key", "value")],
                    True,
                ),
                *linear(f"{ours}.attn.out", f"{theirs}.attention.output.dense"),
                *norm(f"{ours}.attn_norm", f"{theirs}.attention.output.LayerNorm"),
                *linear(f"{ours}.ffn.up", f"{theirs}.intermediate.dense"),
                *linear(f"{ours}.ffn.down", f"{theirs}.output.dense"),
                *norm(f"{ours}.ffn_norm", f"{theirs}.output.LayerNorm"),
            ]
        if config.pooler:
            rules += linear("pooler.dense", "pooler.dense")
        if config.mlm_head:
            rules += [
                *linear("mlm_head.dense", "cls.predictions.transform.dense"),
                *norm("mlm_head.norm", "cls.predictions.transform.LayerNorm"),
                Rule("mlm_head.bias", ("cls.predictions.bias",)),
            ]
            if not config.tie_word_embeddings:
                rules.append(Rule("mlm_head.decoder.weight", ("cls.predictions.decoder.weight",)))
        if config.task is not None:
            rules += linear("task_head.classifier", "classifier")
        return rules

    def tied_aliases(self, config):
        return {"cls.predictions.decoder.weight": "embeddings.word_embeddings.weight"}
