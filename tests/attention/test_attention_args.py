"""Bad arguments to flashformer.attention raise errors that name the argument and the shapes."""

from __future__ import annotations

import pytest
import torch

import flashformer


def qkv(B=2, Hq=4, Hk=2, Lq=5, Lk=7, D=8, Dv=None, dtype=torch.float32):
    return (
        torch.randn(B, Hq, Lq, D, dtype=dtype),
        torch.randn(B, Hk, Lk, D, dtype=dtype),
        torch.randn(B, Hk, Lk, Dv or D, dtype=dtype),
    )


def call(q=None, k=None, v=None, **kwargs):
    dq, dk, dv = qkv()
    return flashformer.attention(
        dq if q is None else q, dk if k is None else k, dv if v is None else v, **kwargs
    )


@pytest.mark.parametrize(
    "make_call, error, pattern",
    [
        (lambda: call(q=torch.randn(2, 4, 5)), ValueError, r"q must have 4 dims.*\(2, 4, 5\)"),
        (lambda: call(k=torch.randn(2, 2, 7, 8, 1)), ValueError, r"k must have 4 dims.*\(2, 2, 7, 8, 1\)"),
        (lambda: call(q=torch.randn(2, 3, 5, 8)), ValueError, r"multiple of the key/value heads.*Hq=3.*Hk=2"),
        (lambda: call(k=torch.randn(2, 2, 7, 6)), ValueError, r"head dim D.*\(2, 4, 5, 8\).*\(2, 2, 7, 6\)"),
        (
            lambda: call(v=torch.randn(2, 2, 6, 8)),
            ValueError,
            r"v must have the heads and length of k.*\(2, 2, 6, 8\)",
        ),
        (lambda: call(k=torch.randn(3, 2, 7, 8), v=torch.randn(3, 2, 7, 8)), ValueError, r"batch size"),
        (lambda: call(k=torch.randn(2, 2, 7, 8, dtype=torch.float64)), TypeError, r"share a dtype.*float64"),
        (lambda: call(q=torch.ones(2, 4, 5, 8, dtype=torch.int64)), TypeError, r"q must be float16.*int64"),
        (lambda: call(q=torch.randn(2, 4, 0, 8)), ValueError, r"q must not have an empty dimension"),
        (
            lambda: call(mask=torch.ones(2, 4, 6, 7, dtype=torch.bool)),
            ValueError,
            r"mask of shape \(2, 4, 6, 7\) is not broadcastable to \(B, Hq, Lq, Lk\) = \(2, 4, 5, 7\)",
        ),
        (
            lambda: call(mask=torch.ones(1, 1, 1, 2, 7, dtype=torch.bool)),
            ValueError,
            r"mask must have at most 4 dims",
        ),
        (lambda: call(mask=torch.ones(5, 7)), TypeError, r"mask must be a bool tensor.*float32"),
        (
            lambda: call(key_padding_mask=torch.ones(2, 6, dtype=torch.bool)),
            ValueError,
            r"key_padding_mask must have shape \(B, Lk\) = \(2, 7\); got \(2, 6\)",
        ),
        (
            lambda: call(bias=torch.randn(3, 4, 5, 7)),
            ValueError,
            r"bias of shape \(3, 4, 5, 7\) is not broadcastable",
        ),
        (lambda: call(bias=torch.ones(5, 7, dtype=torch.int32)), TypeError, r"bias must be a float tensor"),
        (
            lambda: call(alibi_slopes=torch.rand(3)),
            ValueError,
            r"alibi_slopes must have shape \(Hq,\) = \(4,\).*got \(3,\)",
        ),
        (lambda: call(window=(-1, 3)), ValueError, r"window sizes must be >= 0.*\(-1, 3\)"),
        (lambda: call(window=(2, 3, 4)), ValueError, r"window must be a \(left, right\) pair"),
        (lambda: call(window=(2.5, 3)), TypeError, r"window left size must be an int"),
        (lambda: call(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\); got 1.0"),
        (lambda: call(dropout_p=-0.1), ValueError, r"dropout_p must be in \[0, 1\); got -0.1"),
        (lambda: call(dropout_p=0.1, dropout_seed=1.5), TypeError, r"dropout_seed must be an int"),
        (lambda: call(softcap=0.0), ValueError, r"softcap must be a positive number"),
        (lambda: call(scale=float("nan")), ValueError, r"scale must be a finite number"),
        (lambda: call(backend="cuda"), ValueError, r"backend must be one of .*'cuda'"),
    ],
)
def test_bad_arguments_are_named(make_call, error, pattern):
    with pytest.raises(error, match=pattern):
        make_call()


def test_broadcastable_shapes_are_accepted():
    q, k, v = qkv(Dv=3)
    for mask in (
        torch.ones(7, dtype=torch.bool),
        torch.ones(5, 1, dtype=torch.bool),
        torch.ones(2, 1, 1, 7, dtype=torch.bool),
        torch.ones(4, 5, 7, dtype=torch.bool),
    ):
        out = flashformer.attention(q, k, v, mask=mask)
        assert out.shape == (2, 4, 5, 3)
    out = flashformer.attention(q, k, v, alibi_slopes=torch.rand(2, 4), window=(None, 2))
    assert out.shape == (2, 4, 5, 3)
