"""Positional encodings: the position-dependent pieces that attention reads.

ALiBi and T5's relative bias are never handed to attention as an (n, n)
tensor: ALiBi goes as per-head slopes, T5's bias as a function of query and
key positions that the tiled backends evaluate one tile at a time.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's per-head slopes (Press et al., 2022), (num_heads,) float32.

    For a power of two n the slopes are the geometric sequence 2^(-8/n),
    2^(-16/n), ...; otherwise the sequence of the nearest lower power of two is
    completed with every other slope of the sequence for twice that power.
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1; got {num_heads}")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    lower = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(lower)
    if lower < num_heads:
        slopes += geometric(2 * lower)[0::2][: num_heads - lower]
    return torch.tensor(slopes, dtype=torch.float32)


def t5_relative_bucket(
    relative_position: Tensor, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """T5's bucket index of (key position - query position), an int64 tensor.

    Half the buckets (per direction) hold exact small distances; the rest cover
    distances up to max_distance on a log scale, and anything farther shares
    the last bucket. A decoder (bidirectional=False) sees only the past, so
    future keys all land in bucket 0.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    # log-spaced buckets for max_exact <= distance < max_distance
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    far = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, far)
