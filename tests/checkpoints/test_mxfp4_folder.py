"""checkpoints/mxfp4_folder.py: a gpt-oss folder as openai ships it (experts as MXFP4 _blocks and
_scales, quantization_config mxfp4), made here from a random GptOssForCausalLM by the tests' own
MXFP4 quantizer (helpers/gpt_oss.py, written from the format's definition). quantize=None gives
transformers' logits on the same folder (its dequantizing load, Mxfp4Config(dequantize=True))
within 1e-4 of the largest logit; the default load keeps the experts as MXFP4 blocks (GGUF's
layout, the MXFP4 kernels) and, with float32 activations, gives the float load's logits to float32
rounding; a damaged folder is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import relative_error
from helpers.gpt_oss import E2M1, mxfp4_dequantize, save_mxfp4_folder, tiny_gpt_oss
from safetensors.torch import load_file, save_file

import flashformer
from flashformer.checkpoints.mxfp4_folder import gguf_blocks, read_mxfp4_folder
from flashformer.kernels.gguf_blocks import dequantize_mxfp4

IDS = torch.randint(3, 275, (2, 24), generator=torch.Generator().manual_seed(0))
# d = 64 is two blocks a row for gate_up (a single block would hide a block-order mistake), and
# intermediate 96 three for down; 2 ff = 192 != d, so a transposed matrix cannot pass
SIZES = dict(intermediate_size=96)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("mxfp4")
    meant = save_mxfp4_folder(tiny_gpt_oss(**SIZES), path)
    return path, meant


def test_the_repacking_moves_nibbles_and_never_values():
    """Every code in every position, and exponents 0 to 250 (past it 6 times the scale overflows
    float32; 255 is the spec's NaN): GGUF's dequantization of the repacked
    blocks equals the format's definition of the stored ones (helpers' mxfp4_dequantize), and
    value j of a block sits where GGUF's layout puts it (byte 1 + j % 16, high nibble for j >= 16)."""
    generator = np.random.default_rng(0)
    blocks = generator.integers(0, 256, size=(256, 3, 16), dtype=np.uint8)
    scales = (np.arange(256 * 3) % 251).reshape(256, 3).astype(np.uint8)  # subnormal scales too
    ours = gguf_blocks(torch.from_numpy(blocks), torch.from_numpy(scales))  # (256, 51)
    assert ours.shape == (256, 3 * 17) and ours.dtype == torch.uint8
    got = dequantize_mxfp4(ours.reshape(256, 3, 17)).numpy()
    np.testing.assert_array_equal(got, mxfp4_dequantize(blocks, scales))
    stored = np.stack((blocks & 15, blocks >> 4), -1).reshape(256, 3, 32)  # value j's code
    repacked = ours.reshape(256, 3, 17).numpy()
    np.testing.assert_array_equal(repacked[..., 0], scales)
    for j in range(32):
        byte = repacked[..., 1 + j % 16]
        np.testing.assert_array_equal((byte >> 4) if j >= 16 else (byte & 15), stored[..., j])
    assert float(E2M1[7]) == 6.0  # the largest e2m1 magnitude, as the codes above assume


def test_float_load_equals_transformers_dequantized_load(folder):
    from transformers import GptOssForCausalLM, Mxfp4Config

    path, meant = folder
    theirs = GptOssForCausalLM.from_pretrained(
        path,
        quantization_config=Mxfp4Config(dequantize=True),
        dtype=torch.float32,
        attn_implementation="eager",
    ).eval()
    for name, values in meant.items():  # the folder means what the helper's quantizer meant
        assert torch.equal(theirs.state_dict()[name], torch.from_numpy(values)), name
    ours = flashformer.from_pretrained(path, quantize=None)
    experts = ours.decoder.block(1).ffn.experts
    gate_up = torch.from_numpy(meant["model.layers.1.mlp.experts.gate_up_proj"])  # (experts, d, 2 ff)
    assert torch.equal(experts[3].gate.weight, gate_up[3, :, 0::2].t())
    assert torch.equal(experts[3].up.weight, gate_up[3, :, 1::2].t())
    with torch.no_grad():
        expected = theirs(IDS).logits
        assert relative_error(ours(IDS).logits, expected) < 1e-4


def test_default_load_keeps_mxfp4_blocks_and_equals_the_float_load(folder):
    path, _ = folder
    float_model = flashformer.from_pretrained(path, quantize=None)
    quantized = flashformer.from_pretrained(path, activations="float32")  # the default: the blocks
    assert flashformer.checkpoints.loading.quantize_mode(path) == "gguf"
    for i in range(2):
        ffn, float_ffn = quantized.decoder.block(i).ffn, float_model.decoder.block(i).ffn
        assert not hasattr(ffn.router, "fmt")  # the router stays float32, as in the folder
        for e, expert in enumerate(ffn.experts):
            for projection in ("gate", "up", "down"):
                layer, reference = getattr(expert, projection), getattr(float_ffn.experts[e], projection)
                assert layer.fmt == "mxfp4", (i, e, projection)
                assert torch.equal(layer.dequantize(), reference.weight), (i, e, projection)
                assert torch.equal(layer.bias, reference.bias), (i, e, projection)
    with torch.no_grad():
        got, want = quantized(IDS).logits, float_model(IDS).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    default = flashformer.from_pretrained(path)  # int8 activations: llama.cpp's arithmetic
    with torch.no_grad():
        assert relative_error(default(IDS).logits, want) < 0.05


def test_bfloat16_folder_dequantizes_in_its_own_dtype(tmp_path):
    model = tiny_gpt_oss(**SIZES).to(torch.bfloat16)
    save_mxfp4_folder(model, tmp_path)
    ours = flashformer.from_pretrained(tmp_path, quantize=None)
    assert ours.decoder.block(0).ffn.experts[0].down.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"dtype=torch.bfloat16: a folder of MXFP4 experts runs on its own"):
        flashformer.from_pretrained(tmp_path, dtype=torch.bfloat16)


def _damage(path, change) -> None:
    weights = load_file(path / "model.safetensors")
    change(weights)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def test_damaged_folders_are_refused_by_name(tmp_path):
    save_mxfp4_folder(tiny_gpt_oss(**SIZES), tmp_path)
    name = "model.layers.0.mlp.experts.down_proj"
    _damage(tmp_path, lambda w: w.pop(f"{name}_scales"))
    with pytest.raises(ValueError, match=rf"{name}_scales is missing beside {name}_blocks"):
        read_mxfp4_folder(tmp_path)

    save_mxfp4_folder(tiny_gpt_oss(**SIZES), tmp_path)
    _damage(tmp_path, lambda w: w.update({f"{name}_blocks": w[f"{name}_blocks"][..., :8].contiguous()}))
    with pytest.raises(
        ValueError, match=rf"{name}_blocks \(8, 64, 3, 8\) and _scales \(8, 64, 3\) are not MXFP4's"
    ):
        read_mxfp4_folder(tmp_path)

    save_mxfp4_folder(tiny_gpt_oss(**SIZES), tmp_path)
    _damage(tmp_path, lambda w: w.update({f"{name}_scales": w[f"{name}_scales"].float()}))
    with pytest.raises(ValueError, match=rf"{name}_scales has dtype torch.float32; MXFP4 stores uint8"):
        read_mxfp4_folder(tmp_path)

    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match=r"read for model_type 'gpt_oss'; got model_type 'llama'"):
        read_mxfp4_folder(tmp_path)
