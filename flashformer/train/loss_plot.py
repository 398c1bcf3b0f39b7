"""The loss curves of a training run: training and validation loss against
steps, and validation bits per byte beside the corpus' unigram entropy (language
modelling) or the task's validation metrics (fine-tuning)."""

from __future__ import annotations

import json
from pathlib import Path


def plot_losses(metrics_path: Path, png_path: Path, unigram_bits_per_byte: float | None = None) -> None:
    """Training and validation loss against steps; validation bits per byte
    beside the corpus' unigram entropy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    bpb = [(r["step"], r["val_bits_per_byte"]) for r in records if "val_bits_per_byte" in r]
    not_scores = {"val_loss", "val_perplexity", "val_bits_per_byte"}
    scores = sorted(
        {
            k
            for r in records
            for k, v in r.items()
            if k.startswith("val_") and k not in not_scores and type(v) is float
        }
    )
    panels = 2 if bpb or scores else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    ax = axes[0][0]
    if train:
        ax.plot(*zip(*train), label="train loss", alpha=0.8)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    if bpb:
        ax = axes[0][1]
        ax.plot(*zip(*bpb), "o-", color="tab:orange", label="validation")
        if unigram_bits_per_byte is not None:
            ax.axhline(unigram_bits_per_byte, color="gray", linestyle="--", label="unigram entropy")
        ax.set_xlabel("step")
        ax.set_ylabel("bits per byte")
        ax.grid(alpha=0.3)
        ax.legend()
    elif scores:
        ax = axes[0][1]
        for key in scores:
            ax.plot(
                *zip(*[(r["step"], r[key]) for r in records if key in r]),
                "o-",
                label=key.removeprefix("val_"),
            )
        ax.set_xlabel("step")
        ax.set_ylabel("validation metric")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
