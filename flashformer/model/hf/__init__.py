"""Hugging Face checkpoints in and out: bert, gpt2, t5 (v1.0 and v1.1), llama, qwen2, phi3,
qwen3, gemma, gemma2, gemma3_text.

    config, state = read_pretrained("path/to/folder")      # config.json + weights, in our names
    save_pretrained(model, "path/to/out")                  # transformers loads it back
    hf_config, weights = to_hf(model)                      # the same, in memory

(flashformer.from_pretrained builds the model from what read_pretrained gives.)

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
  rotary inv_freq buffers. Qwen2: LLaMA with q/k/v biases and none on o_proj.
  Phi-3: q, k, v fused in qkv_proj, gate and up in gate_up_proj, partial rotary.

A config option whose value changes the computation and that flashformer
does not implement raises a ValueError naming it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from flashformer.formatting import markdown_table
from flashformer.model.config import ModelConfig, preset
from flashformer.model.hf.bert import Bert
from flashformer.model.hf.gemma import Gemma
from flashformer.model.hf.gpt2 import GPT2
from flashformer.model.hf.llama import Llama
from flashformer.model.hf.mapping import Family
from flashformer.model.hf.phi3 import Phi3
from flashformer.model.hf.qwen2 import Qwen2
from flashformer.model.hf.qwen3 import Qwen3
from flashformer.model.hf.t5 import T5

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


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Bert(),
        GPT2(),
        T5(),
        Llama(),
        Qwen2(),
        Phi3(),
        Qwen3(),
        Gemma("gemma", 1),
        Gemma("gemma2", 2),
        Gemma("gemma3_text", 3),
    )
}


# ---- reading ----


def family(model_type) -> Family:
    """The family of a config.json's model_type; a ValueError names the supported ones."""
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


def _read_config_json(folder: Path) -> dict:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    return json.loads(config_path.read_text())


def config_from_hf(hf: dict, folder: str | Path) -> ModelConfig:
    """Our config for the values of a Hugging Face config.json. The heads and
    the tying are read off the weights in `folder` where there are any (as
    loading does); without weights, the family's defaults."""
    folder = Path(folder)
    layout = family(hf.get("model_type"))
    has_weights = any(folder.glob("*.safetensors")) or any(folder.glob("pytorch_model*.bin"))
    weights = _old_names(load_weights(folder)) if has_weights else {}
    return layout.config_from_hf(hf, layout.strip_prefix(weights))


def read_pretrained(folder: str | Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(our config, our state dict) from a Hugging Face checkpoint folder.

    Every parameter of the model must come from the file and every tensor of
    the file must find a place (buffers and aliases excepted, per family):
    a mapping mistake or an unsupported head is an error, never a silently
    different model.
    """
    folder = Path(folder)
    hf = _read_config_json(folder)
    return state_from_hf(hf, load_weights(folder), str(folder))


def state_from_hf(hf: dict, weights: dict[str, Tensor], source: str) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(our config, our state dict) from a config.json's values and the tensors
    under transformers' names; `source` names where they came from in errors."""
    layout = family(hf.get("model_type"))
    weights = layout.strip_prefix(_old_names(weights))
    config = layout.config_from_hf(hf, weights)
    state, missing = {}, []
    for rule in layout.rules(config):
        if any(name not in weights for name in rule.theirs):
            missing += [name for name in rule.theirs if name not in weights]
            continue
        state[rule.ours] = rule.load([weights.pop(name) for name in rule.theirs])
    if config.tie_word_embeddings:
        for alias in layout.tied_aliases(config):
            weights.pop(alias, None)
    if missing:
        raise ValueError(
            f"the {layout.model_type} checkpoint in {source} lacks {len(missing)} tensors: {missing[:8]}"
        )
    unused = sorted(n for n in weights if not any(re.search(p, n) for p in layout.ignored))
    if unused:
        raise ValueError(
            f"the {layout.model_type} checkpoint in {source} holds tensors flashformer has no place for "
            f"(an unsupported head or layer?): {unused[:8]}"
        )
    return config, state


# ---- saving ----


def save_pretrained(model: torch.nn.Module, folder: str | Path) -> None:
    """config.json + model.safetensors in the layout transformers reads."""
    hf_config, weights = to_hf(model)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def to_hf(model: torch.nn.Module) -> tuple[dict, dict[str, Tensor]]:
    """(config.json's values, the tensors under transformers' names): what save_pretrained
    writes, in memory (the GGUF writer maps these onto llama.cpp's names)."""
    config = model.config
    if config.hf_model_type is None:
        raise ValueError("this model has no Hugging Face counterpart (ModelConfig.hf_model_type is None)")
    if config.share_layers:
        raise ValueError("ModelConfig.share_layers=True cannot be saved as a Hugging Face model")
    layout = family(config.hf_model_type)
    hf_config = layout.config_to_hf(config)

    ours = model.state_dict()
    theirs_shapes = _their_shapes(layout, config)
    weights = {}
    for rule in layout.rules(config):
        sizes = [theirs_shapes.get(name, 0) for name in rule.theirs]
        for name, tensor in zip(rule.theirs, rule.save(ours[rule.ours], sizes)):
            # each tensor on the CPU with storage of its own: safetensors refuses shared storage
            weights[name] = tensor.detach().cpu().contiguous().clone()
    weights = layout.add_prefix(weights, config)
    hf_config["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    return hf_config, weights


def _their_shapes(layout: Family, config: ModelConfig) -> dict[str, int]:
    """Rows of each fused part, to split our fused projections back."""
    q_rows = config.n_heads * config.head_dim
    kv_rows = config.n_kv_heads * config.head_dim
    sizes = {}
    for rule in layout.rules(config):
        if rule.kind != "cat":
            continue
        parts = [q_rows, kv_rows, kv_rows] if len(rule.theirs) == 3 else [kv_rows, kv_rows]
        sizes.update(zip(rule.theirs, parts))
    return sizes


def names_table() -> str:
    """Our parameter names against those in an HF checkpoint file, for one layer
    of each family, from flashformer.model.hf's rules (and its prefixes: "bert.",
    "transformer.", "model.")."""

    sections = []
    configs = {
        "bert": preset("bert-tiny", n_layers=1),
        "gpt2": preset("gpt2-tiny", n_layers=1),
        "t5": preset("t5-tiny", n_layers=1, n_decoder_layers=1),
        "llama": preset("llama-tiny", n_layers=1),
        "qwen2": preset(
            "llama-tiny", n_layers=1, hf_model_type="qwen2", attention_bias=True, attention_out_bias=False
        ),
        "phi3": preset("llama-tiny", n_layers=1, hf_model_type="phi3", fused_gate_up=True),
        "qwen3": preset("llama-tiny", n_layers=1, qk_norm=True, hf_model_type="qwen3"),
    }
    gemma = dict(
        n_layers=1,
        activation="gelu_tanh",
        tie_word_embeddings=True,
        scale_embeddings=True,
        hf_model_type="gemma",
    )
    configs["gemma"] = preset("llama-tiny", **gemma)
    gemma.update(sandwich_norm=True, sliding_window=4, layer_types=("sliding_attention",))
    configs["gemma2"] = preset("llama-tiny", **dict(gemma, hf_model_type="gemma2"))
    configs["gemma3_text"] = preset("llama-tiny", **dict(gemma, qk_norm=True, hf_model_type="gemma3_text"))
    for family, config in configs.items():
        layout = FAMILIES[family]
        rules = layout.rules(config)
        # the names as a checkpoint file holds them, with the family's prefixes
        in_file = {
            name: next(iter(layout.add_prefix({name: None}, config))) for r in rules for name in r.theirs
        }
        rows = [[f"`{rule.ours}`", ", ".join(f"`{in_file[name]}`" for name in rule.theirs)] for rule in rules]
        sections.append(f"**{family}**\n\n" + markdown_table(["flashformer", "transformers"], rows))
    return "\n\n".join(sections)
