"""One vector per sequence from an encoder's hidden states, over the real tokens only.

    vectors = pool(hidden, attention_mask, "mean")         # (B, L, d) -> (B, d)

The modes are sentence-transformers' (its Pooling module): "cls" the first token's state,
"mean" the mean of the real tokens, "max" their elementwise maximum, "mean_sqrt_len" their
sum divided by the square root of their number. A sequence classifier (task_heads.py) and
the sentence embeddings (sentence_embeddings.py) both pool here.
"""

from __future__ import annotations

import torch
from torch import Tensor

POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len")


def check_pooling_mode(mode: str, name: str = "pooling") -> str:
    if mode not in POOLING_MODES:
        raise ValueError(f"{name} must be one of {POOLING_MODES}; got {mode!r}")
    return mode


def pool(hidden: Tensor, attention_mask: Tensor | None, mode: str) -> Tensor:
    """hidden (B, L, d), attention_mask (B, L) with 1/True on real tokens (None: all real) -> (B, d).

    Padded positions take no part; a row without a real token pools to zeros (mean) rather
    than NaN. Sums run in float32 whatever the hidden states' dtype."""
    check_pooling_mode(mode)
    if mode == "cls":
        return hidden[:, 0]
    if attention_mask is None:
        attention_mask = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
    real = attention_mask.to(torch.bool)[..., None]  # (B, L, 1)
    if mode == "max":
        # padding gets the dtype's lowest value, as sentence-transformers does (-1e9 there)
        lowest = torch.finfo(hidden.dtype).min
        return hidden.masked_fill(~real, lowest).max(dim=1).values
    total = (hidden.float() * real).sum(dim=1)  # (B, d)
    count = real.sum(dim=1).float().clamp(min=1.0)  # (B, 1)
    scale = count if mode == "mean" else count.sqrt()
    return (total / scale).to(hidden.dtype)
