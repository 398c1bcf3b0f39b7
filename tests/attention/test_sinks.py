"""Attention sinks (gpt-oss): one learned logit per query head in every row's softmax
denominator, against a float64 reference written as transformers writes it (the sink appended as
one more column of scores, the softmax taken, the column dropped)."""

from __future__ import annotations

import pytest
import torch

from flashformer.attention import attention
from flashformer.attention.checks import check_and_describe
from flashformer.attention.flash import flash_attention


def reference(q, k, v, sinks, window_left=None):
    """float64, causal (bottom-right), an optional left window; GQA by repeating k and v."""
    q, k, v, sinks = q.double(), k.double(), v.double(), sinks.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # (B, H, Lq, Lk)
    lq, lk = scores.shape[-2:]
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    allowed = j <= i
    if window_left is not None:
        allowed &= j >= i - window_left
    scores = scores.masked_fill(~allowed, float("-inf"))
    column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    lse = torch.logsumexp(torch.cat([scores, column], dim=-1), dim=-1)
    return probs @ v, lse


def inputs(batch=2, q_heads=4, kv_heads=2, q_len=7, k_len=11, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, q_len, dim, generator=g)
    k = torch.randn(batch, kv_heads, k_len, dim, generator=g)
    v = torch.randn(batch, kv_heads, k_len, dim, generator=g)
    sinks = torch.randn(q_heads, generator=g) * 2
    return q, k, v, sinks


@pytest.mark.parametrize("backend", ["eager", "flash", "auto"])
@pytest.mark.parametrize("window", [None, (3, 0)])
def test_sinks_match_the_float64_reference(backend, window):
    q, k, v, sinks = inputs()
    want, want_lse = reference(q, k, v, sinks, None if window is None else window[0])
    out, lse = attention(q, k, v, causal=True, window=window, sinks=sinks, backend=backend, return_lse=True)
    assert (out.double() - want).abs().max() < 1e-5
    assert (lse.double() - want_lse).abs().max() < 1e-5
    plain = attention(q, k, v, causal=True, window=window, backend=backend)
    assert (plain.double() - want).abs().max() > 1e-3  # the sinks changed the result


def test_sinks_in_small_tiles_and_one_query_rows():
    """The online softmax starts from the sink in every query block, whatever the tiling."""
    q, k, v, sinks = inputs(q_len=9, k_len=40)
    rules = check_and_describe(q, k, v, True, None, None, None, None, (12, 0), None, 0, sinks)
    out, lse = flash_attention(q, k, v, rules, q.shape[-1] ** -0.5, block_q=4, block_k=8)
    want, want_lse = reference(q, k, v, sinks, 12)
    assert (out.double() - want).abs().max() < 1e-5 and (lse.double() - want_lse).abs().max() < 1e-5
    decode = attention(q[:, :, -1:], k, v, causal=True, sinks=sinks)  # what a decode step asks
    assert (decode.double() - reference(q[:, :, -1:], k, v, sinks)[0]).abs().max() < 1e-5


def test_a_row_with_no_key_gives_zero_and_the_sink_as_lse():
    q, k, v, sinks = inputs(batch=1, q_len=3, k_len=3)
    padding = torch.tensor([[False, False, False]])
    for backend in ("eager", "flash"):
        out, lse = attention(q, k, v, key_padding_mask=padding, sinks=sinks, backend=backend, return_lse=True)
        assert out.abs().max() == 0
        assert torch.allclose(lse, sinks.view(1, -1, 1).expand_as(lse))


@pytest.mark.parametrize("backend", ["eager", "flash"])
def test_sink_gradients_match_the_float64_reference(backend):
    q, k, v, sinks = inputs(q_len=6, k_len=6)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = attention(*leaves[:3], causal=True, sinks=leaves[3], backend=backend)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    ref_leaves = [t.double().clone().requires_grad_() for t in (q, k, v, sinks)]
    (reference(*ref_leaves)[0] * weights.double()).sum().backward()
    for got, want in zip(leaves, ref_leaves):
        assert (got.grad.double() - want.grad).abs().max() < 1e-4


def test_backends_without_sinks_refuse_them_by_name():
    q, k, v, sinks = inputs(batch=1, q_len=1)
    with pytest.raises(NotImplementedError, match="backend='torch' does not support attention sinks"):
        attention(q, k, v, causal=True, sinks=sinks, backend="torch")
    with (
        torch.no_grad(),
        pytest.raises(NotImplementedError, match="backend='cpu' does not support attention sinks"),
    ):
        attention(q, k, v, causal=True, sinks=sinks, backend="cpu")
    with pytest.raises(ValueError, match=r"sinks must have shape \(Hq,\) = \(4,\); got \(2,\)"):
        attention(q, k, v, sinks=sinks[:2])
    with pytest.raises(TypeError, match="sinks must be a float tensor"):
        attention(q, k, v, sinks=torch.ones(4, dtype=torch.int64))
