"""A GGUF file of a supported architecture read as a Hugging Face checkpoint (GGUFCheckpoint):
transformers' config.json from the metadata, and every tensor under transformers' name, as
float32 (equal to transformers' GGUF load) and as the file's raw blocks. The meaning of each
architecture is architectures.ARCHITECTURES's; this module checks the file's tensor table
against it and reads the tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor
from tqdm import tqdm

from flashformer.checkpoints.gguf.architectures import ARCHITECTURES
from flashformer.checkpoints.gguf.common import TensorSpec, rope_row_permutation
from flashformer.checkpoints.gguf.header import FileMapping
from flashformer.checkpoints.gguf.reader import GGUFError, GGUFFile, QuantizedTensor, read_file


@dataclass
class GGUFCheckpoint:
    """A GGUF file read as a Hugging Face checkpoint; see the module docstring.

    tensors: float32 under transformers' names, in transformers' layouts (GPT-2's Conv1D (in, out)).
    With read_gguf(dequantize=False) it holds only the tensors stored as floats (norms, biases,
    F16 weights); the block-quantized ones are then only in `quantized`.
    """

    path: Path
    architecture: str
    config: dict
    tensors: dict[str, Tensor]
    quantized: dict[str, QuantizedTensor]
    metadata: dict[str, Any]
    mapping: FileMapping | None = None  # the file's map (None: a checkpoint made another way)

    def save_pretrained(self, folder: str | Path) -> Path:
        """config.json + model.safetensors, the folder transformers and flashformer.from_pretrained read."""
        missing = sorted(set(self.quantized) - set(self.tensors))
        if missing:
            raise ValueError(
                f"{self.path} was read with dequantize=False: {len(missing)} tensors exist only as quantized "
                f"blocks ({missing[:3]}...); read it with dequantize=True to save it"
            )
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        save_file(self.tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return folder


def read_gguf(path: str | Path, dequantize: bool = True, show_progress: bool = True) -> GGUFCheckpoint:
    """A GGUF file of a supported architecture (ARCHITECTURES) as a Hugging Face checkpoint.

    dequantize=False leaves block-quantized weights as blocks only (no float32 copy in memory).
    Raises GGUFError naming the file, and the tensor or metadata key, for a damaged file, an
    unsupported architecture or tensor type, and a tensor missing, unexpected or of a shape the
    metadata does not imply.
    """
    file = read_file(path)
    name = file.value("general.architecture", str)
    if name not in ARCHITECTURES:
        raise GGUFError(
            f"{file.path}: architecture {name!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    architecture = ARCHITECTURES[name]
    config = architecture.config(file)
    specs = architecture.tensors(config)
    _check_tensor_table(file, specs, architecture.summary(config))

    tensors, quantized = {}, {}
    for spec, hf_name, raw in tqdm(
        list(_weights(file, specs)),
        desc=f"reading {file.path.name}",
        unit="tensor",
        disable=not show_progress,
    ):
        rows = rope_row_permutation(raw.shape[0], spec.rope_heads) if spec.rope_heads else None
        if raw.is_quantized and (spec.plus_one or spec.hf_shape):
            raise GGUFError(
                f"{file.path}: tensor {spec.gguf!r} is stored as {raw.ggml_type}; a norm stored as 1 + w "
                f"or a convolution's filter must be F32, F16 or BF16 (llama.cpp writes them as floats)"
            )
        if raw.is_quantized:
            if rows is None:
                blocks = raw.to_blocks()  # (out, bytes per row) uint8, a view of the map
            else:  # a copy, its rows reordered: numpy's take copies whole rows (0.5 ms for the
                # 1B-shape file's 2.4 MB q, where torch's indexing took 20-30 ms)
                blocks = torch.from_numpy(np.take(raw.data, rows.numpy(), axis=0))
            quantized[hf_name] = QuantizedTensor(raw.ggml_type, raw.shape, blocks, rows, spec.conv1d)
            if not dequantize:
                continue
        values = raw.to_float()
        if spec.plus_one:
            values = values - 1  # transformers' w (as its GGUF loader subtracts it)
        if rows is not None:
            values = values[rows]
        if spec.hf_shape is not None:
            values = values.reshape(spec.hf_shape)
        tensors[hf_name] = values.t().contiguous() if spec.conv1d else values  # Conv1D: (in, out)
    return GGUFCheckpoint(file.path, name, config, tensors, quantized, file.metadata, file.mapping)


def _weights(file: GGUFFile, specs: list[TensorSpec]):
    """(spec, transformers' name, the file's tensor) of every weight: an expert tensor gives one
    per expert, its matrix a view of the file's bytes (its blocks sliced, never dequantized)."""
    for spec in specs:
        if spec.hf is None:  # read into the config, not a weight
            continue
        raw = file.tensors[spec.gguf]
        if not spec.experts:
            yield spec, spec.hf, raw
            continue
        for index in range(spec.experts):
            yield spec, spec.hf.format(expert=index), raw.expert(index)


def _check_tensor_table(file: GGUFFile, specs: list[TensorSpec], summary: str) -> None:
    """Every tensor the metadata implies is present with the implied shape, and nothing else is."""
    expected = {spec.gguf for spec in specs}
    missing = [spec.gguf for spec in specs if spec.gguf not in file.tensors and not spec.optional]
    if missing:
        raise GGUFError(
            f"{file.path}: tensor {missing[0]!r} is missing"
            + (f" (and {len(missing) - 1} more: {missing[1:4]})" if len(missing) > 1 else "")
            + f"; the metadata describes a model with it ({summary})"
        )
    unexpected = [name for name in file.tensors if name not in expected]
    if unexpected:
        raise GGUFError(
            f"{file.path}: tensor {unexpected[0]!r} has no place in the model the metadata describes "
            f"({summary}); unexpected tensors: {unexpected[:5]}"
        )
    for spec in specs:
        if spec.gguf not in file.tensors:  # optional
            continue
        raw = file.tensors[spec.gguf]
        if raw.shape != spec.shape:
            raise GGUFError(
                f"{file.path}: tensor {spec.gguf!r} ({spec.hf}) has shape {raw.shape}; the metadata implies "
                f"{spec.shape} ({summary})"
            )
        if spec.rope_heads and (raw.shape[0] % spec.rope_heads or (raw.shape[0] // spec.rope_heads) % 2):
            raise GGUFError(
                f"{file.path}: tensor {spec.gguf!r} has {raw.shape[0]} rows, which do not split into "
                f"{spec.rope_heads} heads of an even size (RoPE rotates pairs of dims)"
            )
