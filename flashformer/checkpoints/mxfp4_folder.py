"""gpt-oss Hugging Face folders as openai ships them (openai/gpt-oss-20b, -120b): config.json's
quantization_config {"quant_method": "mxfp4"}, and each layer's experts as MXFP4 blocks of 32
values beside their float biases:

    model.layers.{i}.mlp.experts.gate_up_proj_blocks  uint8 (experts, 2 ff, d / 32, 16)
    model.layers.{i}.mlp.experts.gate_up_proj_scales  uint8 (experts, 2 ff, d / 32)
    model.layers.{i}.mlp.experts.down_proj_blocks     uint8 (experts, d, ff / 32, 16)
    model.layers.{i}.mlp.experts.down_proj_scales     uint8 (experts, d, ff / 32)

Each expert's matrix is (out, in), as a Linear holds it (transformers' in-memory gate_up_proj is
its transpose), gate and up rows interleaved (gate at even rows). A block's scale is the e8m0
exponent e of 2^(e - 127); byte j of its 16 holds value 2j in the low nibble and 2j + 1 in the
high, e2m1 codes (bit 3 the sign). GGUF's MXFP4 block (kernels/gguf_blocks.py) holds the same
numbers in another order: the exponent first, then byte j holding values j and j + 16.

read_mxfp4_folder repacks every expert's blocks into GGUF's layout (a permutation of nibbles: no
value changes) and gives a GGUFCheckpoint of the folder: the loader then runs them as it runs a
GGUF file's MXFP4 experts (quantize="gguf", the default for such a folder: the MXFP4 kernels,
never dequantized) or dequantizes them (quantize=None: the float model, experts in the stored
biases' dtype, exact since every MXFP4 value is a float32 and bfloat16 number).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch import Tensor

from flashformer.checkpoints.gguf import GGUFCheckpoint, QuantizedTensor
from flashformer.kernels.gguf_blocks import dequantize_mxfp4
from flashformer.model import hf

MXFP4 = "mxfp4"
BLOCK = 32  # values per MXFP4 block
_PACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)_(blocks|scales)$")


def is_mxfp4_folder(config: dict) -> bool:
    """Whether a config.json's values describe a folder of MXFP4 experts (quant_method "mxfp4")."""
    return (config.get("quantization_config") or {}).get("quant_method") == MXFP4


def gguf_blocks(blocks: Tensor, scales: Tensor) -> Tensor:
    """openai's MXFP4 (rows, nb, 16) codes and (rows, nb) exponents -> GGUF's blocks (rows, nb * 17)
    uint8: per block the exponent, then byte j = value j | value j + 16 << 4."""
    rows, nb = scales.shape
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).reshape(rows, nb, BLOCK)  # values in order
    packed = codes[..., : BLOCK // 2] | (codes[..., BLOCK // 2 :] << 4)  # (rows, nb, 16)
    return torch.cat((scales.unsqueeze(-1), packed), dim=-1).reshape(rows, nb * (1 + BLOCK // 2))


def read_mxfp4_folder(folder: str | Path) -> GGUFCheckpoint:
    """A gpt-oss folder of MXFP4 experts (the module docstring) as a GGUFCheckpoint: `quantized`
    holds each expert's gate, up and down projection as GGUF MXFP4 blocks under the per-expert names
    the gpt_oss family maps (model.layers.{i}.mlp.experts.{e}.gate_proj.weight, ...), `tensors` every
    other tensor as stored, `config` config.json's values without the quantization_config.

    Raises ValueError naming the folder and the tensor or key at fault (another model type, a
    blocks tensor without its scales, a shape or dtype that is not MXFP4's)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if not is_mxfp4_folder(config):
        raise ValueError(f"{folder}/config.json: quantization_config.quant_method is not {MXFP4!r}")
    if config.get("model_type") != "gpt_oss":
        raise ValueError(
            f"{folder}/config.json: MXFP4 experts (quant_method {MXFP4!r}) are read for model_type 'gpt_oss'; "
            f"got model_type {config.get('model_type')!r}"
        )
    config = {key: value for key, value in config.items() if key != "quantization_config"}
    weights = hf.load_weights(folder)
    packed: dict[str, dict[str, Tensor]] = {}
    for name in [name for name in weights if _PACKED.match(name)]:
        prefix, projection, part = _PACKED.match(name).groups()
        packed.setdefault(f"{prefix}.{projection}", {})[part] = weights.pop(name)
    if not packed:
        raise ValueError(
            f"{folder}/config.json says quant_method {MXFP4!r}, but the weights hold no MXFP4 experts "
            f"(mlp.experts.gate_up_proj_blocks / _scales, down_proj_blocks / _scales)"
        )
    quantized = {}
    for fused in list(packed):  # each stored tensor dropped once repacked: the peak is one more
        blocks, scales = _checked(folder, fused, packed.pop(fused))
        prefix, projection = fused.rsplit(".", 1)
        for e in range(blocks.shape[0]):
            matrix = gguf_blocks(blocks[e], scales[e])  # (out, in / 32 * 17)
            shape = (scales.shape[1], scales.shape[2] * BLOCK)  # (out, in)
            if projection == "down_proj":
                quantized[f"{prefix}.{e}.down_proj.weight"] = QuantizedTensor("MXFP4", shape, matrix)
                continue
            half = (shape[0] // 2, shape[1])  # gate at even rows, up at odd ones
            for name, rows in (("gate_proj", matrix[0::2]), ("up_proj", matrix[1::2])):
                quantized[f"{prefix}.{e}.{name}.weight"] = QuantizedTensor("MXFP4", half, rows.contiguous())
    return GGUFCheckpoint(folder, "gpt_oss", config, weights, quantized, metadata={})


def dequantized(checkpoint: GGUFCheckpoint) -> dict[str, Tensor]:
    """Every tensor of read_mxfp4_folder's checkpoint as float, as transformers' dequantizing load
    gives them: its `tensors` as stored and each expert's blocks dequantized (kernels/gguf_blocks.py,
    exact) to (out, in) in the dtype of the experts' stored biases (the other weights')."""
    out = dict(checkpoint.tensors)
    dtype = next((t.dtype for name, t in out.items() if name.endswith("_proj_bias")), torch.float32)
    for name, tensor in checkpoint.quantized.items():
        rows = tensor.blocks.reshape(tensor.shape[0], -1, 1 + BLOCK // 2)  # (out, in / 32, 17)
        out[name] = dequantize_mxfp4(rows).to(dtype)  # (out, in)
    return out


def _checked(folder: Path, fused: str, parts: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(blocks (experts, out, in / 32, 16), scales (experts, out, in / 32)), both uint8, or a
    ValueError naming the tensor."""
    if set(parts) != {"blocks", "scales"}:
        missing = ({"blocks", "scales"} - set(parts)).pop()
        raise ValueError(
            f"{folder}: {fused}_{missing} is missing beside {fused}_{set(parts).pop()} (MXFP4 needs both)"
        )
    blocks, scales = parts["blocks"], parts["scales"]
    for part, tensor in parts.items():
        if tensor.dtype != torch.uint8:
            raise ValueError(f"{folder}: {fused}_{part} has dtype {tensor.dtype}; MXFP4 stores uint8")
    if blocks.dim() != 4 or blocks.shape[-1] != BLOCK // 2 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"{folder}: {fused}_blocks {tuple(blocks.shape)} and _scales {tuple(scales.shape)} are not MXFP4's "
            f"(experts, out, in / 32, 16) and (experts, out, in / 32)"
        )
    return blocks, scales
