"""flashformer.checkpoints.loading with quantize="gguf": the model is built without float32
copies of the blocks a kernel takes, and must be the model the float path quantizes, bit for bit.

The reference is the float path itself, computed in the same test: read_gguf with every tensor
dequantized (checked against transformers' GGUF loader in test_gguf.py), the float model, then
quantize(model, "gguf", checkpoint). The memory bound is measured in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers.gguf import k_quant_blocks, llama_metadata, llama_tensors, tiny_llama, write_gguf

import flashformer
from flashformer.checkpoints.gguf import read_gguf
from flashformer.checkpoints.gguf.packaged_models import smollm2_path
from flashformer.checkpoints.loading import _model_from_gguf
from flashformer.kernels.quantized import GGUF_TYPES, ConcatenatedLinear, QuantizedLinear
from flashformer.model.quantize import DEFAULT_ACTIVATIONS, quantize


def _float_path(path, activations=DEFAULT_ACTIVATIONS):
    """Today's float path: every tensor dequantized, the float model, then its layers quantized
    (with the default activations, as from_pretrained)."""
    checkpoint = read_gguf(path, show_progress=False)
    return quantize(_model_from_gguf(checkpoint), "gguf", checkpoint, activations)


def _assert_same_model(ours, reference, vocab_size):
    assert ours.state_dict().keys() == reference.state_dict().keys()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    ids = torch.randint(0, vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
        assert torch.equal(ours(ids).logits, expected)
    assert expected.abs().max() > 0.1


def test_smollm2_blocks_load_equals_the_float_path_bit_for_bit():
    ours = flashformer.from_pretrained(smollm2_path(), quantize="gguf")
    assert not any(t.is_meta for t in [*ours.parameters(), *ours.buffers()])
    _assert_same_model(ours, _float_path(smollm2_path()), ours.config.vocab_size)


def _mixed_types(name: str) -> str:
    """Kernel types, types no kernel reads today (dequantized), and in layer 1 a fused q/k/v that
    mixes the two (the quantizer leaves it float: it is dequantized after the quantizer ran)."""
    part = name.split(".")[-2]  # attn_q, ffn_down, token_embd, ...
    if name.startswith("blk.0."):
        return {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "ffn_down": "Q5_0"}.get(part, "Q4_0")
    return {"attn_q": "Q8_0", "attn_k": "Q4_K", "attn_v": "Q8_0", "token_embd": "Q6_K"}.get(part, "Q4_1")


@pytest.mark.parametrize("activations", ["int8", "int8-int8x2-head", "float32"])
def test_mixed_types_load_equals_the_float_path_bit_for_bit(tmp_path, activations):
    model = tiny_llama(hidden=256, ff=512, tie=True)
    path = write_gguf(
        tmp_path / "mixed.gguf", "llama", llama_metadata(model), llama_tensors(model, _mixed_types)
    )
    ours = flashformer.from_pretrained(path, quantize="gguf", activations=activations)
    reference = _float_path(path, activations)
    _assert_same_model(ours, reference, model.config.vocab_size)
    # the layers a kernel takes are quantized; the rest holds float32 values, none left on meta
    assert isinstance(ours.decoder.blocks[0].attn.qkv, QuantizedLinear)
    dequantized = {"Q4_K", "Q5_0", "Q6_K"} - set(GGUF_TYPES)
    if dequantized >= {"Q4_K", "Q6_K"}:
        assert isinstance(ours.decoder.blocks[1].attn.qkv.weight, torch.nn.Parameter)
        assert isinstance(ours.embeddings.tokens.weight, torch.nn.Parameter)


# ---- the default: a GGUF file runs on its own blocks, the float path one argument away ----


def _q4_file(tmp_path):
    model = tiny_llama(hidden=256, ff=512, tie=True)
    types = lambda name: "F32" if name.endswith("norm.weight") else "Q4_1"  # noqa: E731
    return model, write_gguf(
        tmp_path / "q4.gguf", "llama", llama_metadata(model), llama_tensors(model, types)
    )


def test_a_gguf_file_loads_its_own_blocks_by_default(tmp_path):
    model, path = _q4_file(tmp_path)
    typed = flashformer.from_pretrained(path)  # as a llama.cpp user types it: no flag
    assert typed.quantization == "gguf"
    assert isinstance(typed.decoder.blocks[0].attn.qkv, QuantizedLinear)
    _assert_same_model(typed, flashformer.from_pretrained(path, quantize="gguf"), model.config.vocab_size)
    loaded, _ = flashformer.load(path)
    assert loaded.quantization == "gguf"


def test_the_float_path_is_quantize_none(tmp_path):
    model, path = _q4_file(tmp_path)
    for spelled in (None, "none"):  # the argument, and the command line's word for it
        floats = flashformer.from_pretrained(path, quantize=spelled)
        assert getattr(floats, "quantization", None) is None
        assert floats.decoder.blocks[0].attn.qkv.weight.dtype == torch.float32
        # the dequantized weights: the blocks' values as gguf's dequantizer gives them
        _assert_same_model(
            floats, _model_from_gguf(read_gguf(path, show_progress=False)), model.config.vocab_size
        )


def test_a_folder_loads_as_stored_by_default(tmp_path):
    model = tiny_llama()
    model.save_pretrained(tmp_path)
    ours = flashformer.from_pretrained(tmp_path)
    assert getattr(ours, "quantization", None) is None
    assert ours.decoder.blocks[0].attn.qkv.weight.dtype == torch.float32


def test_a_gguf_file_in_another_dtype_needs_the_float_path(tmp_path):
    _, path = _q4_file(tmp_path)
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16.*quantize=None"):
        flashformer.from_pretrained(path, dtype=torch.bfloat16)
    floats = flashformer.from_pretrained(path, dtype=torch.bfloat16, quantize=None)
    assert floats.decoder.blocks[0].attn.qkv.weight.dtype == torch.bfloat16


def test_an_unknown_quantize_is_refused_by_name(tmp_path):
    _, path = _q4_file(tmp_path)
    with pytest.raises(ValueError, match=r"quantize must be one of .*'q4'"):
        flashformer.from_pretrained(path, quantize="q4")


# ---- memory: a fresh process, its RSS before and after the load ----

MEASURE = r"""
import gc, json, sys
import flashformer
from flashformer.kernels.quantized import load_kernels

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}

load_kernels()
flashformer.from_pretrained(sys.argv[1], quantize="gguf")  # code loaded at a first load: baseline
gc.collect()
before = status()
model = flashformer.from_pretrained(sys.argv[2], quantize="gguf")
gc.collect()
after = status()
mapped = any(sys.argv[2] in line for line in open("/proc/self/maps"))
print(json.dumps({"before": before, "after": after, "mapped": mapped}))
"""


def _random_llama_file(path: Path, layers: int, d: int, ff: int, vocab: int) -> Path:
    """A llama GGUF of Q8_0 attention and embedding, Q4_0 feed-forward, F32 norms: random codes
    with small float16 scales (the values do not matter here, the bytes do)."""
    rng = np.random.default_rng(0)

    def blocks(type_name, rows, cols):
        block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][1]
        data = rng.integers(0, 256, size=(rows, cols // 32, block_bytes), dtype=np.uint8)
        data[..., :2] = np.full((rows, cols // 32), 1e-3, np.float16).view(np.uint8).reshape(rows, -1, 2)
        return data.reshape(rows, -1)

    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "llama.block_count": layers,
        "llama.context_length": 256,
        "llama.embedding_length": d,
        "llama.feed_forward_length": ff,
        "llama.attention.head_count": d // 64,
        "llama.vocab_size": vocab,
    }.items():
        writer.add_uint32(key, value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    tensors = {"token_embd.weight": ("Q8_0", vocab, d), "output_norm.weight": ("F32", d, None)}
    for i in range(layers):
        for name, type_name, rows, cols in (
            ("attn_norm", "F32", d, None),
            ("ffn_norm", "F32", d, None),
            ("attn_q", "Q8_0", d, d),
            ("attn_k", "Q8_0", d, d),
            ("attn_v", "Q8_0", d, d),
            ("attn_output", "Q8_0", d, d),
            ("ffn_gate", "Q4_0", ff, d),
            ("ffn_up", "Q4_0", ff, d),
            ("ffn_down", "Q4_0", d, ff),
        ):
            tensors[f"blk.{i}.{name}.weight"] = (type_name, rows, cols)
    for name, (type_name, rows, cols) in tensors.items():
        if cols is None:
            writer.add_tensor(name, np.ones(rows, np.float32))
        else:
            qtype = gguf.GGMLQuantizationType[type_name]
            writer.add_tensor(name, blocks(type_name, rows, cols), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def measured_in_a_fresh_process(script: str, small, large) -> dict:
    """The figures `script` prints (its last line, JSON) run in a fresh Python with the two files."""
    result = subprocess.run(
        [sys.executable, "-c", script, str(small), str(large)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_quantized_load_holds_at_most_1_3x_the_file(tmp_path):
    """RSS after the load minus the RSS before it, in a process that has already loaded a small
    file of the same kind (so the baseline holds Python, torch, the kernels and the code a first
    load imports), is at most 1.3x the file's size; the file is no longer mapped (read once)."""
    small = _random_llama_file(tmp_path / "small.gguf", layers=1, d=128, ff=256, vocab=512)
    large = _random_llama_file(tmp_path / "large.gguf", layers=12, d=768, ff=2048, vocab=16384)
    size = large.stat().st_size
    assert size > 50e6
    figures = measured_in_a_fresh_process(MEASURE, small, large)
    held = figures["after"]["VmRSS"] - figures["before"]["VmRSS"]
    peak = figures["after"]["VmHWM"] - figures["before"]["VmRSS"]
    print(f"file {size / 2**20:.1f} MiB: RSS +{held / size:.2f}x its size, peak +{peak / size:.2f}x")
    assert held <= 1.3 * size, f"RSS grew by {held / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB file"
    assert not figures["mapped"], "the file is still mapped after the load: a view of it was kept"


# ---- memory-mapped weights: the K-quants' blocks are the file's bytes, used in place ----


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges where this process maps `path` (/proc/self/maps: independent of how
    the loader keeps its map)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            ranges.append((start, end))
    return ranges


def _in_ranges(tensor: torch.Tensor, ranges) -> bool:
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.untyped_storage().nbytes()
    return any(lo <= start and end <= hi for lo, hi in ranges)


def _kquant_types(name: str) -> str:
    part = name.split(".")[-2]
    return {"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}.get(part, "Q4_K")


def test_kquant_blocks_are_used_in_place_and_the_file_stays_unchanged(tmp_path):
    model = tiny_llama(hidden=256, ff=512, tie=True)
    path = write_gguf(
        tmp_path / "k.gguf", "llama", llama_metadata(model), llama_tensors(model, _kquant_types)
    )
    before = path.read_bytes()
    ours = flashformer.from_pretrained(path, quantize="gguf")
    ranges = _mapped_ranges(path)
    assert ranges, "the file is not mapped: its blocks were copied"
    attn, ffn = ours.decoder.blocks[0].attn, ours.decoder.blocks[0].ffn
    # q and k: rows put back in transformers' order for its RoPE, a copy; v: the file's own bytes
    assert isinstance(attn.qkv, ConcatenatedLinear)
    q, k, v = attn.qkv.parts
    assert not _in_ranges(q.qweight, ranges) and not _in_ranges(k.qweight, ranges)
    assert _in_ranges(v.qweight, ranges)
    assert _in_ranges(attn.out.qweight, ranges)
    gated = [module for module in ffn.modules() if isinstance(module, QuantizedLinear)]
    assert len(gated) == 3 and all(_in_ranges(layer.qweight, ranges) for layer in gated)
    assert _in_ranges(ours.embeddings.tokens.qweight, ranges)
    assert ours.lm_head.qweight.data_ptr() == ours.embeddings.tokens.qweight.data_ptr()

    # the same bits as the float path's model (its layers quantized from the same blocks), natively too
    reference = _float_path(path)
    _assert_same_model(ours, reference, model.config.vocab_size)
    ids = torch.tensor([[1, 5, 9, 2]])
    assert ours.native_decoder() is not None
    assert torch.equal(
        ours.generate(ids, max_new_tokens=6, eos_token_id=[]),
        reference.generate(ids, max_new_tokens=6, eos_token_id=[], native=False),
    )

    # a write to a mapped weight stays in this process: no fault, the file unchanged
    v.qweight.view(-1)[:16].fill_(7)
    assert v.qweight.view(-1)[:16].eq(7).all()
    del ours, reference, v, q, k, attn, ffn, gated
    assert path.read_bytes() == before


def _random_kquant_file(path: Path, layers: int, d: int, ff: int, vocab: int) -> Path:
    """A llama GGUF of Q4_K and Q6_K blocks (random codes, small scales) and F32 norms."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "llama.block_count": layers,
        "llama.context_length": 256,
        "llama.embedding_length": d,
        "llama.feed_forward_length": ff,
        "llama.attention.head_count": d // 64,
        "llama.vocab_size": vocab,
    }.items():
        writer.add_uint32(key, value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tensor(
        "token_embd.weight", k_quant_blocks("Q6_K", vocab, d), raw_dtype=gguf.GGMLQuantizationType.Q6_K
    )
    writer.add_tensor("output_norm.weight", np.ones(d, np.float32))
    for i in range(layers):
        for name, type_name, rows, cols in (
            ("attn_q", "Q4_K", d, d),
            ("attn_k", "Q4_K", d, d),
            ("attn_v", "Q6_K", d, d),
            ("attn_output", "Q4_K", d, d),
            ("ffn_gate", "Q4_K", ff, d),
            ("ffn_up", "Q4_K", ff, d),
            ("ffn_down", "Q6_K", d, ff),
        ):
            qtype = gguf.GGMLQuantizationType[type_name]
            writer.add_tensor(
                f"blk.{i}.{name}.weight", k_quant_blocks(type_name, rows, cols, seed=i), raw_dtype=qtype
            )
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


MEASURE_MAPPED = r"""
import gc, json, sys
import torch
import flashformer
from flashformer.kernels.quantized import load_kernels

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(fields[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}

load_kernels()
model = flashformer.from_pretrained(sys.argv[1], quantize="gguf")  # code loaded at a first load: baseline
model(torch.tensor([[1, 2]]))
del model
gc.collect()
before = status()
model = flashformer.from_pretrained(sys.argv[2], quantize="gguf")
gc.collect()
loaded = status()
with torch.no_grad():
    model(torch.tensor([[1, 2, 3]]))  # every weight read once
ran = status()
print(json.dumps({"before": before, "loaded": loaded, "ran": ran}))
"""


def test_kquant_load_maps_the_file_and_holds_about_its_size(tmp_path):
    """In a fresh process: after the load, the K-quant file's blocks are not yet resident (only
    q and k, reordered, and the norms are copies); after a forward that read every weight, the
    RSS grew by at most 1.1x the file (its pages, mapped, and the q/k copies)."""
    small = _random_kquant_file(tmp_path / "small.gguf", layers=1, d=256, ff=512, vocab=512)
    large = _random_kquant_file(tmp_path / "large.gguf", layers=12, d=768, ff=2048, vocab=16384)
    size = large.stat().st_size
    assert size > 50e6
    figures = measured_in_a_fresh_process(MEASURE_MAPPED, small, large)
    loaded = figures["loaded"]["VmRSS"] - figures["before"]["VmRSS"]
    ran = figures["ran"]["VmRSS"] - figures["before"]["VmRSS"]
    copied = figures["loaded"]["RssAnon"] - figures["before"]["RssAnon"]
    print(
        f"file {size / 2**20:.1f} MiB: RSS +{loaded / size:.2f}x after the load, +{ran / size:.2f}x after a forward"
    )
    qk = 12 * 2 * 768 * 768 // 256 * 144  # the reordered q and k blocks
    assert copied <= qk + 0.05 * size, (
        f"the load copied {copied / 2**20:.1f} MiB for {qk / 2**20:.1f} MiB of q/k"
    )
    assert loaded <= qk + 0.1 * size
    assert ran <= 1.1 * size, f"RSS grew by {ran / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB file"
