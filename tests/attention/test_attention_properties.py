"""Hypothesis-generated shapes and feature mixes: every backend equals eager in float64."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashformer
from flashformer.attention import flash

sides = st.one_of(st.none(), st.integers(0, 20))


@st.composite
def requests(draw):
    B, Hk, G = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    Lq, Lk = draw(st.integers(1, 70)), draw(st.integers(1, 70))
    D, Dv = draw(st.sampled_from([8, 16, 40, 64])), draw(st.sampled_from([8, 24]))
    seed = draw(st.integers(0, 2**31))
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hk * G, Lq, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, Hk, Lk, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, Hk, Lk, Dv, generator=gen, dtype=torch.float64)
    kwargs = {"causal": draw(st.booleans())}
    if draw(st.booleans()):
        kwargs["window"] = (draw(sides), draw(sides))
    if draw(st.booleans()):
        kwargs["key_padding_mask"] = torch.rand(B, Lk, generator=gen) > 0.3
    if draw(st.booleans()):
        shape = [draw(st.sampled_from([1, n])) for n in (B, Hk * G, Lq, Lk)]
        kwargs["bias"] = torch.randn(shape, generator=gen, dtype=torch.float64)
    if draw(st.booleans()):
        kwargs["alibi_slopes"] = torch.rand(Hk * G, generator=gen, dtype=torch.float64)
    if draw(st.booleans()):
        kwargs["softcap"] = draw(st.floats(1.0, 30.0))
    if draw(st.booleans()):
        kwargs["dropout_p"], kwargs["dropout_seed"] = draw(st.floats(0.0, 0.9)), seed
    blocks = (draw(st.integers(1, 48)), draw(st.integers(1, 48)))
    return q, k, v, kwargs, blocks


@pytest.mark.filterwarnings("ignore")
@settings(max_examples=80, deadline=None)
@given(requests())
def test_flash_and_torch_equal_eager_in_float64(request):
    q, k, v, kwargs, (block_q, block_k) = request
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    grad_out = torch.randn(*q.shape[:3], v.shape[-1], dtype=torch.float64)

    def forward_backward(backend):
        out, lse = flashformer.attention(q, k, v, backend=backend, return_lse=True, **kwargs)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), grad_out))

    ref = forward_backward("eager")
    flash_blocks = (flash.BLOCK_Q, flash.BLOCK_K)
    flash.BLOCK_Q, flash.BLOCK_K = block_q, block_k
    try:
        got = forward_backward("flash")
    finally:
        flash.BLOCK_Q, flash.BLOCK_K = flash_blocks
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        assert not torch.isnan(a).any(), name
        assert torch.equal(torch.isinf(a), torch.isinf(b)), name
        assert (a - b).nan_to_num(0.0).abs().max() < 1e-10, name
    if not {"softcap", "dropout_p"} & set(kwargs):
        out = flashformer.attention(q, k, v, backend="torch", **kwargs)
        assert (out - ref[0]).abs().max() < 1e-10
