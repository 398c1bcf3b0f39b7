"""Llama 3.1/3.2 files' `rope_freqs.weight`: the RoPE scaling parameters it was written from.

llama.cpp's converter does not store Llama 3's rope_scaling (factor, low_freq_factor,
high_freq_factor, original_max_position_embeddings) as metadata; it stores the per-frequency
divisors they imply, one per channel pair, and ggml divides each RoPE frequency by its entry.
For the checkpoint to be the Hugging Face model the file came from (and save as one), the
parameters are recovered here and checked: the divisors Llama 3's rule gives with them must
equal the file's, else the file is refused.

Only the ratios original / low and original / high are visible in the divisors (scaling all
three leaves them unchanged), so low_freq_factor is taken as 1, which is what Meta's configs
hold. The blend between the kept and the divided frequencies is linear in 1 / wavelength; two
blended entries determine it, so a file with fewer is refused.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flashformer.checkpoints.gguf.reader import GGUFError
from flashformer.model.positional import RopeScaling, rope_inverse_frequencies

TOLERANCE = 1e-5  # relative, on a frequency: float32 rounding of the converter's arithmetic


def llama3_rope_parameters(divisors: Tensor, rotary_dim: int, theta: float, source: str) -> dict | None:
    """transformers' rope_parameters (rope_type "llama3") reproducing llama.cpp's `divisors`
    (rotary_dim / 2,), or None when every divisor is 1 (no scaling). Raises GGUFError naming
    `source` when no Llama 3 parameters reproduce them."""
    divisors = divisors.to(torch.float64)
    if torch.all((divisors - 1).abs() <= TOLERANCE):
        return None
    inv_freq = rope_inverse_frequencies(rotary_dim, theta).to(torch.float64)  # (rot/2,)
    wavelength = 2 * math.pi / inv_freq
    factor = divisors.max().item()
    blended = (divisors > 1 + TOLERANCE) & (divisors < factor * (1 - TOLERANCE))
    kept = (divisors - 1).abs() <= TOLERANCE
    divided = (divisors - factor).abs() <= TOLERANCE * factor
    if not torch.all(blended | kept | divided) or blended.sum() < 2:
        raise _refusal(source, divisors, "it is not Llama 3's kept / blended / divided pattern, or blends <2")
    # a blended entry is 1 / ((1 - s) / factor + s) with s = original / wavelength - low over (high - low)
    weight = (1 / divisors[blended] - 1 / factor) / (1 - 1 / factor)  # s per blended entry
    x = 1 / wavelength[blended]
    slope = (weight[-1] - weight[0]) / (x[-1] - x[0])  # original / (high - low)
    intercept = (weight[0] - slope * x[0]).item()  # -low / (high - low)
    if not intercept < 0:
        raise _refusal(source, divisors, "the blend does not fall with the wavelength")
    original, high = -slope.item() / intercept, 1 - 1 / intercept  # with low = 1
    candidates = [(round(original), round(high, 4)), (round(original), high)]
    for original, high in candidates:
        scaling = RopeScaling("llama3", factor, 1.0, high, original)
        ours = rope_inverse_frequencies(rotary_dim, theta, scaling).to(torch.float64)
        if torch.allclose(ours, inv_freq / divisors, rtol=TOLERANCE, atol=0):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": 1.0,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    raise _refusal(source, divisors, "Llama 3's rule does not reproduce them")


def _refusal(source: str, divisors: Tensor, why: str) -> GGUFError:
    shown = ", ".join(f"{d:.4g}" for d in divisors.tolist()[:8])
    return GGUFError(
        f"{source}: tensor 'rope_freqs.weight' holds per-frequency RoPE divisors [{shown}, ...] that "
        f"flashformer cannot express ({why}); supported: Llama 3.1's rope scaling, as llama.cpp's "
        f"converter writes it"
    )
