"""Sliding window + global tokens (Longformer / BigBird): every backend that takes them
equals softmax over an explicitly built mask in float64, forward and backward, and the tiled
backend visits only the window's tiles and the global rows and columns."""

from __future__ import annotations

import pytest
import torch

from flashformer.attention import attention
from flashformer.attention.flash import flash_attention
from flashformer.attention.masks import ScoreRules


def explicit_mask(q_len, k_len, left, right, global_tokens, causal):
    """allowed[i, j] for absolute query position i (bottom-right aligned) and key j."""
    i = torch.arange(k_len - q_len, k_len)[:, None]
    j = torch.arange(k_len)[None, :]
    window = (j >= i - left) & (j <= i + right)
    glob = (j < global_tokens) | (i < global_tokens)
    allowed = window | glob
    return allowed & (j <= i) if causal else allowed


def softmax_reference(q, k, v, allowed):
    """float64 softmax(q k^T / sqrt(D)) v over the allowed keys, written out."""
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


CASES = [  # q_len, k_len, window (left, right), global tokens, causal
    (37, 37, (5, 0), 3, True),
    (37, 37, (4, 4), 2, False),
    (6, 41, (7, 0), 4, True),  # new queries after cached keys (a prefill chunk)
    (1, 29, (3, 0), 2, True),  # a decode step
    (3, 3, (1, 0), 5, True),  # more global tokens than positions
]


@pytest.mark.parametrize("q_len, k_len, window, global_tokens, causal", CASES)
@pytest.mark.parametrize("backend", ["eager", "flash", "torch"])
def test_window_and_global_tokens_equal_the_explicit_mask_in_float64(
    q_len, k_len, window, global_tokens, causal, backend
):
    g = torch.Generator().manual_seed(q_len * 100 + k_len)
    q = torch.randn(2, 4, q_len, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, k_len, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, k_len, 8, generator=g, dtype=torch.float64, requires_grad=True)
    allowed = explicit_mask(q_len, k_len, *window, global_tokens, causal)
    expected = softmax_reference(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), allowed)
    out = attention(q, k, v, causal=causal, window=window, global_tokens=global_tokens, backend=backend)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(expected, (q, k, v), grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_tiled_backend_with_small_tiles_equals_the_reference():
    """Tiles of 8 so that the window, the global columns and the skipped tiles all occur."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, 2, 70, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)
    )
    rules = ScoreRules(1, 2, 70, 70, causal=True, window_left=9, global_tokens=3)
    out, _ = flash_attention(q, k, v, rules, 0.5, block_q=8, block_k=8)
    expected = softmax_reference(q, k, v, explicit_mask(70, 70, 9, 0, 3, True))  # scale 0.5 = 4^-1/2
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_the_spans_cover_the_window_and_the_global_keys_only():
    rules = ScoreRules(1, 1, 4096, 4096, causal=True, window_left=255, global_tokens=4)
    assert rules.key_spans(2048, 2304) == [(0, 4), (1793, 2304)]
    assert rules.key_spans(0, 256) == [(0, 256)]  # the first block holds the global queries
    assert rules.query_spans(0, 256) == [(0, 4096)]  # the global keys are seen by every query
    assert rules.query_spans(2048, 2304) == [(2048, 2559)]
    visited = sum(hi - lo for q0 in range(0, 4096, 256) for lo, hi in rules.key_spans(q0, q0 + 256))
    assert visited < 4096 * 4096 / 7  # a window of 256 and 4 global keys, not the n x n square
    assert ScoreRules(1, 1, 64, 64, causal=True, window_left=7).key_spans(32, 40) == [(25, 40)]


def test_global_tokens_are_checked_and_refused_where_unsupported():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="global_tokens must be an int >= 0"):
        attention(q, q, q, causal=True, window=(2, 0), global_tokens=-1)
    with pytest.raises(NotImplementedError, match="global tokens"):
        attention(q[:, :, :1], q, q, causal=True, window=(2, 0), global_tokens=1, backend="cpu")
