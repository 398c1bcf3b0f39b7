"""A model as a GGUF file (llama.cpp's format), for llama.cpp, ollama and flashformer itself.

    write_gguf("model.gguf", hf_config, tensor, tokenizer, file_type="q4_k_m")

The model comes as transformers sees it: config.json's values and a function giving each tensor
by its transformers name (model.hf.to_hf of a loaded model, or tensors made one at a time for
a model too large to hold twice). What the file holds follows llama.cpp's converter and its
quantizer:

- names and shapes: the reader's table (the architecture's tensors()) read backwards, so that a file
  written here is, by construction, one the reader accepts; the q/k rows of llama go from
  transformers' rotate-half order to llama.cpp's interleaved pairs (the inverse of
  rope_row_permutation), GPT-2's Conv1D weights are transposed to (out, in);
- metadata: the family's writer in architectures.WRITERS, beside its reader in the
  architecture's module (the GGUF architecture's keys from config.json; Llama 3.1's RoPE
  scaling as the rope_freqs.weight tensor llama.cpp reads);
- types (file_type): "f16" and "q8_0" as convert_hf_to_gguf.py writes them (vectors and
  position tables F32, the other matrices F16 or Q8_0), "q4_k_m" as llama-quantize's
  Q4_K_M mix (tensor_type below);
- the tokenizer and chat templates (tokenizer_writer.py).

The file is written beside its place and renamed into it when complete (files.atomic_path),
tensor by tensor: one tensor's float and quantized copies are in memory at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, LlamaFileType
from torch import Tensor
from tqdm import tqdm

from flashformer.checkpoints.gguf.architectures import ARCHITECTURES, WRITERS
from flashformer.checkpoints.gguf.common import TensorSpec, rope_row_permutation
from flashformer.checkpoints.gguf.kquant_quantize import BLOCK_BYTES, quantize_k
from flashformer.checkpoints.gguf.tokenizer_writer import tokenizer_metadata
from flashformer.files import atomic_path
from flashformer.kernels.block_types import TYPES

FILE_TYPES = {
    "f16": LlamaFileType.MOSTLY_F16,
    "q8_0": LlamaFileType.MOSTLY_Q8_0,
    "q4_k_m": LlamaFileType.MOSTLY_Q4_K_M,
}
QUANTIZATION_VERSION = 2  # ggml's GGML_QNT_VERSION, which llama-quantize writes

# llama.cpp's fallback when a row is not a whole number of the type's blocks (tensor_type_fallback)
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "Q8_0": "F16"}


# ---- which type each tensor gets ----


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's Q4_K_M rule for attn_v and ffn_down: the first and last eighth of the layers
    and every third one between them get Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(spec: TensorSpec, file_type: str, layers: int, tied: bool) -> str:
    """The ggml type of one tensor in a file of `file_type`, as llama.cpp's converter (f16, q8_0)
    and llama-quantize (q4_k_m, starting from an f16 file) choose it.

    Simplifications: the rules of llama-quantize for Falcon, mixtures of experts and 70B models
    are left out (none of them is written here)."""
    name, cols = spec.gguf, spec.shape[-1]
    if len(spec.shape) == 1 or name.endswith("_norm.weight") or name == "position_embd.weight":
        return "F32"  # vectors, norms, learned positions: never quantized
    if file_type == "f16":
        return "F16"
    if file_type == "q8_0":
        return _fit("Q8_0", cols)
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return _fit("Q6_K" if cols % 256 == 0 else "Q8_0", cols)
    chosen = "Q4_K"
    match = re.match(r"blk\.(\d+)\.", name)
    layer = int(match.group(1)) if match else 0
    if name.endswith("attn_v.weight") and use_more_bits(layer, layers):
        chosen = "Q6_K"
    elif name.endswith("attn_qkv.weight"):
        chosen = "Q5_K"
    elif name.endswith("ffn_down.weight") and use_more_bits(layer, layers):
        chosen = "Q6_K"
    return _fit(chosen, cols)


def _fit(ggml_type: str, cols: int) -> str:
    """The type, or llama.cpp's fallback while a row is not a whole number of its blocks."""
    while ggml_type in FALLBACK and cols % TYPES[ggml_type].block_values:
        ggml_type = FALLBACK[ggml_type]
    return ggml_type


def encode(values: Tensor, ggml_type: str) -> np.ndarray:
    """(rows, cols) or (n,) float values as the file stores them in `ggml_type`."""
    if ggml_type == "F32":
        return values.detach().to(torch.float32).contiguous().numpy()
    if ggml_type == "F16":
        return values.detach().to(torch.float16).contiguous().numpy()
    if ggml_type in BLOCK_BYTES:
        return quantize_k(values, ggml_type)
    floats = values.detach().to(torch.float32).contiguous().numpy()
    return gguf.quants.quantize(floats, GGMLQuantizationType[ggml_type])  # Q8_0, Q5_0, Q5_1


def file_tensor(spec: TensorSpec, values: Tensor) -> Tensor:
    """transformers' tensor in the file's layout: Conv1D (in, out) transposed, llama's q/k rows
    interleaved per head for ggml's RoPE (the inverse of the reader's rope_row_permutation)."""
    if spec.conv1d:
        values = values.t()
    if spec.rope_heads:
        order = rope_row_permutation(values.shape[0], spec.rope_heads)  # transformers = file[order]
        values = values[torch.argsort(order)]
    if tuple(values.shape) != spec.shape:
        raise ValueError(
            f"tensor {spec.hf!r} has shape {tuple(values.shape)}; {spec.gguf} needs {spec.shape}"
        )
    return values


# ---- the file ----


def write_gguf(
    path: str | Path,
    hf_config: dict,
    tensor: Callable[[str], Tensor],
    tokenizer,
    file_type: str = "f16",
    name: str | None = None,
    source: str = "the model",
    show_progress: bool = True,
) -> dict[str, str]:
    """Write the model as a GGUF file at `path` (whole or not at all); returns {GGUF tensor
    name: ggml type}.

    hf_config: config.json's values (model.hf.to_hf gives them complete); tensor: a transformers
    name -> its float tensor, called once per tensor, in file order; tokenizer: a
    text.tokenizer.Tokenizer. Raises ValueError naming `source` for a family, option or
    tokenizer that cannot be written, and for an unknown file_type."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type must be one of {', '.join(FILE_TYPES)}; got {file_type!r}")
    model_type = hf_config.get("model_type")
    if model_type not in WRITERS:
        raise ValueError(
            f"{source}: a {model_type!r} model cannot be written to GGUF (supported: {', '.join(sorted(WRITERS))})"
        )
    writer = WRITERS[model_type]
    metadata = writer.metadata(hf_config)
    metadata.update(tokenizer_metadata(tokenizer, hf_config["vocab_size"], source))
    specs = ARCHITECTURES[writer.architecture].tensors(hf_config)
    extra = {spec.gguf: writer.extra_tensor(spec, hf_config) for spec in specs if spec.hf is None}
    specs = [spec for spec in specs if spec.hf is not None or extra[spec.gguf] is not None]
    layers = int(metadata[f"{writer.architecture}.block_count"])
    tied = not any(spec.gguf == "output.weight" for spec in specs)
    types = {spec.gguf: tensor_type(spec, file_type, layers, tied) for spec in specs}

    with atomic_path(path) as tmp:
        out = gguf.GGUFWriter(tmp, writer.architecture)
        try:
            out.add_name(name or Path(path).stem)
            out.add_file_type(int(FILE_TYPES[file_type]))
            out.add_quantization_version(QUANTIZATION_VERSION)
            for key, value in metadata.items():
                _add_value(out, key, value)
            for spec in specs:
                _add_tensor_info(out, spec, types[spec.gguf])
            out.write_header_to_file()
            out.write_kv_data_to_file()
            out.write_ti_data_to_file()
            for spec in tqdm(
                specs, desc=f"writing {Path(path).name}", unit="tensor", disable=not show_progress
            ):
                values = tensor(spec.hf) if spec.hf is not None else extra[spec.gguf]
                data = encode(file_tensor(spec, values), types[spec.gguf])
                out.write_tensor_data(data)
        finally:
            out.close()
    return types


def _add_tensor_info(out: gguf.GGUFWriter, spec: TensorSpec, ggml_type: str) -> None:
    kind = GGMLQuantizationType[ggml_type]
    block, block_bytes = TYPES[ggml_type].block_values, TYPES[ggml_type].block_bytes
    count = int(np.prod(spec.shape))
    if ggml_type in ("F32", "F16"):
        dtype = np.float32 if ggml_type == "F32" else np.float16
        out.add_tensor_info(spec.gguf, spec.shape, np.dtype(dtype), count * np.dtype(dtype).itemsize)
        return
    byte_shape = (*spec.shape[:-1], spec.shape[-1] // block * block_bytes)
    out.add_tensor_info(
        spec.gguf, byte_shape, np.dtype(np.uint8), count // block * block_bytes, raw_dtype=kind
    )


def _add_value(out: gguf.GGUFWriter, key: str, value) -> None:
    """A metadata value with the type llama.cpp reads it as (counts and ids uint32, reals float32)."""
    if isinstance(value, bool):
        out.add_bool(key, value)
    elif isinstance(value, int):
        out.add_uint32(key, value)
    elif isinstance(value, float):
        out.add_float32(key, value)
    elif isinstance(value, str):
        out.add_string(key, value)
    elif isinstance(value, list) and value:
        out.add_array(key, value)  # token types int32, tokens and merges strings
    elif isinstance(value, list):
        raise ValueError(f"metadata {key!r} is an empty list, which GGUF cannot store")
    else:
        raise TypeError(f"metadata {key!r}: {type(value).__name__} is not a GGUF value")
