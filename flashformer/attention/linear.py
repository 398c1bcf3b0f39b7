"""Kernelized linear attention: an approximation of softmax attention in O(n) time and, when
decoding, an O(1) state.

Softmax attention weighs value j for query i by exp(q_i·k_j / sqrt(D)). Linear attention
replaces that kernel by a product of feature maps, phi(q_i)·phi(k_j), so that the sum over keys
factors (Katharopoulos et al. 2020, "Transformers are RNNs"):

    out_i = phi(q_i)^T S_i / (phi(q_i)^T z_i),   S_i = sum_(j<=i) phi(k_j) v_j^T,   z_i = sum_(j<=i) phi(k_j)

Two feature maps:
- "elu": phi(x) = elu(x) + 1 (Katharopoulos et al.): positive, F = D features, no randomness;
  not an estimate of the softmax kernel, a different kernel the model trains with.
- "favor": Performer's positive orthogonal random features (Choromanski et al. 2021, FAVOR+):
  phi(x) = exp(W x' - |x'|^2 / 2) / sqrt(F) with x' = x / D^(1/4) and W (F, D) orthogonal
  Gaussian blocks, an unbiased estimate of exp(q·k / sqrt(D)). The query's stabilizer (its
  row max, subtracted inside the exp) cancels between numerator and denominator; keys have
  none, as a running prefix sum cannot know the later keys' maximum.

Causal forms, equal to rounding: `causal_linear_attention` (chunked: within a chunk of C
positions the products phi(q) phi(k)^T under a causal mask, across chunks the states S, z
summed chunk by chunk: O(n C D + n D^2) and no n x n matrix) and `linear_attention_step` (the
recurrence, one token: S += phi(k) v^T, z += phi(k)). `approximation_error` measures the output
against exact softmax attention on the same inputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashformer.attention.api import attention

EPS = 1e-6  # added to the denominator phi(q)·z, which is > 0 for positive features


# ---- feature maps ----


class EluFeatures(nn.Module):
    """phi(x) = elu(x) + 1 over the head dim: (..., D) -> (..., D)."""

    def features(self, head_dim: int) -> int:
        return head_dim

    def forward(self, x: Tensor, is_query: bool) -> Tensor:
        return F.elu(x) + 1


class FavorFeatures(nn.Module):
    """Performer's positive orthogonal random features, (..., D) -> (..., F).

    projection: (F, D), rows from blocks of D orthogonal Gaussian directions with chi(D) norms
    (as a Gaussian matrix's rows have), drawn once from `seed` and kept in the state dict.
    """

    def __init__(self, head_dim: int, n_features: int, seed: int = 0):
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("projection", orthogonal_gaussian(n_features, head_dim, seed))

    def features(self, head_dim: int) -> int:
        return self.projection.shape[0]

    def forward(self, x: Tensor, is_query: bool) -> Tensor:
        x = x * self.head_dim**-0.25  # so that phi(q)·phi(k) estimates exp(q·k / sqrt(D))
        logits = x @ self.projection.to(x.dtype).T - (x * x).sum(-1, keepdim=True) / 2  # (..., F)
        if is_query:  # a per-query constant: cancels in the ratio
            logits = logits - logits.detach().amax(-1, keepdim=True)
        return torch.exp(logits) / math.sqrt(self.projection.shape[0])


def orthogonal_gaussian(rows: int, dim: int, seed: int) -> Tensor:
    """(rows, dim): blocks of `dim` orthonormal rows (QR of a Gaussian matrix), each row scaled
    by the norm of a Gaussian vector: FAVOR+'s orthogonal random features."""
    generator = torch.Generator().manual_seed(seed)
    gaussian = torch.randn(-(-rows // dim), dim, dim, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)  # one batched QR: (blocks, dim, dim)
    # QR's own signs favour one direction per column; these make q uniform (Haar)
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]
    directions = q.transpose(-2, -1).reshape(-1, dim)[:rows]  # (rows, dim), unit rows
    norms = torch.randn(rows, dim, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (directions * norms).float()


def make_feature_map(kind: str, head_dim: int, n_features: int, seed: int = 0) -> nn.Module:
    if kind == "elu":
        return EluFeatures()
    if kind == "favor":
        return FavorFeatures(head_dim, n_features, seed)
    raise ValueError(f"linear attention's feature map must be 'elu' or 'favor'; got {kind!r}")


# ---- the causal forms ----


def causal_linear_attention(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, state: tuple[Tensor, Tensor] | None = None, chunk: int = 64
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """The chunked form. phi_q (B, Hq, L, F), phi_k (B, Hk, L, F), v (B, Hk, L, Dv) (GQA: the
    Hq / Hk query heads of a group share one state); state (S (B, Hk, F, Dv), z (B, Hk, F)):
    the sums over earlier tokens, or None. Returns out (B, Hq, L, Dv) and the state after L."""
    batch, q_heads, length, n_feat = phi_q.shape
    kv_heads, dim_v = phi_k.shape[1], v.shape[-1]
    group = q_heads // kv_heads
    chunk = min(chunk, length)
    n_chunks = -(-length // chunk)
    pad = n_chunks * chunk - length  # zero features after the end add nothing to any sum
    phi_q, phi_k, v = (F.pad(t, (0, 0, 0, pad)) for t in (phi_q, phi_k, v))
    qc = phi_q.view(batch, kv_heads, group, n_chunks, chunk, n_feat)  # (B, Hk, G, N, C, F)
    kc = phi_k.view(batch, kv_heads, n_chunks, chunk, n_feat)  # (B, Hk, N, C, F)
    vc = v.view(batch, kv_heads, n_chunks, chunk, dim_v)  # (B, Hk, N, C, Dv)

    chunk_s = torch.einsum("bhncf,bhncd->bhnfd", kc, vc)  # (B, Hk, N, F, Dv): each chunk's sum
    chunk_z = kc.sum(dim=3)  # (B, Hk, N, F)
    s0, z0 = (
        state
        if state is not None
        else (torch.zeros_like(chunk_s[:, :, 0]), torch.zeros_like(chunk_z[:, :, 0]))
    )
    s_before = s0[:, :, None] + chunk_s.cumsum(dim=2) - chunk_s  # (B, Hk, N, F, Dv): the earlier chunks
    z_before = z0[:, :, None] + chunk_z.cumsum(dim=2) - chunk_z  # (B, Hk, N, F)

    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=phi_q.device).tril()
    within = torch.einsum("bhgncf,bhnmf->bhgncm", qc, kc).masked_fill(~causal, 0.0)  # (B, Hk, G, N, C, C)
    numerator = torch.einsum("bhgncf,bhnfd->bhgncd", qc, s_before) + torch.einsum(
        "bhgncm,bhnmd->bhgncd", within, vc
    )  # (B, Hk, G, N, C, Dv)
    denominator = torch.einsum("bhgncf,bhnf->bhgnc", qc, z_before) + within.sum(-1)  # (B, Hk, G, N, C)
    out = numerator / (denominator[..., None] + EPS)
    out = out.reshape(batch, q_heads, n_chunks * chunk, dim_v)[:, :, :length]
    last = (s_before[:, :, -1] + chunk_s[:, :, -1], z_before[:, :, -1] + chunk_z[:, :, -1])
    return out, last


def linear_attention_step(
    phi_q: Tensor, phi_k: Tensor, v: Tensor, state: tuple[Tensor, Tensor]
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """The recurrence, one token: phi_q (B, Hq, 1, F), phi_k (B, Hk, 1, F), v (B, Hk, 1, Dv), state
    (S, z) as in causal_linear_attention. Returns out (B, Hq, 1, Dv) and the next state."""
    s, z = state
    s = s + phi_k[:, :, 0, :, None] * v[:, :, 0, None, :]  # (B, Hk, F, Dv)
    z = z + phi_k[:, :, 0]  # (B, Hk, F)
    batch, q_heads = phi_q.shape[:2]
    q = phi_q[:, :, 0].view(batch, s.shape[1], q_heads // s.shape[1], -1)  # (B, Hk, G, F)
    numerator = torch.einsum("bhgf,bhfd->bhgd", q, s)
    denominator = torch.einsum("bhgf,bhf->bhg", q, z)
    out = numerator / (denominator[..., None] + EPS)  # (B, Hk, G, Dv)
    return out.reshape(batch, q_heads, 1, -1), (s, z)


# ---- against exact attention ----


@torch.no_grad()
def approximation_error(q: Tensor, k: Tensor, v: Tensor, feature_map: nn.Module) -> dict[str, float]:
    """How far causal linear attention's output is from exact causal softmax attention's on
    the same q, k, v (B, H, L, D), both computed in float64: the relative error
    |out - exact|_F / |exact|_F, the largest absolute error, and the mean cosine similarity of
    the output rows."""
    q, k, v = q.double(), k.double(), v.double()
    exact = attention(q, k, v, causal=True, backend="eager")  # (B, H, L, D)
    out, _ = causal_linear_attention(feature_map(q, True), feature_map(k, False), v)
    return {
        "relative_error": float((out - exact).norm() / exact.norm()),
        "max_abs_error": float((out - exact).abs().max()),
        "cosine": float(F.cosine_similarity(out, exact, dim=-1).mean()),
    }
