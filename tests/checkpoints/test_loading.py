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
from helpers.gguf import llama_metadata, llama_tensors, tiny_llama, write_gguf

import flashformer
from flashformer.checkpoints.gguf import read_gguf, smollm2_path
from flashformer.checkpoints.loading import _model_from_gguf
from flashformer.kernels.quantized import GGUF_TYPES, QuantizedLinear
from flashformer.model.quantize import quantize


def _float_path(path, activations="int8"):
    """Today's float path: every tensor dequantized, the float model, then its layers quantized."""
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


@pytest.mark.parametrize("activations", ["int8", "float32"])
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


def test_quantized_load_holds_at_most_1_3x_the_file(tmp_path):
    """RSS after the load minus the RSS before it, in a process that has already loaded a small
    file of the same kind (so the baseline holds Python, torch, the kernels and the code a first
    load imports), is at most 1.3x the file's size; the file is no longer mapped (read once)."""
    small = _random_llama_file(tmp_path / "small.gguf", layers=1, d=128, ff=256, vocab=512)
    large = _random_llama_file(tmp_path / "large.gguf", layers=12, d=768, ff=2048, vocab=16384)
    size = large.stat().st_size
    assert size > 50e6
    result = subprocess.run(
        [sys.executable, "-c", MEASURE, str(small), str(large)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    held = figures["after"]["VmRSS"] - figures["before"]["VmRSS"]
    peak = figures["after"]["VmHWM"] - figures["before"]["VmRSS"]
    print(f"file {size / 2**20:.1f} MiB: RSS +{held / size:.2f}x its size, peak +{peak / size:.2f}x")
    assert held <= 1.3 * size, f"RSS grew by {held / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB file"
    assert not figures["mapped"], "the file is still mapped after the load: a view of it was kept"
