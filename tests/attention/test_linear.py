"""Kernelized linear attention: the chunked causal form equals the recurrent step and the
naive float64 sum over keys; Performer's features estimate the softmax kernel, and the
output's distance from exact attention is measured."""

from __future__ import annotations

import pytest
import torch

from flashformer.attention.linear import (
    EluFeatures,
    FavorFeatures,
    approximation_error,
    causal_linear_attention,
    linear_attention_step,
    orthogonal_gaussian,
)


def naive_linear_attention(phi_q, phi_k, v):
    """out_i = sum_(j<=i) (phi_q_i · phi_k_j) v_j / sum_(j<=i) phi_q_i · phi_k_j, float64, with the
    query heads of a group reading their shared key / value head."""
    group = phi_q.shape[1] // phi_k.shape[1]
    phi_k, v = phi_k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    weights = (phi_q @ phi_k.transpose(-2, -1)).tril()  # (B, H, L, L)
    return (weights @ v) / (weights.sum(-1, keepdim=True) + 1e-6)


def features(feature_map, length=29, q_heads=4, kv_heads=2, dim=8):
    g = torch.Generator().manual_seed(length)
    q = torch.randn(2, q_heads, length, dim, generator=g, dtype=torch.float64)
    k = torch.randn(2, kv_heads, length, dim, generator=g, dtype=torch.float64)
    v = torch.randn(2, kv_heads, length, dim, generator=g, dtype=torch.float64)
    return feature_map(q, True), feature_map(k, False), v


MAPS = {"elu": EluFeatures(), "favor": FavorFeatures(8, 16, seed=3)}


@pytest.mark.parametrize("name", sorted(MAPS))
@pytest.mark.parametrize("length, chunk", [(29, 8), (29, 64), (16, 4), (1, 64), (7, 1)])
def test_the_chunked_form_equals_the_naive_sum_in_float64(name, length, chunk):
    phi_q, phi_k, v = features(MAPS[name], length)
    out, (s, z) = causal_linear_attention(phi_q, phi_k, v, chunk=chunk)
    torch.testing.assert_close(out, naive_linear_attention(phi_q, phi_k, v), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, phi_k.transpose(-2, -1) @ v, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z, phi_k.sum(2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(MAPS))
def test_the_recurrent_step_equals_the_chunked_form(name):
    phi_q, phi_k, v = features(MAPS[name], 23)
    whole, _ = causal_linear_attention(phi_q, phi_k, v, chunk=8)
    out, state = causal_linear_attention(phi_q[:, :, :5], phi_k[:, :, :5], v[:, :, :5])  # a prompt
    steps = [out]
    for t in range(5, 23):
        out, state = linear_attention_step(
            phi_q[:, :, t : t + 1], phi_k[:, :, t : t + 1], v[:, :, t : t + 1], state
        )
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=2), whole, rtol=1e-12, atol=1e-12)


def test_orthogonal_features_are_orthogonal_within_a_block():
    w = orthogonal_gaussian(20, 8, seed=0).double()
    directions = w[:8] / w[:8].norm(dim=1, keepdim=True)
    torch.testing.assert_close(
        directions @ directions.T, torch.eye(8, dtype=torch.float64), atol=1e-6, rtol=0
    )


def test_favor_features_estimate_the_softmax_kernel():
    """phi(q)·phi(k) is an unbiased estimate of exp(q·k / sqrt(D)) whose error shrinks like
    1/sqrt(F): with 8192 features a few percent on average (the query's stabilizer, which
    cancels in attention, is put back here)."""
    g = torch.Generator().manual_seed(0)
    q, k = (0.5 * torch.randn(16, 8, generator=g, dtype=torch.float64) for _ in range(2))
    exact = torch.exp(q @ k.T / 8**0.5)
    errors = {}
    for n_features in (64, 8192):
        favor = FavorFeatures(8, n_features, seed=0).double()
        x = q * 8**-0.25
        logits = x @ favor.projection.double().T - (x * x).sum(-1, keepdim=True) / 2
        estimate = (favor(q, True) @ favor(k, False).T) * torch.exp(logits.amax(-1, keepdim=True))
        errors[n_features] = float(((estimate - exact).abs() / exact).mean())
    assert errors[8192] < 0.03 and errors[8192] < errors[64] / 5, errors


def test_the_error_against_exact_attention_is_measured_and_falls_with_more_features():
    g = torch.Generator().manual_seed(0)
    q, k, v = (0.5 * torch.randn(1, 2, 64, 16, generator=g) for _ in range(3))
    errors = {
        m: approximation_error(q, k, v, FavorFeatures(16, m, seed=0))["relative_error"] for m in (16, 4096)
    }
    elu = approximation_error(q, k, v, EluFeatures())
    assert errors[4096] < errors[16] and errors[4096] < 0.05, errors
    assert 0 < elu["relative_error"] < 1 and 0 < elu["cosine"] <= 1 and elu["max_abs_error"] > 0
