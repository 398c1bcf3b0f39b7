"""Which (query block, key block) tiles the flash backend visits, for a few
masks: the work FlashAttention's block skipping saves, drawn."""

from __future__ import annotations

from pathlib import Path

from flashformer.attention.flash import BLOCK_K, BLOCK_Q
from flashformer.attention.masks import ScoreRules


def plot(path: Path) -> None:
    """Which (query block, key block) tiles the flash backend visits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    cases = [
        ("causal, n = 2048", dict(q_len=2048, k_len=2048, causal=True)),
        ("causal, 1024 new after 1024 cached", dict(q_len=1024, k_len=2048, causal=True)),
        ("causal, window (512, 0)", dict(q_len=2048, k_len=2048, causal=True, window_left=512)),
    ]
    fig, axes = plt.subplots(1, len(cases), figsize=(13, 4.6))
    for ax, (title, kwargs) in zip(axes, cases):
        rules = ScoreRules(batch=1, q_heads=1, **kwargs)
        visited = full = 0
        for q0 in range(0, rules.q_len, BLOCK_Q):
            q1 = min(rules.q_len, q0 + BLOCK_Q)
            k_lo, k_hi = rules.key_range(q0, q1)
            for k0 in range(0, rules.k_len, BLOCK_K):
                k1 = min(rules.k_len, k0 + BLOCK_K)
                inside = k_lo < k1 and k0 < k_hi
                covered = inside and rules.band_covers(q0, q1, k0, k1)
                color = "tab:blue" if covered else "tab:orange" if inside else "whitesmoke"
                ax.add_patch(Rectangle((k0, q0), k1 - k0, q1 - q0, facecolor=color, edgecolor="gray"))
                visited += inside
                full += 1
        ax.set_xlim(0, rules.k_len)
        ax.set_ylim(rules.q_len, 0)
        ax.set_aspect("equal")
        ax.set_xlabel("key position")
        ax.set_ylabel("query")
        ax.set_title(f"{title}\n{visited} of {full} tiles visited", fontsize=10)
    handles = [Rectangle((0, 0), 1, 1, facecolor=c) for c in ("tab:blue", "tab:orange", "whitesmoke")]
    fig.legend(
        handles,
        ["visited, no masking work", "visited, masked inside", "skipped"],
        loc="lower center",
        ncol=3,
        fontsize=9,
    )
    fig.suptitle(f"flash backend tiles ({BLOCK_Q} x {BLOCK_K}), bottom-right causal alignment", fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)
