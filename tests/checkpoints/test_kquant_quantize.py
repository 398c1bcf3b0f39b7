"""checkpoints.gguf.kquant_quantize: float weights to Q4_K / Q5_K / Q6_K blocks.

The blocks are read back by the `gguf` library's dequantizer (an independent reading of the
layout: a misplaced bit shows as a large error). The error is held against the legacy types of
one bit less or the same bits that gguf's own quantizer writes (the K-quants search their
scales and must not do worse on weight-like data), and, where llama-cpp-python is installed,
against llama.cpp's own Q4_K_M quantization of the same f16 file (test_gguf_writer.py)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from flashformer.checkpoints.gguf.kquant_quantize import BLOCK_BYTES, quantize_k


def weights(kind: str, rows: int = 64, cols: int = 1024) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if kind == "gaussian":
        return torch.randn(rows, cols, generator=generator) * 0.02
    # heavy tails, as trained weights have: Student's t with 3 degrees of freedom
    normal = torch.randn(rows, cols, generator=generator)
    chi2 = torch.randn(rows, cols, 3, generator=generator).square().sum(-1)
    return normal / (chi2 / 3).sqrt() * 0.02


def dequantized(blocks: np.ndarray, type_name: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, GGMLQuantizationType[type_name]))


def relative_rms(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).square().mean().sqrt() / exact.square().mean().sqrt())


def legacy_error(values: torch.Tensor, type_name: str) -> float:
    kind = GGMLQuantizationType[type_name]
    blocks = gguf.quants.quantize(values.numpy(), kind)
    return relative_rms(torch.from_numpy(gguf.quants.dequantize(blocks, kind)), values)


@pytest.mark.parametrize("type_name", sorted(BLOCK_BYTES))
def test_blocks_have_the_file_layout(type_name):
    values = weights("gaussian", rows=3, cols=512)
    blocks = quantize_k(values, type_name)
    assert blocks.dtype == np.uint8 and blocks.shape == (3, 2 * BLOCK_BYTES[type_name])
    assert gguf.GGML_QUANT_SIZES[GGMLQuantizationType[type_name]] == (256, BLOCK_BYTES[type_name])


# (K-quant, legacy type it must beat, factor): Q4_K and Q5_K against the same bits with a
# min (Q4_1, Q5_1); Q6_K, one bit more than Q5_1, at most 0.6 of its error (one bit halves it)
BOUNDS = [("Q4_K", "Q4_1", 1.0), ("Q5_K", "Q5_1", 1.0), ("Q6_K", "Q5_1", 0.6)]


@pytest.mark.parametrize("kind", ["gaussian", "heavy-tailed"])
@pytest.mark.parametrize("type_name,legacy,factor", BOUNDS)
def test_error_is_below_the_legacy_type(kind, type_name, legacy, factor):
    values = weights(kind)
    error = relative_rms(dequantized(quantize_k(values, type_name), type_name), values)
    reference = legacy_error(values, legacy)
    assert error < factor * reference, (error, reference)
    assert error > 0.1 * reference  # a real quantization, not a copy


@pytest.mark.parametrize("type_name", sorted(BLOCK_BYTES))
def test_zero_constant_and_outlier_sub_blocks(type_name):
    values = weights("gaussian", rows=4, cols=256)
    values[0] = 0.0  # a row of zeros stays zeros
    values[1, :32] = -0.05  # a constant negative sub-block: all from the min (Q4_K, Q5_K)
    values[2, 100] = 1.0  # one outlier 50 standard deviations out
    values[3, :16] = 0.0  # a zero sub-block inside a row
    back = dequantized(quantize_k(values, type_name), type_name)
    assert torch.equal(back[0], torch.zeros(256))
    assert (back[1, :32] - values[1, :32]).abs().max() < 0.05 * 0.01
    assert abs(back[2, 100] - 1.0) < 0.01
    assert back[3, :16].abs().max() < 0.01 * values[3].abs().max()
    assert relative_rms(back[2], values[2]) < 0.5


def test_chunked_rows_equal_one_call():
    values = weights("heavy-tailed", rows=70, cols=1024)
    whole = quantize_k(values, "Q4_K")
    parts = np.concatenate([quantize_k(values[:33], "Q4_K"), quantize_k(values[33:], "Q4_K")])
    assert np.array_equal(whole, parts)  # each super-block depends only on its own weights


def test_refuses_rows_that_are_not_whole_super_blocks():
    with pytest.raises(ValueError, match=r"multiple of 256.*\(4, 320\)"):
        quantize_k(torch.zeros(4, 320), "Q4_K")
    with pytest.raises(ValueError, match="ggml_type must be one of"):
        quantize_k(torch.zeros(4, 256), "Q3_K")
