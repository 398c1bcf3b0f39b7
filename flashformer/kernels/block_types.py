"""GGUF's tensor types, one row each, as ggml's type traits describe them: the name, the id a
file stores, the values and bytes of a block, and the packed layout whose kernels serve it
(layouts.py). Whatever needs a fact about a type reads it here: the quantized layers, the GGUF
reader and writer, the KV cache's q8_0 / q4_0 blocks.

    row = TYPES["Q4_K"]         # BlockType(name="Q4_K", ggml_id=12, block_values=256, block_bytes=144, layout="q4_k")
    row.row_bytes(2048)         # 1152: bytes of a row of 2048 values
    fmt, qweight, scales = parse_gguf_blocks("Q4_K", raw, (out_features, in_features))
    weight = row.to_float(raw, (out_features, in_features))   # the float32 values the blocks mean

Rows without a layout are read as float32 at load (the float types, and Q2_K / Q3_K, which no
kernel here serves). The types gguf knows beyond these (IQ*, TQ*, NVFP4, integers) are not read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from flashformer.kernels import gguf_blocks
from flashformer.kernels.gguf_blocks import SUPER_BLOCK
from flashformer.kernels.layouts import BLOCK, LAYOUTS, pack_int4, pack_int5, pack_int8

_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class BlockType:
    """One GGUF tensor type (ggml's type traits)."""

    name: str  # GGUF's name, "Q4_K"
    ggml_id: int  # its id in a file's tensor table (gguf.GGMLQuantizationType)
    block_values: int  # values per block (1 for the float types)
    block_bytes: int  # bytes per block
    layout: str | None = None  # the packed layout a quantized layer holds it in; None: read as float32

    @property
    def quantized(self) -> bool:
        return self.name not in _FLOAT_DTYPES

    def row_bytes(self, values: int) -> int:
        """Bytes of a row of `values` values (a whole number of blocks)."""
        if values % self.block_values:
            raise ValueError(
                f"{self.name} stores rows of whole blocks of {self.block_values} values; got {values}"
            )
        return values // self.block_values * self.block_bytes

    def to_float(self, raw, shape: tuple[int, int]) -> Tensor:
        """The reference dequantization: a (N, K) tensor's bytes -> float32 (N, K), the values gguf's
        dequantizer gives. Types with a layout go through it (the tests hold it to gguf's)."""
        n, k = _check_shape("shape", shape)
        if not self.quantized:
            return to_bytes(raw).view(_FLOAT_DTYPES[self.name]).float().reshape(n, k)
        if self.layout is None:  # no kernel of ours reads it: gguf's own dequantizer
            import gguf.quants

            values = gguf.quants.dequantize(to_bytes(raw).numpy(), gguf.GGMLQuantizationType(self.ggml_id))
            return torch.from_numpy(np.ascontiguousarray(values)).reshape(n, k)
        fmt, qweight, scales = parse_gguf_blocks(self.name, raw, shape)
        return LAYOUTS[fmt].dequantize(qweight, scales)[:n, :k]


# the order is the one the reader's error messages list: the floats, then the block types
TYPES = {
    row.name: row
    for row in (
        BlockType("F32", 0, 1, 4),
        BlockType("F16", 1, 1, 2),
        BlockType("BF16", 30, 1, 2),
        BlockType("Q4_0", 2, BLOCK, 2 + BLOCK // 2, "int4"),
        BlockType("Q4_1", 3, BLOCK, 4 + BLOCK // 2, "int4"),
        BlockType("Q5_0", 6, BLOCK, 6 + BLOCK // 2, "int5"),
        BlockType("Q5_1", 7, BLOCK, 8 + BLOCK // 2, "int5"),
        BlockType("Q8_0", 8, BLOCK, 2 + BLOCK, "int8"),
        BlockType("Q2_K", 10, SUPER_BLOCK, 84),
        BlockType("Q3_K", 11, SUPER_BLOCK, 110),
        BlockType("Q4_K", 12, SUPER_BLOCK, 144, "q4_k"),
        BlockType("Q5_K", 13, SUPER_BLOCK, 176, "q5_k"),
        BlockType("Q6_K", 14, SUPER_BLOCK, 210, "q6_k"),
        BlockType("MXFP4", 39, BLOCK, 1 + BLOCK // 2, "mxfp4"),
    )
}
GGUF_TYPES = tuple(name for name, row in TYPES.items() if row.layout)  # what the quantized layers take


def to_bytes(raw) -> Tensor:
    """A tensor's raw bytes as a uint8 tensor: gguf.GGUFReader's read-only arrays are copied
    (numpy memory-maps them), torch tensors taken as they are."""
    data = raw if isinstance(raw, Tensor) else torch.from_numpy(np.array(raw, copy=True))
    if data.dtype != torch.uint8:
        raise ValueError(f"raw_uint8_blocks: expected uint8 bytes, got dtype {data.dtype}")
    return data.contiguous()


def parse_gguf_blocks(type_name: str, raw, shape: tuple[int, int]) -> tuple[str, Tensor, Tensor | None]:
    """Raw GGUF blocks of a (N, K) tensor (torch order: GGUF's ne reversed) -> (format, qweight, scales).

    raw: the tensor's bytes (uint8, any shape: gguf.GGUFReader's tensor.data is (N, bytes per row);
    a numpy array is copied, GGUFReader's are read-only views of the mapped file; a torch tensor
    is used as it is). Q4_0 becomes Q4_1 with m = -8 d and Q5_0 Q5_1 with m = -16 d, exact in
    float16 (multiplications by powers of two). K-quants and MXFP4 keep their bytes (scales None)."""
    if type_name not in GGUF_TYPES:
        raise ValueError(f"type_name: expected one of {GGUF_TYPES}, got {type_name!r}")
    row = TYPES[type_name]
    n, k = _check_shape("shape", shape)
    if k % row.block_values:
        raise ValueError(
            f"shape: in_features must be a multiple of {row.block_values} for {type_name}, got shape {tuple(shape)}"
        )
    data = to_bytes(raw)
    block_bytes, blocks = row.block_bytes, k // row.block_values
    if data.numel() != n * blocks * block_bytes:
        raise ValueError(
            f"raw_uint8_blocks: a {type_name} tensor of shape {tuple(shape)} takes {n * blocks * block_bytes} "
            f"bytes ({n} x {blocks} blocks of {block_bytes}), got {data.numel()} (shape {tuple(data.shape)})"
        )
    if LAYOUTS[row.layout].in_place:
        # the bytes as given, not a copy: a GGUF file's own, used in place from its map (the
        # loader unmaps the pages it read to repack the other types, which a copy once did:
        # checkpoints.gguf.header.FileMapping.drop_resident_pages)
        return row.layout, data.view(n, blocks, block_bytes), None
    data = data.reshape(n, blocks, block_bytes)
    if row.layout == "int5":
        return ("int5", *pack_int5(*gguf_blocks.parse_int5(type_name, data)))
    d = data[..., :2].view(torch.float16).squeeze(-1)  # (N, blocks), a strided view of the blocks
    if type_name == "Q8_0":
        return ("int8", *pack_int8(data[..., 2:].view(torch.int8), d))  # quants (N, blocks, 32), strided
    if type_name == "Q4_1":
        m = data[..., 2:4].view(torch.float16).squeeze(-1)
        return ("int4", *pack_int4(d, m, data[..., 4:]))
    m = d * -8
    if not torch.isfinite(m).all():
        raise ValueError("raw_uint8_blocks: a Q4_0 scale d is too large for m = -8 d in float16")
    return ("int4", *pack_int4(d, m, data[..., 2:]))


def _check_shape(name: str, shape) -> tuple[int, int]:
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"{name}: expected (out_features, in_features), both >= 1, got {tuple(shape)}")
    return int(shape[0]), int(shape[1])
