"""`flashformer viz positional`: how each positional encoding depends on distance.

Four panels, each computed with flashformer's own implementation:
sinusoidal: PE(p) · PE(p + Δ) against Δ (it depends on Δ alone);
RoPE: the score of a query and a key that are the same vector q = k,
rotated to positions p and p + Δ, against Δ: Σ_i 2·cos(Δ·θ_i)·(q_i² + q_{i+d/2}²),
the long-term decay of the RoFormer paper, with and without Llama 3.1's scaling;
T5: the bucket of every relative position, bidirectional and causal;
ALiBi: the bias -m_h·|Δ| of each head.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from flashformer.model.positional import (
    RopeScaling,
    RotaryEmbedding,
    alibi_slopes,
    apply_rotary,
    sinusoidal_embedding,
    t5_relative_bucket,
)


def sinusoidal_similarity(distances: torch.Tensor, dim: int, position: int = 0) -> torch.Tensor:
    """PE(position) · PE(position + Δ) for each Δ: Σ_i cos(Δ·ω_i), whatever the position."""
    start = sinusoidal_embedding(torch.tensor([position]), dim)  # (1, dim)
    moved = sinusoidal_embedding(position + distances, dim)  # (len, dim)
    return moved @ start[0]


def rope_similarity(
    distances: torch.Tensor, head_dim: int, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """(R_0 q) · (R_Δ q) for q = all ones: the RoPE score of a token with a copy
    of itself Δ positions away, through RotaryEmbedding and apply_rotary."""
    rope = RotaryEmbedding(head_dim, scaling=scaling)
    q = torch.ones(1, 1, 1, head_dim)
    cos0, sin0 = rope(torch.zeros(1, dtype=torch.long))
    query = apply_rotary(q, cos0, sin0)  # (1, 1, 1, D) at position 0
    cos, sin = rope(distances)
    keys = apply_rotary(q.expand(1, 1, len(distances), head_dim), cos, sin)  # (1, 1, len, D)
    return (keys[0, 0] @ query[0, 0, 0]).detach()


def plot(path: Path, dim: int = 128, heads: int = 8) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (sin_ax, rope_ax), (t5_ax, alibi_ax) = axes

    distances = torch.arange(0, 1025)
    for d in (64, dim):
        sin_ax.plot(distances, sinusoidal_similarity(distances, d) / d * 2, label=f"d = {d}")
    sin_ax.set_title("sinusoidal: PE(p)·PE(p+Δ) / (d/2)", fontsize=10)
    sin_ax.set_xlabel("distance Δ")
    sin_ax.legend(fontsize=8)

    distances = torch.arange(0, 8193)
    llama3 = RopeScaling("llama3", factor=8.0, original_max_seq_len=1024)
    rope_ax.plot(distances, rope_similarity(distances, dim) / dim, label=f"RoPE, d_k = {dim}, θ = 10000")
    rope_ax.plot(
        distances,
        rope_similarity(distances, dim, llama3) / dim,
        label="with Llama 3.1 scaling (×8 beyond 1024)",
        alpha=0.8,
    )
    rope_ax.set_xscale("symlog", linthresh=16)
    rope_ax.set_title("RoPE: (R₀ q)·(R_Δ q) / d_k for q = 1 (long-term decay)", fontsize=10)
    rope_ax.set_xlabel("distance Δ")
    rope_ax.legend(fontsize=8)

    relative = torch.arange(-200, 201)
    for bidirectional, label in ((True, "encoder (bidirectional)"), (False, "decoder (causal)")):
        t5_ax.step(relative, t5_relative_bucket(relative, bidirectional), where="mid", label=label)
    t5_ax.axvline(0, color="gray", linewidth=0.5)
    t5_ax.set_title("T5: bucket of key − query (32 buckets, max distance 128)", fontsize=10)
    t5_ax.set_xlabel("key position − query position")
    t5_ax.set_ylabel("bucket")
    t5_ax.legend(fontsize=8)

    distances = torch.arange(0, 65)
    for head, slope in enumerate(alibi_slopes(heads).tolist()):
        alibi_ax.plot(distances, -slope * distances, label=f"head {head}: m = {slope:.4g}")
    alibi_ax.set_title(f"ALiBi: bias −m·|Δ| per head ({heads} heads)", fontsize=10)
    alibi_ax.set_xlabel("distance |Δ|")
    alibi_ax.legend(fontsize=7, ncol=2)

    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("positional.png"), help="PNG to write")
    parser.add_argument(
        "--dim", type=int, default=128, help="model / head width of the sinusoidal and RoPE panels"
    )
    parser.add_argument("--heads", type=int, default=8, help="heads of the ALiBi panel")


def main_from_args(args: argparse.Namespace) -> Path:
    if args.dim < 2 or args.dim % 2:
        raise ValueError(f"--dim must be an even number >= 2; got {args.dim}")
    if args.heads < 1:
        raise ValueError(f"--heads must be >= 1; got {args.heads}")
    plot(args.out, args.dim, args.heads)
    print(f"wrote {args.out}")
    return args.out
