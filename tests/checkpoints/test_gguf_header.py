"""flashformer.checkpoints.gguf.header: our one-pass header parser against gguf.GGUFReader,
the `gguf` library's own reader, on the real SmolLM2 file and on a file holding every value type
GGUF defines; the same metadata (values and Python types) and the same tensor views."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from flashformer.checkpoints.gguf import GGUFError, read_file
from flashformer.checkpoints.gguf.header import read_header
from flashformer.checkpoints.gguf.packaged_models import smollm2_path


def _gguf_library_view(path):
    reader = gguf.GGUFReader(str(path))
    metadata = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    return metadata, {t.name: t for t in reader.tensors}


def _kinds(value):
    return [type(item) for item in value] if isinstance(value, list) else type(value)


def _assert_same_as_the_gguf_library(path):
    metadata, tensors = _gguf_library_view(path)
    header = read_header(path)
    assert header.metadata == metadata
    for key, value in metadata.items():  # int stays int, bool bool, float32 values the same floats
        assert _kinds(header.metadata[key]) == _kinds(value), key
    assert [t.name for t in header.tensors] == list(tensors)
    for entry in header.tensors:
        theirs = tensors[entry.name]
        assert entry.ggml_type == theirs.tensor_type.name
        assert entry.shape == tuple(int(n) for n in reversed(theirs.shape.tolist()))
        assert entry.data.dtype == theirs.data.dtype and entry.data.shape == theirs.data.shape, entry.name
        assert np.array_equal(entry.data.view(np.uint8), theirs.data.view(np.uint8)), entry.name


def test_smollm2_header_equals_the_gguf_library():
    _assert_same_as_the_gguf_library(smollm2_path())


def test_every_value_type_and_alignment(tmp_path):
    path = tmp_path / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁ 世界")
    writer.add_string("t.empty", "")
    writer.add_array("t.strings", ["a", "", "▁b", "<0x0A>"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 0.1, -3.25])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.none", [])
    writer.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("f16", np.arange(64, dtype=np.float16).reshape(2, 32))
    q8 = gguf.quants.quantize(
        np.linspace(-1, 1, 256, dtype=np.float32).reshape(4, 64), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _assert_same_as_the_gguf_library(path)
    header = read_header(path)
    assert header.metadata["t.str"] == "héllo ▁ 世界" and header.metadata["general.alignment"] == 64
    assert read_file(path).tensors["q8"].to_blocks().shape == (4, 2 * 34)


def test_duplicate_key_and_bad_utf8_are_named(tmp_path):
    path = tmp_path / "bad.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("t.key1", "abc")
    writer.add_string("t.key2", "xyz")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    data = path.read_bytes()
    path.write_bytes(data.replace(b"t.key2", b"t.key1"))
    with pytest.raises(
        GGUFError, match=r"bad\.gguf is not a readable GGUF file: metadata key 't\.key1' appears twice"
    ):
        read_file(path)
    path.write_bytes(data.replace(b"abc", b"a\xffc"))
    with pytest.raises(
        GGUFError, match=r"bad\.gguf is not a readable GGUF file: metadata 't\.key1' holds text"
    ):
        read_file(path)
