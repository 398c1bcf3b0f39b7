"""The kernels' tables (block_types.py, layouts.py, operators.py, and the C++ table of packings,
csrc/packings.h) against gguf's own facts and each other: each GGUF type's id and block sizes as
gguf-py declares them, its reference dequantization bit for bit gguf's, every layout and operator
a row names present and runnable, and every packing of the C++ table the shapes and bytes that
Python's packers produce for its layout."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from flashformer.kernels import extension
from flashformer.kernels.block_types import GGUF_TYPES, TYPES, parse_gguf_blocks
from flashformer.kernels.layouts import LAYOUTS, pack_int8, quantize_int8_per_row
from flashformer.kernels.machine import KERNEL_ISAS
from flashformer.kernels.native_decoder import packing_index, packings
from flashformer.kernels.operators import OPERATORS

# byte offsets of each K-quant block's float16 fields (ggml's structs), set to small values below
FLOAT16_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@pytest.mark.parametrize("name", list(TYPES))
def test_rows_are_ggmls_types(name):
    row, kind = TYPES[name], gguf.GGMLQuantizationType[name]
    assert row.ggml_id == kind.value
    assert (row.block_values, row.block_bytes) == gguf.GGML_QUANT_SIZES[kind]
    assert row.row_bytes(4 * row.block_values) == 4 * row.block_bytes


def raw_tensor(name: str, rows: int, cols: int) -> np.ndarray:
    """A (rows, cols) tensor of type `name` as a file's bytes (rows, bytes per row) uint8."""
    rng = np.random.default_rng(7)
    values = rng.standard_normal((rows, cols)).astype(np.float32)
    if not TYPES[name].quantized:
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[name]
        return torch.from_numpy(values).to(dtype).view(torch.uint8).numpy()
    if name not in FLOAT16_FIELDS:
        return gguf_quantize(values, gguf.GGMLQuantizationType[name])
    row = TYPES[name]
    blocks = rng.integers(0, 256, (rows, cols // row.block_values, row.block_bytes), dtype=np.uint8)
    for at in FLOAT16_FIELDS[name]:
        small = (rng.random((rows, cols // row.block_values)) * 0.01).astype(np.float16)
        blocks[..., at : at + 2] = small[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("name", list(TYPES))
def test_to_float_is_ggufs_dequantization(name):
    raw = raw_tensor(name, 9, 512)
    theirs = torch.from_numpy(
        np.ascontiguousarray(gguf_dequantize(raw, gguf.GGMLQuantizationType[name]), dtype=np.float32)
    )
    ours = TYPES[name].to_float(raw, (9, 512))
    assert ours.dtype == torch.float32 and ours.shape == (9, 512)
    assert torch.equal(ours, theirs.reshape(9, 512))


@pytest.mark.parametrize("name", GGUF_TYPES)
def test_a_row_parses_into_its_layout(name):
    fmt, qweight, scales = parse_gguf_blocks(name, raw_tensor(name, 9, 512), (9, 512))
    layout = LAYOUTS[TYPES[name].layout]
    assert fmt == layout.name and (scales is None) == layout.in_place
    assert qweight.shape[:2] == (-(-9 // layout.group_rows), 512 // layout.block_values)


def test_every_layout_has_its_operator_and_every_operator_is_defined():
    assert {layout.op for layout in LAYOUTS.values()} <= set(OPERATORS)
    for name, row in OPERATORS.items():
        assert hasattr(torch.ops.flashformer, name), name
        assert set(row.isas) <= set(KERNEL_ISAS), (name, row.isas)


# ---- the C++ table of packings (csrc/packings.h) against Python's tables ----


def packed_by_python() -> dict[str, tuple]:
    """Each packing as Python's packers produce it: name -> (layout, qweight, scales), from a GGUF
    type's blocks (every type with a layout) or a float weight (int8 per row)."""
    found = {}
    for name in GGUF_TYPES:
        fmt, qweight, scales = parse_gguf_blocks(name, raw_tensor(name, 9, 512), (9, 512))
        packing = "int8_per_block" if fmt == "int8" else fmt
        found[packing] = (fmt, qweight, scales)
    weight = torch.randn(9, 512, generator=torch.Generator().manual_seed(3))
    found["int8_per_row"] = ("int8", *pack_int8(*quantize_int8_per_row(weight)))
    return found


@pytest.mark.skipif(extension.load() != "cpp", reason="the C++ kernels are not built here")
def test_the_cpp_packings_are_pythons_layouts():
    """A packing's row in C++ says what the Python side packs: the layout, the rows a group
    interleaves, the values and bytes of a group's block, whether scales sit beside the data.
    Adding a block type to one side and not the other fails here."""
    table = packings()
    python = packed_by_python()
    assert set(table) == set(python) | {"float32"}, "packings C++ and Python disagree on"
    assert [row.index for row in table.values()] == list(range(len(table)))
    assert {row.layout for row in table.values()} - {None} == set(LAYOUTS)
    floats = table["float32"]  # (n, k) float32 as it is: a row a group, a value a block
    assert (floats.layout, floats.group_rows, floats.block_values, floats.group_block_bytes) == (
        None,
        1,
        1,
        4,
    )
    for name, (fmt, qweight, scales) in python.items():
        row, layout = table[name], LAYOUTS[fmt]
        assert row.layout == fmt, name
        assert (row.group_rows, row.block_values) == (layout.group_rows, layout.block_values), name
        assert row.scales == (scales is not None) == (not layout.in_place), name
        assert qweight.shape[:2] == (-(-9 // row.group_rows), 512 // row.block_values), name
        assert qweight[0, 0].numel() * qweight.element_size() == row.group_block_bytes, name
        if layout.in_place:  # a GGUF block as the file stores it
            gguf_rows = [t for t in TYPES.values() if t.layout == fmt]
            assert {t.block_bytes for t in gguf_rows} == {row.group_block_bytes}, name


def test_an_unknown_packing_is_refused_by_name():
    if extension.load() != "cpp":  # no C++ table: the fallbacks have no native decoder
        with pytest.raises(ValueError, match="has no row 'float32'"):
            packing_index("float32")
        return
    with pytest.raises(ValueError, match=r"packing: the C\+\+ table .* has no row 'iq4_xs'"):
        packing_index("iq4_xs")
