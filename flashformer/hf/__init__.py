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
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from flashformer.config import ModelConfig
from flashformer.hf.bert import Bert
from flashformer.hf.gpt2 import GPT2
from flashformer.hf.llama import Llama
from flashformer.hf.mapping import Family
from flashformer.hf.t5 import T5
from flashformer.models import MODEL_CLASSES, PreTrainedModel

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
            # each tensor on the CPU with storage of its own: safetensors refuses shared storage
            weights[name] = tensor.detach().cpu().contiguous().clone()
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
