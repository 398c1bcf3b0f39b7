"""A checkpoint folder's weights, whatever the file: model.safetensors, a sharded
model.safetensors.index.json, pytorch_model.bin (torch.load(weights_only=True)) or a sharded
pytorch_model.bin.index.json."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor


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
