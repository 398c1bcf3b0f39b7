"""The header of a GGUF file (metadata and tensor table), parsed in one pass over a memory map.

gguf.GGUFReader builds a numpy view for every value it reads: a 262,144-token vocabulary is
three arrays of 262,144 entries, and its reader spent 8.8 s on Gemma 3's header (2 cores),
nearly all of it in numpy's memmap slicing. Here the scalars and strings are read with
`struct` from the map and numeric arrays with one `np.frombuffer` each (0.3 s for the same
header). The layout is the GGUF specification's (versions 2 and 3, little-endian):

    magic "GGUF", version u32, tensor count u64, metadata count u64,
    metadata: key (string), value type u32, value
    tensor table: name (string), n_dims u32, dims u64 * n_dims (fastest first), type u32, offset u64
    padding to `general.alignment` (32 by default), then the tensor data
    string: length u64, UTF-8 bytes; array: element type u32, count u64, elements

The tensor data is not read: each tensor becomes a numpy view of the map, which the model's
layers may then use in place (docs/models.md, "Memory-mapped weights"). A read past
the end raises ShortRead (the tensor whose data is cut, or None in the header); a table entry
that cannot describe a tensor raises BadTensor; any other malformation, HeaderError.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flashformer.kernels.block_types import TYPES

VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
SCALARS = {  # value type -> struct format (little-endian)
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
ARRAY_DTYPES = {kind: np.dtype(fmt) for kind, fmt in SCALARS.items()}
UINT32 = 4
# tensor types whose data is viewed as values; every other type as rows of bytes (gguf's convention)
VALUE_DTYPES = {"F32": np.float32, "F16": np.float16}


class ShortRead(Exception):
    def __init__(self, end: int, tensor: str | None = None):
        super().__init__(end, tensor)
        self.end, self.tensor = end, tensor


class BadTensor(Exception):
    def __init__(self, tensor: str, reason: str):
        super().__init__(tensor, reason)
        self.tensor, self.reason = tensor, reason


class HeaderError(Exception):
    """A header that is not GGUF as specified (reason in the message)."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the table: its type name, its shape in torch order, and its data."""

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    data: np.ndarray  # a view of the map: values (F32, F16) or (*shape[:-1], bytes per row) uint8


class FileMapping:
    """The file's memory map, copy-on-write: its pages are the page cache's own until written,
    and a write (nothing in flashformer writes a weight) lands in a private page of this process,
    never in the file and never as a fault: a read-only map (ACCESS_READ) would make any in-place
    write to a weight a segmentation fault, and torch.from_numpy warn on every view.

    The map lives as long as a view of it does (a layer using its bytes in place) and is unmapped
    with the last one."""

    def __init__(self, data: mmap.mmap):
        self.data = data
        self.start = np.frombuffer(data, np.uint8).ctypes.data  # the map's first address
        self.end = self.start + len(data)
        # the page cache's 2 MB folios mapped whole (ext4 and XFS on Linux 6.x give them when
        # the file is read ahead), so a decode step's weights stream through huge pages as the
        # copies on the allocator's huge pages did; a hint only, where the kernel ignores it
        if hasattr(mmap, "MADV_HUGEPAGE"):
            data.madvise(mmap.MADV_HUGEPAGE)

    def holds(self, address: int) -> bool:
        """Whether `address` (a tensor's data_ptr) lies in the map."""
        return self.start <= address < self.end

    def drop_resident_pages(self) -> None:
        """Unmap every page this process has touched (MADV_DONTNEED): the pages the loader read
        to repack stop counting in its RSS, and those a layer uses in place come back from the
        page cache when it first reads them (minor faults, no I/O while the file stays cached).
        Only at load, before anything could have written a private page (it would be lost)."""
        self.data.madvise(mmap.MADV_DONTNEED)


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorEntry]
    mapping: FileMapping


def read_header(path: Path) -> Header:
    """Parse the header of the GGUF file at `path` and view its tensors in a memory map."""
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            raise ShortRead(4)
        # copy-on-write (FileMapping says why); the map outlives the descriptor
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return _Parser(data).header()


class _Parser:
    def __init__(self, data: mmap.mmap):
        self.data, self.size, self.at = data, len(data), 0

    def take(self, n: int) -> int:
        """The offset of the next n bytes, checked against the end of the file."""
        start, self.at = self.at, self.at + n
        if self.at > self.size:
            raise ShortRead(self.at)
        return start

    def scalar(self, fmt: str):
        return struct.unpack_from(fmt, self.data, self.take(struct.calcsize(fmt)))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q")
        start = self.take(n)
        try:
            return self.data[start : start + n].decode("utf-8")
        except UnicodeDecodeError as error:
            raise HeaderError(f"{what} holds text that is not UTF-8: {error}") from None

    def value(self, kind: int, key: str):
        if kind in SCALARS:
            return self.scalar(SCALARS[kind])
        if kind == STRING:
            return self.string(f"metadata {key!r}")
        if kind != ARRAY:
            raise HeaderError(f"metadata {key!r} has value type {kind}, which GGUF does not define")
        item, count = self.scalar("<I"), self.scalar("<Q")
        if item in ARRAY_DTYPES:  # one read for the whole array
            dtype = ARRAY_DTYPES[item]
            start = self.take(count * dtype.itemsize)
            return np.frombuffer(self.data, dtype, count, start).tolist()
        if item == STRING:
            return self.strings(count, f"metadata {key!r}")
        return [self.value(item, key) for _ in range(count)]

    def strings(self, count: int, what: str) -> list[str]:
        """An array of strings (a vocabulary: 262,144 for Gemma) in one tight loop, decoded
        at the end: 0.2 s where a call per string took 0.9 s."""
        data, at, length = self.data, self.at, struct.Struct("<Q").unpack_from
        pieces = []
        try:
            for _ in range(count):
                (n,) = length(data, at)
                pieces.append(data[at + 8 : at + 8 + n])
                at += 8 + n
        except struct.error:
            raise ShortRead(at + 8) from None
        self.take(at - self.at)  # the end of the last string, checked against the file's
        try:
            return [piece.decode("utf-8") for piece in pieces]
        except UnicodeDecodeError as error:
            raise HeaderError(f"{what} holds text that is not UTF-8: {error}") from None

    def header(self) -> Header:
        self.take(4)  # the magic, checked by the caller
        version = self.scalar("<I")
        if version & 0xFFFF == 0 and version:
            raise HeaderError("it is a big-endian GGUF file, which flashformer does not read")
        if version not in VERSIONS:
            raise HeaderError(f"its GGUF version is {version}; supported: {', '.join(map(str, VERSIONS))}")
        tensor_count, kv_count = self.scalar("<Q"), self.scalar("<Q")

        metadata, kinds = {}, {}
        for _ in range(kv_count):
            key = self.string("a metadata key")
            if key in metadata:
                raise HeaderError(f"metadata key {key!r} appears twice")
            kinds[key] = self.scalar("<I")
            metadata[key] = self.value(kinds[key], key)

        table = []
        for _ in range(tensor_count):
            name = self.string("a tensor name")
            dims = [self.scalar("<Q") for _ in range(self.scalar("<I"))]
            table.append((name, dims, self.scalar("<I"), self.scalar("<Q")))

        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if "general.alignment" in metadata and kinds["general.alignment"] != UINT32:
            raise HeaderError("general.alignment must be a uint32")
        if alignment < 1 or alignment & (alignment - 1):
            raise HeaderError(f"general.alignment={alignment} is not a power of two")
        data_start = -(-self.at // alignment) * alignment
        return Header(version, metadata, self.tensors(table, data_start), FileMapping(self.data))

    def tensors(self, table, data_start: int) -> list[TensorEntry]:
        """Each table entry as a view of its bytes, in table order (the first one cut is named)."""
        entries, names = [], set()
        for name, dims, type_id, offset in table:
            if name in names:
                raise BadTensor(name, "the file holds two tensors of this name")
            names.add(name)
            type_name, block_size, block_bytes = _tensor_type(name, type_id)
            shape = tuple(int(n) for n in reversed(dims))  # torch order: the fastest dim last
            if not shape or shape[-1] % block_size:
                raise BadTensor(name, f"shape {shape} does not hold whole blocks of {block_size}")
            n_bytes = int(np.prod(shape)) // block_size * block_bytes
            start = data_start + offset
            if start + n_bytes > self.size:
                raise ShortRead(start + n_bytes, name)
            dtype = VALUE_DTYPES.get(type_name)
            if dtype is None:
                view = np.frombuffer(self.data, np.uint8, n_bytes, start)
                view = view.reshape(*shape[:-1], shape[-1] // block_size * block_bytes)
            else:
                view = np.frombuffer(self.data, dtype, int(np.prod(shape)), start).reshape(shape)
            entries.append(TensorEntry(name, type_name, shape, view))
        return entries


_BY_ID = {row.ggml_id: (row.name, row.block_values, row.block_bytes) for row in TYPES.values()}


def _tensor_type(tensor: str, type_id: int) -> tuple[str, int, int]:
    """(name, values per block, bytes per block) of a tensor's type id: the types flashformer
    reads from its own table (kernels/block_types.py), any other from gguf's (imported only
    then: 30-50 ms of a cold start), so that the reader can refuse it by name."""
    if type_id in _BY_ID:
        return _BY_ID[type_id]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        ggml_type = GGMLQuantizationType(type_id)
    except ValueError:
        raise BadTensor(tensor, f"its type id {type_id} is not a GGML type") from None
    return (ggml_type.name, *GGML_QUANT_SIZES[ggml_type])
