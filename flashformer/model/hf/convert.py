"""Our config and state dict from a Hugging Face checkpoint (read_pretrained, state_from_hf,
config_from_hf), and back (to_hf, save_pretrained), through the family's rules: nothing
missing, nothing left over (see the package docstring for the traps)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from flashformer.model.config import ModelConfig
from flashformer.model.hf.families import family
from flashformer.model.hf.mapping import Family
from flashformer.model.hf.weight_files import load_weights


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
    theirs_shapes = fused_part_rows(layout, config)
    weights = {}
    for rule in layout.rules(config):
        sizes = [theirs_shapes.get(name, 0) for name in rule.theirs]
        for name, tensor in zip(rule.theirs, rule.save(ours[rule.ours], sizes)):
            # each tensor on the CPU with storage of its own: safetensors refuses shared storage
            weights[name] = tensor.detach().cpu().contiguous().clone()
    weights = layout.add_prefix(weights, config)
    hf_config["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    return hf_config, weights


def fused_part_rows(layout: Family, config: ModelConfig) -> dict[str, int]:
    """Rows of each fused part (their q_proj's rows in our qkv...), to split our fused projections
    back (saving) and to place an adapter of one part in its rows (adapters/); a layer's own head
    width: Gemma 4's full layers are wider, its KV-shared layers have q alone."""
    sizes = {}
    for rule in layout.rules(config):
        if rule.kind != "cat":
            continue
        layer = re.search(r"blocks\.(\d+)\.", rule.ours)
        head_dim = config.head_dim if layer is None else config.layer_head_dim(int(layer.group(1)))
        q_rows, kv_rows = config.n_heads * head_dim, config.n_kv_heads * head_dim
        parts = {1: [q_rows], 2: [kv_rows, kv_rows], 3: [q_rows, kv_rows, kv_rows]}[len(rule.theirs)]
        sizes.update(zip(rule.theirs, parts))
    return sizes
