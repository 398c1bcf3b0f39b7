"""int8x2 activations (kernels/quantized.py, csrc/products.h): x multiplied as its int8 blocks plus
the int8 blocks of their rounding error, against float64 products of the dequantized weights
with x written out in numpy (helpers/int8_blocks.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from helpers.gguf_blocks import LAYOUT, dequantized, random_blocks
from helpers.int8_blocks import int8_residual, quantize_activations
from helpers.kernel_paths import kernel_paths, on_path

from flashformer.kernels.operators import OPERATORS
from flashformer.kernels.quantized import QuantizedLinear, load_kernels

residual_op = torch.ops.flashformer.int8_residual.default


@pytest.fixture(scope="module", autouse=True)
def kernels():
    return load_kernels()


def gguf_linear(type_name: str, weight: torch.Tensor, bias, activations: str):
    """(module, float64 weight as gguf dequantizes it): the weight quantized by gguf, or for the
    K-quants (which gguf does not write) random blocks of its shape."""
    if type_name in LAYOUT:
        raw = random_blocks(type_name, *weight.shape, seed=weight.shape[0])
        w64 = dequantized(type_name, raw).double()
    else:
        qtype = getattr(gguf.GGMLQuantizationType, type_name)
        raw = gguf_quantize(weight.numpy(), qtype)
        w64 = torch.from_numpy(gguf_dequantize(raw, qtype)).double()
    lin = QuantizedLinear.from_gguf_blocks(
        type_name, raw, tuple(weight.shape), bias=bias, activations=activations
    )
    return lin, w64


@pytest.mark.parametrize("block", [32, 256])
def test_the_residual_is_x_minus_its_int8_blocks(block):
    torch.manual_seed(block)
    x = torch.randn(5, 2 * block) * torch.logspace(-3, 2, 2 * block)  # blocks of very different sizes
    for isa in kernel_paths():
        with on_path(isa):
            assert torch.equal(residual_op(x, block), int8_residual(x, block)), isa
    with pytest.raises(RuntimeError, match="block: expected 32 or 256"):
        residual_op(x, 64)
    with pytest.raises(RuntimeError, match="whole blocks of 256"):
        residual_op(x[:, :100], 256)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_int8x2_multiplies_x_as_its_two_int8_terms(type_name):
    """On every vector path: the product of x ~ d q + d' q' (both terms as the kernels round them),
    to float32 rounding; its error against x itself is hundreds of times int8's."""
    block = 256 if type_name.endswith("_K") else 32
    torch.manual_seed(7)
    weight, bias = torch.randn(96, 512) * 0.05, torch.randn(96)
    for b in (None, bias):
        lin, w64 = gguf_linear(type_name, weight, b, "int8x2")
        int8, _ = gguf_linear(type_name, weight, b, "int8")
        for rows in (1, 3, 17):
            x = torch.randn(rows, 512)
            x64 = quantize_activations(x, block) + quantize_activations(int8_residual(x, block), block)
            ref = x64 @ w64.t() + (0 if b is None else b.double())
            exact = x.double() @ w64.t() + (0 if b is None else b.double())
            for isa in kernel_paths():
                with on_path(isa):
                    y = lin(x).double()
                    bound = 4e-6 * (x64.abs() @ w64.abs().t()) + 1e-30
                    assert ((y - ref).abs() / bound).max().item() <= 1, (isa, rows)
                    error, int8_error = (y - exact).norm(), (int8(x).double() - exact).norm()
                    assert error < int8_error / 100, (isa, rows, error.item(), int8_error.item())


def test_every_isa_gives_the_same_bits():
    torch.manual_seed(3)
    lin, _ = gguf_linear("Q8_0", torch.randn(64, 256) * 0.05, None, "int8x2")
    x = torch.randn(9, 256)
    results = []
    for isa in kernel_paths():
        with on_path(isa):
            results.append(lin(x))
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_the_fallback_has_no_residual():
    """Without the C++ kernels the linears multiply float32 x: nothing is left to add."""
    x = torch.randn(2, 64)
    assert torch.equal(OPERATORS["int8_residual"].fallback(x, 32), torch.zeros_like(x))


def test_modules_name_their_activations():
    lin, _ = gguf_linear("Q8_0", torch.randn(8, 32), None, "int8x2")
    assert "activations=int8x2" in repr(lin) and lin.int8_activations
    assert QuantizedLinear.cat([lin, lin]).activations == "int8x2"
    with pytest.raises(ValueError, match="activations: expected one of"):
        gguf_linear("Q8_0", torch.randn(8, 32), None, "int16")
    assert np.array_equal(lin.dequantize().shape, (8, 32))
