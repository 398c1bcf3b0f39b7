"""The eager backend: the whole score matrix at once, the readable oracle.

Run in float64 it is the reference every other backend is tested against; run
in a low precision it is what a straightforward implementation in that
precision gets (matmuls in the input dtype with float32 accumulation, softmax
in float32), which sets the error budget of the other backends. It is also the
only backend that can hand back the attention probabilities, for plots.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashformer.attention.masks import ScoreRules, dropout_head_keys, dropout_keep


def eager_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rules: ScoreRules,
    scale: float,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (out (B, Hq, Lq, Dv), lse (B, Hq, Lq), probs (B, Hq, Lq, Lk)).

    probs are the softmax weights before dropout; a fully masked row has
    probabilities 0, output 0 and lse -inf (with sinks: lse includes the sink, and the
    probabilities of a row sum to less than 1).
    """
    batch, q_heads, q_len, _ = q.shape
    group = q_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (B, Hq, Lk, D)
    v = v.repeat_interleave(group, dim=1)  # (B, Hq, Lk, Dv)
    score_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32

    scores = (q @ k.transpose(-2, -1)).to(score_dtype) * scale  # (B, Hq, Lq, Lk)
    scores = rules.apply(scores, 0, 0)

    # Softmax with an explicit, detached row max so that a row with no allowed
    # key gives probabilities 0 (and gradient 0) rather than NaN.
    row_max = scores.detach().amax(dim=-1, keepdim=True)  # (B, Hq, Lq, 1)
    sinks = None if rules.sinks is None else rules.sinks.to(score_dtype)  # (1, Hq, 1, 1)
    if sinks is not None:  # the sink joins the max and the sum, not the keys' probabilities
        row_max = torch.maximum(row_max, sinks.detach())
    row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)
    exp_scores = torch.exp(scores - row_max)
    row_sum = exp_scores.sum(dim=-1, keepdim=True)  # (B, Hq, Lq, 1)
    if sinks is not None:
        row_sum = row_sum + torch.exp(sinks - row_max)
    probs = exp_scores / row_sum.masked_fill(row_sum == 0, 1.0)
    lse = (row_max + torch.log(row_sum)).squeeze(-1)  # (B, Hq, Lq), -inf if no key

    weights = probs
    if dropout_p > 0:
        head_keys = dropout_head_keys(dropout_seed, batch, q_heads, q.device)
        keep = dropout_keep(head_keys, 0, q_len, 0, k.shape[2], dropout_p)
        weights = probs * keep / (1.0 - dropout_p)
    out = weights.to(v.dtype) @ v  # (B, Hq, Lq, Dv)
    return out, lse, probs
