"""Random but valid GGUF blocks of the types gguf's quantizer does not write (its K-quants), and
gguf's dequantization of them: weights for the kernels' tests."""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf.quants import dequantize as gguf_dequantize

# bytes per block, values per block, byte offsets of the float16 fields: d first, then dmin or m
LAYOUT = {
    "Q5_0": (22, 32, (0,)),
    "Q5_1": (24, 32, (0, 2)),
    "Q4_K": (144, 256, (0, 2)),
    "Q5_K": (176, 256, (0, 2)),
    "Q6_K": (210, 256, (208,)),
}


def random_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Valid blocks of an (n, k) tensor: random bytes, the float16 fields set to sane scales
    (Q5_1's m negative, as a block's minimum usually is)."""
    nbytes, values, halves = LAYOUT[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // values, nbytes), dtype=np.uint8)
    for i, at in enumerate(halves):
        scale = rng.uniform(0.5, 1.5, size=(n, k // values)) * (0.002 if values == 256 else 0.05)
        sign = -1 if (type_name == "Q5_1" and i == 1) else 1
        raw[..., at : at + 2] = (sign * scale).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def dequantized(type_name: str, raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(raw, getattr(gguf.GGMLQuantizationType, type_name)))
