"""Hugging Face checkpoints in and out: bert, gpt2, t5 (v1.0 and v1.1), llama.

    model = flashformer.from_pretrained("path/to/folder")   # config.json + weights
    model.save_pretrained("path/to/out")                   # transformers loads it back

A folder holds config.json and the weights as model.safetensors, a sharded
model.safetensors.index.json, pytorch_model.bin (read with
torch.load(weights_only=True)) or a sharded pytorch_model.bin.index.json.

Each family is a config translation plus a list of `Rule`s that map one of
our parameters to one or more of theirs. Loading applies the rules, then
insists that nothing is missing and nothing is left over (other than
buffers and aliases listed per family), so a mapping mistake or an
unsupported head is an error, never a silently different model. The traps:

- GPT-2 stores Conv1D weights as (in, out), transposed from nn.Linear, with
  q, k and v fused in c_attn; old files carry attn.bias / attn.masked_bias
  mask buffers; lm_head.weight is often absent (tied to wte).
- BERT is post-norm; old files name LayerNorm parameters gamma / beta; the
  MLM head's decoder weight is the word embedding and its bias is stored
  twice (cls.predictions.bias and cls.predictions.decoder.bias).
- T5 keeps the relative bias table in block 0 of each stack only, does not
  scale q.k by 1/sqrt(d), has d_kv * heads possibly != d_model, and (in
  transformers) folds the padding mask into that bias: here the mask goes
  to attention separately. With a tied head (v1.0) the decoder output is
  multiplied by d_model^-0.5; v1.1 (tie_word_embeddings=false) has its own
  lm_head and no rescale.
- LLaMA: grouped KV heads, rope_theta, rope_scaling (linear, llama3), old
  rotary inv_freq buffers.

A config option whose value changes the computation and that flashformer
does not implement raises a ValueError naming it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from flashformer.config import ModelConfig
from flashformer.models import MODEL_CLASSES, PreTrainedModel
from flashformer.positional import RopeScaling

# ---- reading and writing weight files ----


def load_weights(folder: str | Path) -> dict[str, Tensor]:
    """Every tensor of a checkpoint folder, by its name in the file."""
    folder = Path(folder)
    if (folder / "model.safetensors").is_file():
        return load_file(folder / "model.safetensors")
    if (folder / "model.safetensors.index.json").is_file():
        return _load_sharded(folder, "model.safetensors.index.json", load_file)
    if (folder / "pytorch_model.bin").is_file():
        return _torch_load(folder / "pytorch_model.bin")
    if (folder / "pytorch_model.bin.index.json").is_file():
        return _load_sharded(folder, "pytorch_model.bin.index.json", _torch_load)
    raise FileNotFoundError(
        f"no weights in {folder}: looked for model.safetensors, model.safetensors.index.json, "
        f"pytorch_model.bin and pytorch_model.bin.index.json"
    )


def _torch_load(path: Path) -> dict[str, Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _load_sharded(folder: Path, index_name: str, load: Callable[[Path], dict]) -> dict[str, Tensor]:
    weight_map = json.loads((folder / index_name).read_text())["weight_map"]
    weights = {}
    for shard in sorted(set(weight_map.values())):
        weights.update(load(folder / shard))
    missing = sorted(set(weight_map) - set(weights))
    if missing:
        raise ValueError(f"{index_name} lists tensors that its shards do not hold: {missing[:5]}")
    return weights


# ---- the mapping between our parameters and theirs ----


@dataclass(frozen=True)
class Rule:
    """ours <- theirs. kind "copy": one tensor as is; "t": transposed (GPT-2's
    Conv1D); "cat": ours is theirs concatenated on dim 0 (fused projections)."""

    ours: str
    theirs: tuple[str, ...]
    kind: str = "copy"

    def load(self, tensors: list[Tensor]) -> Tensor:
        if self.kind == "cat":
            return torch.cat(tensors, dim=0)
        return tensors[0].t() if self.kind == "t" else tensors[0]

    def save(self, tensor: Tensor, sizes: list[int]) -> list[Tensor]:
        if self.kind == "cat":
            return list(tensor.split(sizes, dim=0))
        return [tensor.t() if self.kind == "t" else tensor]


def _linear(ours: str, theirs: str, bias: bool = True, kind: str = "copy") -> list[Rule]:
    rules = [Rule(f"{ours}.weight", (f"{theirs}.weight",), kind)]
    if bias:
        rules.append(Rule(f"{ours}.bias", (f"{theirs}.bias",)))
    return rules


def _fused(ours: str, theirs: list[str], bias: bool) -> list[Rule]:
    rules = [Rule(f"{ours}.weight", tuple(f"{t}.weight" for t in theirs), "cat")]
    if bias:
        rules.append(Rule(f"{ours}.bias", tuple(f"{t}.bias" for t in theirs), "cat"))
    return rules


def _norm(ours: str, theirs: str, bias: bool = True) -> list[Rule]:
    return _linear(ours, theirs, bias)


# ---- families ----

HF_TO_ACTIVATION = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "silu": "silu",
    "swish": "silu",
}
ACTIVATION_TO_HF = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "silu"}


class Family:
    """One Hugging Face model type: config translation, weight rules, file layout."""

    model_type: str
    ignored: tuple[str, ...] = ()  # regexes of tensors that carry nothing we need (buffers, aliases)

    def config_from_hf(self, hf: dict, weights: dict[str, Tensor]) -> ModelConfig:
        raise NotImplementedError

    def config_to_hf(self, config: ModelConfig) -> dict:
        raise NotImplementedError

    def rules(self, config: ModelConfig) -> list[Rule]:
        raise NotImplementedError

    def strip_prefix(self, weights: dict[str, Tensor]) -> dict[str, Tensor]:
        return weights

    def add_prefix(self, weights: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
        return weights


def _strip(weights: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    if not any(name.startswith(prefix) for name in weights):
        return weights
    return {name.removeprefix(prefix): t for name, t in weights.items()}


def _activation(hf: dict, key: str, default: str) -> str:
    name = hf.get(key, default)
    if name not in HF_TO_ACTIVATION:
        raise ValueError(
            f"config.json: {key}={name!r} is not supported; supported: {sorted(HF_TO_ACTIVATION)}"
        )
    return HF_TO_ACTIVATION[name]


def _refuse(hf: dict, family: str, **allowed: tuple) -> None:
    """Raise for an option whose value we do not implement (absent = the HF default)."""
    for key, values in allowed.items():
        if key in hf and hf[key] not in values:
            raise ValueError(
                f"config.json: {key}={hf[key]!r} is not supported for {family} models "
                f"(supported: {', '.join(map(repr, values))})"
            )


def _require(config: ModelConfig, family: str, **expected) -> None:
    """Raise for a config field that the Hugging Face family cannot express."""
    for name, value in expected.items():
        if getattr(config, name) != value:
            raise ValueError(
                f"ModelConfig.{name}={getattr(config, name)!r} cannot be saved as a Hugging Face {family} "
                f"model (it needs {value!r})"
            )


def _standard_heads(config: ModelConfig, family: str) -> None:
    if config.kv_heads != config.n_heads:
        raise ValueError(
            f"ModelConfig.n_kv_heads={config.n_kv_heads} cannot be saved as a {family} model (MHA only)"
        )
    if config.dim_per_head * config.n_heads != config.d_model:
        raise ValueError(f"ModelConfig.head_dim={config.head_dim} cannot be saved as a {family} model")


def _is_tied(weights: dict[str, Tensor], head: str, embedding: str, hf: dict, default: bool) -> bool:
    """Tied when the file has no head weight, or one equal to the embedding
    with tie_word_embeddings on; a different head weight is the model's own."""
    if head not in weights:
        return True
    return hf.get("tie_word_embeddings", default) is not False and torch.equal(
        weights[head], weights[embedding]
    )


class Bert(Family):
    model_type = "bert"
    ignored = (
        r"^embeddings\.position_ids$",
        r"^embeddings\.token_type_ids$",
        r"^cls\.predictions\.decoder\.bias$",  # an alias of cls.predictions.bias
        r"^cls\.seq_relationship\.",  # the next-sentence head: not part of EncoderModel
    )

    def strip_prefix(self, weights):
        return _strip(weights, "bert.")

    def add_prefix(self, weights, config):
        # BertForMaskedLM nests the encoder under "bert."; BertModel does not
        return {
            ("" if name.startswith("cls.") or not config.mlm_head else "bert.") + name: t
            for name, t in weights.items()
        }

    def config_from_hf(self, hf, weights):
        _refuse(
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
            activation=_activation(hf, "hidden_act", "gelu"),
            type_vocab_size=hf.get("type_vocab_size", 2),
            tie_word_embeddings=not mlm_head
            or _is_tied(
                weights, "cls.predictions.decoder.weight", "embeddings.word_embeddings.weight", hf, True
            ),
            mlm_head=mlm_head,
            pooler="pooler.dense.weight" in weights,
            dropout=hf.get("hidden_dropout_prob", 0.1),
            attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
            pad_token_id=hf.get("pad_token_id", 0),
            hf_model_type="bert",
        )

    def config_to_hf(self, config):
        _require(
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
        _standard_heads(config, "bert")
        return {
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
        }

    def rules(self, config):
        rules = [
            Rule("embeddings.tokens.weight", ("embeddings.word_embeddings.weight",)),
            Rule("embeddings.positions.weight", ("embeddings.position_embeddings.weight",)),
            *_norm("embeddings.norm", "embeddings.LayerNorm"),
        ]
        if config.type_vocab_size:
            rules.append(Rule("embeddings.token_types.weight", ("embeddings.token_type_embeddings.weight",)))
        for i in range(config.n_layers):
            ours, theirs = f"encoder.blocks.{i}", f"encoder.layer.{i}"
            rules += [
                *_fused(
                    f"{ours}.attn.qkv",
                    [f"{theirs}.attention.self.{p}" for p in ("query", "key", "value")],
                    True,
                ),
                *_linear(f"{ours}.attn.out", f"{theirs}.attention.output.dense"),
                *_norm(f"{ours}.attn_norm", f"{theirs}.attention.output.LayerNorm"),
                *_linear(f"{ours}.ffn.up", f"{theirs}.intermediate.dense"),
                *_linear(f"{ours}.ffn.down", f"{theirs}.output.dense"),
                *_norm(f"{ours}.ffn_norm", f"{theirs}.output.LayerNorm"),
            ]
        if config.pooler:
            rules += _linear("pooler.dense", "pooler.dense")
        if config.mlm_head:
            rules += [
                *_linear("mlm_head.dense", "cls.predictions.transform.dense"),
                *_norm("mlm_head.norm", "cls.predictions.transform.LayerNorm"),
                Rule("mlm_head.bias", ("cls.predictions.bias",)),
            ]
            if not config.tie_word_embeddings:
                rules.append(Rule("mlm_head.decoder.weight", ("cls.predictions.decoder.weight",)))
        return rules

    def tied_aliases(self, config):
        return {"cls.predictions.decoder.weight": "embeddings.word_embeddings.weight"}


class GPT2(Family):
    model_type = "gpt2"
    ignored = (r"^h\.\d+\.attn\.bias$", r"^h\.\d+\.attn\.masked_bias$")  # causal-mask buffers of old files

    def strip_prefix(self, weights):
        return _strip(weights, "transformer.")

    def add_prefix(self, weights, config):
        return {
            (name if name.startswith("lm_head.") else "transformer." + name): t for name, t in weights.items()
        }

    def config_from_hf(self, hf, weights):
        _refuse(hf, "gpt2", scale_attn_by_inverse_layer_idx=(False,), add_cross_attention=(False,))
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
            activation=_activation(hf, "activation_function", "gelu_new"),
            attention_scale=None if hf.get("scale_attn_weights", True) else 1.0,
            tie_word_embeddings=_is_tied(weights, "lm_head.weight", "wte.weight", hf, True),
            dropout=hf.get("resid_pdrop", 0.1),
            attention_dropout=hf.get("attn_pdrop", 0.1),
            bos_token_id=hf.get("bos_token_id", 50256),
            eos_token_id=hf.get("eos_token_id", 50256),
            pad_token_id=hf.get("pad_token_id"),
            hf_model_type="gpt2",
        )

    def config_to_hf(self, config):
        _require(
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
        _standard_heads(config, "gpt2")
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
                *_norm(f"{ours}.attn_norm", f"{theirs}.ln_1"),
                *_linear(f"{ours}.attn.qkv", f"{theirs}.attn.c_attn", kind="t"),  # fused q, k, v, (in, out)
                *_linear(f"{ours}.attn.out", f"{theirs}.attn.c_proj", kind="t"),
                *_norm(f"{ours}.ffn_norm", f"{theirs}.ln_2"),
                *_linear(f"{ours}.ffn.up", f"{theirs}.mlp.c_fc", kind="t"),
                *_linear(f"{ours}.ffn.down", f"{theirs}.mlp.c_proj", kind="t"),
            ]
        rules += _norm("decoder.final_norm", "ln_f")
        if not config.tie_word_embeddings:
            rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
        return rules

    def tied_aliases(self, config):
        return {"lm_head.weight": "wte.weight"}


class T5(Family):
    model_type = "t5"
    ignored = (
        # transformers creates it, no layer reads it: cross-attention has no position bias
        r"^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$",
    )

    def config_from_hf(self, hf, weights):
        if "decoder.final_layer_norm.weight" not in weights:
            raise ValueError("a T5 checkpoint without a decoder (T5EncoderModel) is not supported")
        _refuse(hf, "t5", is_decoder=(False,))
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
            "gelu_tanh" if projection == "gated-gelu" else _activation({"act": parts[-1]}, "act", "relu")
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
            tie_word_embeddings=_is_tied(weights, "lm_head.weight", "shared.weight", hf, True),
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
        _require(
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
        if config.kv_heads != config.n_heads:
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
            "d_kv": config.dim_per_head,
            "d_ff": config.d_ff,
            "num_layers": config.n_layers,
            "num_decoder_layers": config.decoder_layers,
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
        for stack, n_layers in (("encoder", config.n_layers), ("decoder", config.decoder_layers)):
            table = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
            rules.append(Rule(f"{stack}.positions.table.weight", (table,)))
            for i in range(n_layers):
                ours, theirs = f"{stack}.blocks.{i}", f"{stack}.block.{i}.layer"
                attention = f"{theirs}.0.SelfAttention"
                rules += [
                    *_norm(f"{ours}.attn_norm", f"{theirs}.0.layer_norm", bias=False),
                    *_fused(f"{ours}.attn.qkv", [f"{attention}.{p}" for p in "qkv"], bias=False),
                    *_linear(f"{ours}.attn.out", f"{attention}.o", bias=False),
                ]
                ffn_index = 1
                if stack == "decoder":
                    cross = f"{theirs}.1.EncDecAttention"
                    rules += [
                        *_norm(f"{ours}.cross_norm", f"{theirs}.1.layer_norm", bias=False),
                        *_linear(f"{ours}.cross_attn.q", f"{cross}.q", bias=False),
                        *_fused(f"{ours}.cross_attn.kv", [f"{cross}.k", f"{cross}.v"], bias=False),
                        *_linear(f"{ours}.cross_attn.out", f"{cross}.o", bias=False),
                    ]
                    ffn_index = 2
                ffn = f"{theirs}.{ffn_index}.DenseReluDense"
                rules += _norm(f"{ours}.ffn_norm", f"{theirs}.{ffn_index}.layer_norm", bias=False)
                if config.gated_ffn:
                    rules += _linear(f"{ours}.ffn.gate", f"{ffn}.wi_0", bias=False)
                    rules += _linear(f"{ours}.ffn.up", f"{ffn}.wi_1", bias=False)
                else:
                    rules += _linear(f"{ours}.ffn.up", f"{ffn}.wi", bias=False)
                rules += _linear(f"{ours}.ffn.down", f"{ffn}.wo", bias=False)
            rules += _norm(f"{stack}.final_norm", f"{stack}.final_layer_norm", bias=False)
        if not config.tie_word_embeddings:
            rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
        return rules

    def tied_aliases(self, config):
        return {"lm_head.weight": "shared.weight"}


class Llama(Family):
    model_type = "llama"
    ignored = (r"^layers\.\d+\.self_attn\.rotary_emb\.inv_freq$",)  # a buffer of old files

    def strip_prefix(self, weights):
        return _strip(weights, "model.")

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
            activation=_activation(hf, "hidden_act", "silu"),
            gated_ffn=True,
            attention_bias=bool(hf.get("attention_bias", False)),
            ffn_bias=bool(hf.get("mlp_bias", False)),
            tie_word_embeddings=_is_tied(weights, "lm_head.weight", "embed_tokens.weight", hf, False),
            dropout=0.0,
            attention_dropout=float(hf.get("attention_dropout", 0.0)),
            bos_token_id=hf.get("bos_token_id", 1),
            eos_token_id=hf.get("eos_token_id", 2),
            pad_token_id=hf.get("pad_token_id"),
            hf_model_type="llama",
        )

    def config_to_hf(self, config):
        _require(
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
            "num_key_value_heads": config.kv_heads,
            "head_dim": config.dim_per_head,
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
                *_norm(f"{ours}.attn_norm", f"{theirs}.input_layernorm", bias=False),
                *_fused(f"{ours}.attn.qkv", [f"{attention}.{p}_proj" for p in "qkv"], config.attention_bias),
                *_linear(f"{ours}.attn.out", f"{attention}.o_proj", config.attention_bias),
                *_norm(f"{ours}.ffn_norm", f"{theirs}.post_attention_layernorm", bias=False),
                *_linear(f"{ours}.ffn.gate", f"{theirs}.mlp.gate_proj", config.ffn_bias),
                *_linear(f"{ours}.ffn.up", f"{theirs}.mlp.up_proj", config.ffn_bias),
                *_linear(f"{ours}.ffn.down", f"{theirs}.mlp.down_proj", config.ffn_bias),
            ]
        rules += _norm("decoder.final_norm", "norm", bias=False)
        if not config.tie_word_embeddings:
            rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
        return rules

    def tied_aliases(self, config):
        return {"lm_head.weight": "embed_tokens.weight"}


FAMILIES: dict[str, Family] = {f.model_type: f for f in (Bert(), GPT2(), T5(), Llama())}


# ---- loading ----


def _family(model_type) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def _old_names(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """LayerNorm gamma/beta (TensorFlow-era files) -> weight/bias."""
    renamed = {}
    for name, tensor in weights.items():
        name = re.sub(r"(LayerNorm|layer_norm|ln_\w+)\.gamma$", r"\1.weight", name)
        name = re.sub(r"(LayerNorm|layer_norm|ln_\w+)\.beta$", r"\1.bias", name)
        renamed[name] = tensor
    return renamed


def from_pretrained(folder: str | Path, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """A flashformer model with the weights of a Hugging Face checkpoint folder.

    dtype: None keeps the dtype stored in the file (transformers' "auto").
    """
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    hf = json.loads(config_path.read_text())
    family = _family(hf.get("model_type"))
    weights = family.strip_prefix(_old_names(load_weights(folder)))
    config = family.config_from_hf(hf, weights)

    state, missing = {}, []
    for rule in family.rules(config):
        if any(name not in weights for name in rule.theirs):
            missing += [name for name in rule.theirs if name not in weights]
            continue
        state[rule.ours] = rule.load([weights.pop(name) for name in rule.theirs])
    if config.tie_word_embeddings:
        for alias in family.tied_aliases(config):
            weights.pop(alias, None)
    if missing:
        raise ValueError(
            f"the {family.model_type} checkpoint in {folder} lacks {len(missing)} tensors: {missing[:8]}"
        )
    unused = sorted(n for n in weights if not any(re.search(p, n) for p in family.ignored))
    if unused:
        raise ValueError(
            f"the {family.model_type} checkpoint in {folder} holds tensors flashformer has no place for "
            f"(an unsupported head or layer?): {unused[:8]}"
        )

    with torch.device("meta"):  # no random initialization, no memory until the weights arrive
        model = MODEL_CLASSES[config.arch](config)
    model.load_state_dict(state, strict=True, assign=True)
    for module in model.modules():  # buffers computed at construction (RoPE frequencies, ALiBi slopes)
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    model = model.to(dtype) if dtype is not None else model
    return model.eval()


# ---- saving ----


def save_pretrained(model: PreTrainedModel, folder: str | Path) -> None:
    """config.json + model.safetensors in the layout transformers reads."""
    config = model.config
    if config.hf_model_type is None:
        raise ValueError("this model has no Hugging Face counterpart (ModelConfig.hf_model_type is None)")
    if config.share_layers:
        raise ValueError("ModelConfig.share_layers=True cannot be saved as a Hugging Face model")
    family = _family(config.hf_model_type)
    hf_config = family.config_to_hf(config)

    ours = model.state_dict()
    theirs_shapes = _their_shapes(family, config)
    weights = {}
    for rule in family.rules(config):
        sizes = [theirs_shapes.get(name, 0) for name in rule.theirs]
        for name, tensor in zip(rule.theirs, rule.save(ours[rule.ours], sizes)):
            weights[name] = (
                tensor.detach().contiguous().clone()
            )  # own storage: safetensors refuses shared tensors
    weights = family.add_prefix(weights, config)

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf_config["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def _their_shapes(family: Family, config: ModelConfig) -> dict[str, int]:
    """Rows of each fused part, to split our fused projections back."""
    q_rows = config.n_heads * config.dim_per_head
    kv_rows = config.kv_heads * config.dim_per_head
    sizes = {}
    for rule in family.rules(config):
        if rule.kind != "cat":
            continue
        parts = [q_rows, kv_rows, kv_rows] if len(rule.theirs) == 3 else [kv_rows, kv_rows]
        sizes.update(zip(rule.theirs, parts))
    return sizes
