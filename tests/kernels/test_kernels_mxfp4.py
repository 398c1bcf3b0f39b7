"""GGUF's MXFP4 blocks (gpt-oss's experts: 32 e2m1 values and an e8m0 scale, 17 bytes a block) in
the quantized layers (kernels/quantized.py, gguf_blocks.py, csrc/mxfp4_cpu.cpp, operators.py's
fallback): the weights bit for bit gguf's dequantizer's, products against float64 ones of those
weights on every vector path, every ISA the scalar kernel's bits, a row's result independent of
its batch."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from helpers.kernel_paths import kernel_paths, on_path

from flashformer.kernels.operators import OPERATORS
from flashformer.kernels.quantized import (
    KERNEL_ISAS,
    QuantizedEmbedding,
    QuantizedLinear,
    kernel_isa,
    load_kernels,
)

MXFP4 = gguf.GGMLQuantizationType.MXFP4


@pytest.fixture(scope="module", autouse=True)
def kernels():
    return load_kernels()


def random_blocks(n: int, k: int, seed: int, exponents=(118, 130)) -> np.ndarray:
    """(n, k) as MXFP4 blocks (n, k / 32 * 17): random codes (every one of the 16, both signs of
    zero included) and exponents drawn from [exponents[0], exponents[1]) (scales 2^(e - 127))."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(*exponents, size=(n, k // 32))
    return raw.reshape(n, -1)


def dequantized(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf_dequantize(raw, MXFP4)))


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) -> the float64 values of its int8 blocks of 32 (d = amax / 127, q = round(x / d),
    half to even, in float32 as the kernels compute them)."""
    blocks = x.numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inverse)
    return torch.from_numpy(
        (q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)).reshape(x.shape)
    )


def check_close(y, x64, w64, bias=None):
    """y against x64 @ w64^T (+ bias), each error within 3e-6 times the sum of the products'
    magnitudes (about 50 float32 ulps)."""
    ref = x64 @ w64.t() + (0 if bias is None else bias.double())
    bound = 3e-6 * (x64.abs() @ w64.abs().t()) + 1e-30
    excess = ((y.double() - ref).abs() / bound).max().item()
    assert excess <= 1, f"error {excess:.2f}x the float32 bound"


def test_weights_are_ggufs_dequantizer_bit_for_bit():
    """Every exponent up to 252, the subnormal scales of e = 0, 1 included (from 253 the code of 6
    overflows to infinity, in gguf as here), as a layer's weight and as an embedding's rows."""
    raw = random_blocks(40, 256, seed=1, exponents=(0, 253))
    raw.reshape(40, 8, 17)[:4, :, 0] = np.arange(32).reshape(4, 8)  # e = 0 .. 31 surely present
    expected = dequantized(raw)
    lin = QuantizedLinear.from_gguf_blocks("MXFP4", raw, (40, 256))
    assert lin.qweight.shape == (40, 8, 17) and lin.scales is None
    assert torch.equal(lin.dequantize(), expected)
    emb = QuantizedEmbedding.from_gguf_blocks("MXFP4", raw, (40, 256))
    ids = torch.tensor([[0, 7, 39], [3, 3, 9]])
    assert torch.equal(emb(ids), expected[ids])


def test_blocks_of_ggufs_quantizer_round_trip():
    """Values that are e2m1 codes times a power of two come back exactly from gguf's quantizer's
    blocks (the file's bytes mean what gguf says they mean)."""
    rng = np.random.default_rng(2)
    values = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)
    w = rng.choice(values, size=(8, 64)) * rng.choice([-1, 1], size=(8, 64)).astype(np.float32)
    w[:, ::32] = 6  # each block's largest magnitude: its scale 1
    lin = QuantizedLinear.from_gguf_blocks("MXFP4", gguf_quantize(w, MXFP4), (8, 64))
    assert torch.equal(lin.dequantize(), torch.from_numpy(w))


# 352 values: 11 blocks, 8 of them in one vector step and 3 after; 512: 16, two steps
@pytest.mark.parametrize("shape", [(37, 352), (64, 512)])
def test_linear_matches_float64_reference(shape):
    raw = random_blocks(*shape, seed=shape[0])
    w64 = dequantized(raw).double()
    torch.manual_seed(shape[1])
    bias = torch.randn(shape[0])
    for activations in ("int8", "float32"):
        for b in (None, bias):
            lin = QuantizedLinear.from_gguf_blocks("MXFP4", raw, shape, bias=b, activations=activations)
            for rows in (1, 5, 9):  # tiles of 4 x rows and their tails
                x = torch.randn(rows, shape[1])
                x64 = quantize_activations(x) if activations == "int8" else x.double()
                for isa in kernel_paths():  # AVX2, AVX-512 VNNI and AMX where this CPU has them
                    with on_path(isa):
                        check_close(lin(x), x64, w64, b)


def test_batch_invariance():
    raw = random_blocks(50, 512, seed=4)
    torch.manual_seed(4)
    x = torch.randn(16, 512)
    for activations in ("int8", "float32"):
        lin = QuantizedLinear.from_gguf_blocks(
            "MXFP4", raw, (50, 512), bias=torch.randn(50), activations=activations
        )
        alone = lin(x[:1])
        for rows in (2, 5, 16):
            assert torch.equal(lin(x[:rows])[:1], alone), (activations, rows)
        assert torch.equal(lin(x)[7], lin(x[7:8])[0])


@pytest.mark.skipif(load_kernels() != "cpp", reason="the C++ kernels are not built here")
def test_every_isa_gives_the_scalar_bits():
    """Scalar, AVX2, VNNI and AMX (those this CPU has; AMX runs VNNI's kernels), at every tile of
    x rows and with a tail of blocks past a multiple of 8: the same bits."""
    previous = kernel_isa()
    isas = [isa for isa in KERNEL_ISAS if kernel_isa(isa) == isa]
    kernel_isa(previous)
    if len(isas) < 2:
        pytest.skip("this CPU has only the scalar kernels")
    torch.manual_seed(5)
    for activations, (n, k) in ((a, s) for a in ("int8", "float32") for s in ((42, 352), (50, 512))):
        raw = random_blocks(n, k, seed=n)
        lin = QuantizedLinear.from_gguf_blocks(
            "MXFP4", raw, (n, k), bias=torch.randn(n), activations=activations
        )
        x = torch.randn(35, k)
        results = {}
        try:
            for isa in isas:
                assert kernel_isa(isa) == isa
                results[isa] = [lin(x[:rows]) for rows in (1, 2, 7, 11, 35)]
        finally:
            kernel_isa(previous)
        for isa in isas[1:]:
            for rows, got, scalar in zip((1, 2, 7, 11, 35), results[isa], results["scalar"]):
                assert torch.equal(got, scalar), (activations, n, k, isa, rows)


def test_fallback_matches_reference():
    torch.manual_seed(6)
    x = torch.randn(3, 256)
    raw = random_blocks(1030, 256, seed=6)  # more rows than one fallback tile
    lin = QuantizedLinear.from_gguf_blocks("MXFP4", raw, (1030, 256))
    bias = torch.randn(1030)
    y = OPERATORS["mxfp4_linear"].fallback(x, lin.qweight, bias, 1030, True)
    check_close(y, x.double(), dequantized(raw).double(), bias)


@pytest.mark.skipif(load_kernels() != "cpp", reason="the C++ kernels are not built here")
def test_the_operator_refuses_other_blocks_by_name():
    x = torch.randn(2, 64)
    with pytest.raises(
        RuntimeError, match=r"blocks: expected contiguous uint8 \(out_features, in_features / 32, 17\)"
    ):
        torch.ops.flashformer.mxfp4_linear(x, torch.zeros(4, 2, 18, dtype=torch.uint8), None, 4, True)
    with pytest.raises(RuntimeError, match="out_features: 5 does not match blocks of 4 rows"):
        torch.ops.flashformer.mxfp4_linear(x, torch.zeros(4, 2, 17, dtype=torch.uint8), None, 5, True)
