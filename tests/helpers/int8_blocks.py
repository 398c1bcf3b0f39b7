"""x as the quantized kernels' int8 activations read it, written out in numpy: the reference of
the kernels' tests (tests/kernels/test_kernels_quantized.py, _kquants.py, _int8x2.py)."""

from __future__ import annotations

import numpy as np
import torch


def quantize_activations(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x (M, K) float32 -> the float64 values of its int8 blocks of `block` (32, or 256: llama.cpp's
    Q8_K): d = amax / 127, q = round(x * 127 / amax) (half to even), in float32 as the kernels
    compute them. K need not be whole blocks (the kernels pad x with zeros)."""
    k = x.shape[1]
    padded = torch.nn.functional.pad(x, (0, -k % block))
    blocks = padded.numpy().reshape(x.shape[0], -1, block)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inverse)
    values = q.astype(np.float64) * (amax / np.float32(127)).astype(np.float64)
    return torch.from_numpy(values.reshape(x.shape[0], -1)[:, :k])


def int8_residual(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x's rounding error under its int8 blocks, in float32 as the kernels compute it: x - d q,
    d q rounded to float32 first (the int8x2 activations' second x row, csrc/products.h)."""
    return x - quantize_activations(x, block).float()
