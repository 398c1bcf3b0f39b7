"""A GGUF file opened: its metadata as Python values, and its tensors as float32 or as the raw
quantized blocks (views of the memory-mapped file), with errors that name the file and the tensor.

The header is parsed in header.py (gguf.GGUFReader took seconds over a large vocabulary); the
dequantization is gguf's (`gguf.quants.dequantize`), so our float weights are bit for bit the
ones transformers' GGUF loader produces.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flashformer.checkpoints.gguf.header import (
    VALUE_DTYPES,
    BadTensor,
    FileMapping,
    HeaderError,
    ShortRead,
    read_header,
)
from flashformer.kernels.block_types import TYPES

# Tensor types read here: kernels/block_types.py's rows, plain floats, the legacy block types, the
# K-quants and MXFP4. The others that gguf knows (IQ*, TQ*, NVFP4, integers) are refused by name
# rather than half-supported.
FLOAT_TYPES = tuple(name for name, row in TYPES.items() if not row.quantized)
BLOCK_TYPES = tuple(name for name, row in TYPES.items() if row.quantized)
SUPPORTED_TYPES = FLOAT_TYPES + BLOCK_TYPES


class GGUFError(ValueError):
    """A GGUF file that cannot become the model it describes (damaged, or something unsupported)."""


@dataclass(frozen=True)
class QuantizedTensor:
    """One weight as GGUF stores it: rows of quantized blocks, never re-rounded.

    A block covers `block_size` consecutive inputs of one output row (Q4_1: 32 weights as 4-bit
    codes with one scale and one minimum), so a weight of logical shape (out, in) is held as
    blocks (out, in // block_size * block_bytes) uint8, row r holding output row r. Reordering
    output rows therefore moves whole rows of blocks and never touches a block.

    shape is always (out, in), the nn.Linear orientation, even where transformers' tensor under
    the same name is (in, out) (GPT-2's Conv1D: hf_transposed=True).
    row_permutation: the q/k rows llama.cpp interleaved for its RoPE, already put back here:
    blocks[i] is the file's row row_permutation[i]. None when the rows are in the file's order.
    """

    ggml_type: str
    shape: tuple[int, ...]
    blocks: Tensor
    row_permutation: Tensor | None = None
    hf_transposed: bool = False

    @property
    def block_size(self) -> int:
        return TYPES[self.ggml_type].block_values

    @property
    def block_bytes(self) -> int:
        return TYPES[self.ggml_type].block_bytes

    def dequantize(self) -> Tensor:
        """float32 (out, in), exactly gguf's dequantization, rows in transformers' order."""
        return torch.from_numpy(_dequantize(self.blocks.numpy(), self.ggml_type))  # (out, in)


@dataclass(frozen=True)
class RawTensor:
    """One tensor of the file: its logical shape in torch order and its bytes (a view of the file)."""

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    data: np.ndarray  # float types: the values; block types: (*shape[:-1], bytes per row) uint8

    @property
    def is_quantized(self) -> bool:
        return self.ggml_type in BLOCK_TYPES

    def to_float(self) -> Tensor:
        """float32 of the logical shape, as gguf.quants.dequantize gives it."""
        values = _dequantize(self.data, self.ggml_type)
        if np.may_share_memory(values, self.data):  # F32 comes back as a view of the file map:
            values = values.copy()  # a tensor of our own, or the model would keep the map alive
        return torch.from_numpy(values.reshape(self.shape))

    def expert(self, index: int) -> RawTensor:
        """Expert `index`'s matrix of a 3-D expert tensor (experts, out, in), or its bias of a 2-D
        one (experts, out) (gpt-oss): a RawTensor of its own, (out, in) or (out,), whose data is a
        view of this one's bytes (blocks stay blocks)."""
        if len(self.shape) not in (2, 3) or not 0 <= index < self.shape[0]:
            raise GGUFError(f"tensor {self.name!r} of shape {self.shape} has no expert {index}")
        return RawTensor(f"{self.name}[{index}]", self.ggml_type, self.shape[1:], self.data[index])

    def to_blocks(self) -> Tensor:
        """The quantized blocks as a view of the mapped file, not a copy: (*shape[:-1], bytes per
        row) uint8, at the file's alignment (32 bytes by default; the kernels load unaligned).
        The map is copy-on-write: writing to the view would never reach the file."""
        return torch.from_numpy(self.data)


def _dequantize(data: np.ndarray, ggml_type: str) -> np.ndarray:
    """gguf.quants.dequantize, whose module is imported only for the block types (30-50 ms of a
    cold start): F32 and F16, the norms of a quantized load, converted as it converts them."""
    if ggml_type in VALUE_DTYPES:
        return data.view(VALUE_DTYPES[ggml_type]).astype(np.float32, copy=False)
    import gguf.quants

    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[ggml_type])


@dataclass(frozen=True)
class GGUFFile:
    """What a GGUF file holds, read once: metadata as Python values and the tensor table."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, RawTensor]
    mapping: FileMapping  # the map the tensors' data are views of

    def value(self, key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        """A metadata value of the expected kind; a missing key without a default is an error."""
        if key not in self.metadata:
            if default is ...:
                raise GGUFError(f"{self.path}: the metadata lacks {key!r}, which the model needs")
            return default
        value, kinds = self.metadata[key], kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            expected = " or ".join(k.__name__ for k in kinds)
            raise GGUFError(f"{self.path}: metadata {key!r} is {value!r}; expected a {expected}")
        return value


def read_file(path: str | Path) -> GGUFFile:
    """Open a GGUF file: its metadata and tensor table (tensor data stays in the file until used).

    Raises FileNotFoundError for a missing file and GGUFError for one that is not GGUF, is
    truncated (naming the tensor whose data is cut), or holds a tensor of an unsupported type.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    size = path.stat().st_size
    if size < 4:
        raise GGUFError(f"{path} is {size} bytes long: too short to be a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    try:
        header = read_header(path)
    except ShortRead as short:
        place = (
            f"the data of tensor {short.tensor!r}"
            if short.tensor
            else "its header (metadata or tensor table)"
        )
        raise GGUFError(
            f"{path} is truncated: {place} needs bytes up to {short.end}, but the file ends at {size} "
            f"(an interrupted download or copy?)"
        ) from None
    except BadTensor as bad:
        raise GGUFError(f"{path}: tensor {bad.tensor!r} cannot be read: {bad.reason}") from None
    except HeaderError as error:
        raise GGUFError(f"{path} is not a readable GGUF file: {error}") from None

    tensors = {}
    for entry in header.tensors:
        if entry.ggml_type not in SUPPORTED_TYPES:
            raise GGUFError(
                f"{path}: tensor {entry.name!r} has type {entry.ggml_type}, which flashformer does not read "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        tensors[entry.name] = RawTensor(entry.name, entry.ggml_type, entry.shape, entry.data)
    return GGUFFile(path, header.metadata, tensors, header.mapping)
