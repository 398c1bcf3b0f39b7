"""`flashformer cost CONFIG|PRESET`: the estimate as a table, a JSON file, and
a plot of how each part grows with n.

    flashformer cost gpt2 --seq-len 2048 --cache 1024 --batch 8 --out cost-results
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flashformer.costs import alternatives
from flashformer.costs.estimates import Estimate, estimate, resolve_config
from flashformer.costs.flops import CONVENTIONS, GROUPS, closed_form_crossover, crossover_seq_len
from flashformer.costs.traffic import eager_traffic, flash_traffic
from flashformer.formatting import format_bytes, format_count, markdown_table

COMPONENT_NAMES = {
    "embeddings": "embeddings (a lookup)",
    "q_proj": "Q projection",
    "k_proj": "K projection",
    "v_proj": "V projection",
    "attn_scores": "attention scores QKᵀ",
    "attn_values": "attention-weighted sum PV",
    "o_proj": "O projection",
    "cross_q_proj": "cross-attention Q projection",
    "cross_kv_proj": "cross-attention K, V projections",
    "cross_scores": "cross-attention scores",
    "cross_values": "cross-attention weighted sum",
    "cross_o_proj": "cross-attention O projection",
    "ffn": "feed-forward",
    "mlm_transform": "masked-LM transform",
    "lm_head": "LM head",
    "pooler": "pooler",
}


def describe(est: Estimate) -> str:
    c = est.config
    kv = f", h_kv={c.n_kv_heads}" if c.n_kv_heads != c.n_heads else ""
    ffn = "gated " if c.gated_ffn else ""
    layers = f"L={c.n_layers}" + (f"+{c.n_decoder_layers}" if c.arch == "encoder-decoder" else "")
    return (
        f"{c.arch}: d={c.d_model}, {layers}, h={c.n_heads}{kv}, d_k={c.head_dim}, "
        f"{ffn}d_ff={c.d_ff}, V={c.vocab_size}"
    )


def table(est: Estimate, name: str) -> str:
    """The per-component table `flashformer cost` prints: one column per layer
    kind (encoder, decoder), then the whole model."""
    c = est.config
    kinds = list(est.layer_flops)
    pad = " " * (16 * len(kinds))  # under the per-layer columns

    def row(label: str, per_layer: str, value: str, share: str = "") -> str:
        return f"  {label:<32}{per_layer}{value:>12}{share:>8}".rstrip()

    lines = [
        f"{name} ({describe(est)})",
        f"n = {est.seq_len}"
        + (f", decoder n = {est.decoder_len}" if c.arch == "encoder-decoder" else "")
        + f", cache c = {est.cache_len}, batch B = {est.batch}, {str(est.dtype).replace('torch.', '')}; "
        f"causal scores counted as the {est.attention!r} convention",
    ]
    if c.position == "learned" and est.cache_len + max(est.seq_len, est.decoder_len) > c.max_seq_len:
        lines.append(f"(beyond the {c.max_seq_len} learned positions this model can run; the formulas go on)")
    lines += [
        "",
        "forward FLOPs"
        + " " * 21
        + "".join(f"{kind + ' layer':>16}" for kind in kinds)
        + f"{'model':>12}{'share':>8}",
    ]
    for key, value in est.flops.items():
        per_layer = "".join(
            f"{format_count(est.layer_flops[kind][key]) if key in est.layer_flops[kind] else '':>16}"
            for kind in kinds
        )
        lines.append(
            row(
                COMPONENT_NAMES.get(key, key),
                per_layer,
                format_count(value),
                f"{value / est.forward_flops:.1%}",
            )
        )
    lines.append(row("total", pad, format_count(est.forward_flops)))
    lines.append("")
    for group, value in est.grouped_flops().items():
        lines.append(row(group, pad, format_count(value), f"{value / est.forward_flops:.1%}"))
    checkpointing = " (+ recomputation)" if c.activation_checkpointing else ""
    lines += [
        "",
        row("training step" + checkpointing, pad, format_count(est.train_step_flops))
        + f"  = {est.train_step_flops / est.forward_flops:.2f} x forward",
    ]
    if est.decode_step_flops is not None:
        lines.append(
            row(f"decode step (1 token after c={est.cache_len})", pad, format_count(est.decode_step_flops))
        )

    lines += ["", "memory"]
    lines.append(row("parameters", "", format_count(est.parameters)))
    for label, value in (
        ("weights", est.weight_bytes),
        ("gradients", est.gradient_bytes),
        ("AdamW moments", est.optimizer_bytes),
    ):
        lines.append(row(label, "", format_bytes(value)))
    if c.arch != "encoder":
        lines.append(row(f"KV cache (c = {est.cache_len})", "", format_bytes(est.kv_cache_bytes)))
    for backend, saved in est.activations.items():
        lines.append(
            row(f"activations, {backend} attention", "", format_bytes(saved.total))
            + f"  (attention cores {format_bytes(saved.attention)})"
        )
    for backend, modes in est.attention_peak.items():
        lines.append(
            row(f"one attention call, {backend}", "", format_bytes(modes["forward"]))
            + f"  forward; {format_bytes(modes['train'])} forward + backward (peak)"
        )
    traffic = est.hbm_traffic_bytes
    lines += [
        "",
        f"HBM traffic of the forward's attention (on-chip memory M = {format_bytes(est.sram_bytes)}):",
        f"  eager {format_bytes(traffic['eager'])}, FlashAttention {format_bytes(traffic['flash'])}"
        f" ({traffic['eager'] / traffic['flash']:.1f}x less)",
        "",
    ]
    causal = c.arch != "encoder"
    lines.append(f"in one {'decoder (causal)' if causal else 'encoder'} layer:")
    for against, label in (
        ("projections", "the Q, K, V, O projections"),
        ("dense", "projections + feed-forward"),
    ):
        n = crossover_seq_len(c, est.attention, against)
        closed = closed_form_crossover(c, causal, against)
        lines.append(
            f"  attention FLOPs overtake {label} at n = {n} "
            f"(closed form, exact causal count: {closed:.0f} = {closed / c.d_model:.2f}·d)"
        )
    return "\n".join(lines)


def to_json(est: Estimate) -> dict:
    return {
        "config": est.config.to_dict(),
        "seq_len": est.seq_len,
        "decoder_len": est.decoder_len,
        "cache_len": est.cache_len,
        "batch": est.batch,
        "dtype": str(est.dtype).replace("torch.", ""),
        "attention_convention": est.attention,
        "layer_flops": est.layer_flops,
        "flops": est.flops,
        "grouped_flops": est.grouped_flops(),
        "forward_flops": est.forward_flops,
        "backward_flops": est.backward_flops,
        "recomputed_flops": est.recomputed_flops,
        "train_step_flops": est.train_step_flops,
        "decode_step_flops": est.decode_step_flops,
        "parameters": est.parameters,
        "weight_bytes": est.weight_bytes,
        "gradient_bytes": est.gradient_bytes,
        "optimizer_bytes": est.optimizer_bytes,
        "kv_cache_bytes": est.kv_cache_bytes,
        "kv_cache_self_bytes": est.kv_cache_self_bytes,
        "kv_cache_cross_bytes": est.kv_cache_cross_bytes,
        "activation_bytes": est.activation_bytes,
        "activation_parts": {b: vars(saved) for b, saved in est.activations.items()},
        "attention_peak_bytes": est.attention_peak,
        "sram_bytes": est.sram_bytes,
        "hbm_traffic_bytes": est.hbm_traffic_bytes,
        "crossover_seq_len": {
            against: crossover_seq_len(est.config, est.attention, against)
            for against in ("projections", "dense")
        },
    }


def growth_lengths(est: Estimate) -> list[int]:
    """n from 16 to well past the crossover and the requested length, doubling."""
    top = max(4 * crossover_seq_len(est.config, est.attention), 4 * est.seq_len, 4096)
    lengths, n = [], 16
    while n <= top:
        lengths.append(n)
        n *= 2
    return lengths


def plot_growth(est: Estimate, name: str, path: Path) -> None:
    """Left: forward FLOPs per group against n, stacked, log-log, the
    crossovers marked. Right: training memory against n for both backends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config = est.config
    lengths = growth_lengths(est)
    kwargs = dict(batch=est.batch, attention=est.attention, dtype=est.dtype, sram_bytes=est.sram_bytes)
    estimates = [estimate(config, n, **kwargs) for n in lengths]
    colors = dict(zip(GROUPS, ("tab:blue", "tab:red", "tab:green", "tab:gray")))

    fig, (flops_ax, memory_ax) = plt.subplots(1, 2, figsize=(12, 4.8))
    groups = [[e.grouped_flops()[g] for e in estimates] for g in GROUPS]
    flops_ax.stackplot(lengths, groups, labels=GROUPS, colors=[colors[g] for g in GROUPS], alpha=0.8)
    flops_ax.set_xscale("log", base=2)
    flops_ax.set_yscale("log")
    flops_ax.set_ylim(bottom=min(sum(g[0] for g in groups) / 4, groups[1][0] or 1))
    for against, style in (("projections", ":"), ("dense", "--")):
        n = crossover_seq_len(config, est.attention, against)
        label = "projections" if against == "projections" else "projections + feed-forward"
        flops_ax.axvline(n, color="black", linestyle=style, linewidth=1)
        flops_ax.annotate(
            f"attention = {label}\nn = {n} ({n / config.d_model:.1f}·d)",
            (n, 0.02),
            xycoords=("data", "axes fraction"),
            fontsize=8,
            rotation=90,
            ha="right",
            va="bottom",
        )
    flops_ax.set_xlabel("sequence length n")
    flops_ax.set_ylabel("forward FLOPs (stacked)")
    flops_ax.set_title(f"{name}: forward FLOPs by part, B={est.batch}", fontsize=10)
    flops_ax.legend(fontsize=8, loc="upper left")
    flops_ax.grid(True, which="both", alpha=0.3)

    fixed = [e.weight_bytes + e.gradient_bytes + e.optimizer_bytes for e in estimates]
    memory_ax.plot(lengths, fixed, color="tab:gray", label="weights + gradients + AdamW")
    memory_ax.plot(
        lengths, [e.activation_bytes["eager"] for e in estimates], color="tab:red", label="activations, eager"
    )
    memory_ax.plot(
        lengths,
        [e.activation_bytes["flash"] for e in estimates],
        color="tab:blue",
        label="activations, flash",
    )
    memory_ax.plot(
        lengths,
        [e.activations["eager"].attention for e in estimates],
        color="tab:red",
        linestyle=":",
        label="of which attention cores, eager (n²)",
    )
    memory_ax.plot(
        lengths,
        [e.activations["flash"].attention for e in estimates],
        color="tab:blue",
        linestyle=":",
        label="of which attention cores, flash (n)",
    )
    if config.arch != "encoder":
        caches = [estimate(config, 1, cache_len=n, **kwargs).kv_cache_bytes for n in lengths]
        memory_ax.plot(lengths, caches, color="tab:purple", linestyle="--", label="KV cache of c = n tokens")
    memory_ax.set_xscale("log", base=2)
    memory_ax.set_yscale("log", base=2)
    memory_ax.set_xlabel("sequence length n")
    memory_ax.set_ylabel("bytes")
    memory_ax.set_title(f"{name}: training memory, {str(est.dtype).replace('torch.', '')}", fontsize=10)
    memory_ax.legend(fontsize=8)
    memory_ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="a preset name, a config file (YAML/JSON) or a checkpoint / HF folder")
    parser.add_argument("--seq-len", type=int, help="tokens in the forward pass, n (default: max_seq_len)")
    parser.add_argument("--cache", type=int, default=0, help="tokens already in the KV cache, c")
    parser.add_argument("--batch", type=int, default=1, help="sequences, B")
    parser.add_argument("--decoder-len", type=int, help="T5: decoder tokens (default: --seq-len)")
    parser.add_argument(
        "--attention", choices=CONVENTIONS, default="flash", help="how causal scores are counted"
    )
    parser.add_argument("--dtype", default="float32", help="of weights, activations and cache")
    parser.add_argument(
        "--sram", type=int, default=192 * 1024, help="on-chip memory M in bytes, for HBM traffic"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("cost-results"), help="folder for cost.json and cost.png"
    )
    parser.add_argument("--no-plot", action="store_true", help="print the table only")


def main_from_args(args: argparse.Namespace) -> Estimate | list[dict]:
    config = resolve_config(args.config)
    if alternatives.family(config) != "transformer":
        return alternatives_report(config, args)
    est = estimate(
        config,
        config.max_seq_len if args.seq_len is None else args.seq_len,
        cache_len=args.cache,
        batch=args.batch,
        decoder_len=args.decoder_len,
        attention=args.attention,
        dtype=args.dtype,
        sram_bytes=args.sram,
    )
    name = Path(args.config).name if Path(args.config).exists() else args.config
    print(table(est, name))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cost.json").write_text(json.dumps(to_json(est), indent=2))
    written = [args.out / "cost.json"]
    if not args.no_plot:
        plot_growth(est, name, args.out / "cost.png")
        written.append(args.out / "cost.png")
    print(f"\nwrote {' and '.join(str(p) for p in written)}")
    return est


def alternatives_report(config, args: argparse.Namespace) -> list[dict]:
    """`flashformer cost` for a recurrent model or a windowed / linear-attention decoder
    (costs/alternatives.py): FLOPs and decoding memory against n, from 512 to 16k or --seq-len."""
    lengths = [args.seq_len] if args.seq_len else [512 * 2**i for i in range(6)]
    name = Path(args.config).name if Path(args.config).exists() else args.config
    print(f"{name}: {alternatives.family(config)}, d={config.d_model}, L={config.n_layers}, B={args.batch}")
    print(alternatives.table(config, lengths, args.batch))
    rows = alternatives.cost_rows(config, lengths, args.batch)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cost.json").write_text(
        json.dumps({"family": alternatives.family(config), "rows": rows}, indent=2)
    )
    print(f"\nwrote {args.out / 'cost.json'}")
    return rows


# ---- the tables and figures of docs/costs.md ----

COST_PRESETS = ["bert-base", "gpt2", "t5-small", "llama-small"]


def preset_costs_table() -> str:
    """The figures of each preset in COST_PRESETS (docs/costs.md)."""
    rows = []
    for name in COST_PRESETS:
        config = resolve_config(name)
        n = 1024 if config.max_seq_len >= 1024 else config.max_seq_len
        est = estimate(config, n)
        decode = estimate(config, 1, cache_len=n).decode_step_flops if config.arch != "encoder" else None
        kv_token = estimate(config, 1, cache_len=1).kv_cache_self_bytes if config.arch != "encoder" else 0
        rows.append(
            [
                name,
                f"{est.parameters / 1e6:.1f} M",
                str(n),
                f"{est.forward_flops / 1e9:.1f}",
                f"{est.train_step_flops / 1e9:.1f}",
                "-" if decode is None else f"{decode / 1e6:.0f}",
                "-" if not kv_token else format_bytes(kv_token),
                format_bytes(est.activation_bytes["eager"]),
                format_bytes(est.activation_bytes["flash"]),
                f"{crossover_seq_len(config, 'flash', 'projections')} / {crossover_seq_len(config)}",
            ]
        )
    header = [
        "preset",
        "parameters",
        "n",
        "forward GFLOPs",
        "train step GFLOPs",
        "decode step MFLOPs (c = n)",
        "KV cache per token",
        "activations, eager",
        "activations, flash",
        "crossover n: projections / all dense",
    ]
    return "Batch 1, float32, causal scores counted as the flash backend computes them.\n\n" + markdown_table(
        header, rows
    )


def plot_io_traffic(path: Path) -> None:
    """HBM traffic of one head's forward, eager against FlashAttention, from costs.traffic."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [2**k for k in range(7, 16)]
    fig, (bytes_ax, ratio_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for d, style in ((64, "-"), (128, "--")):
        bytes_ax.plot(
            ns, [eager_traffic(n, n, d, 2) for n in ns], style, color="tab:red", label=f"eager, d={d}"
        )
        for sram, color in ((48 * 1024, "tab:cyan"), (192 * 1024, "tab:blue")):
            flash = [flash_traffic(n, n, d, False, sram, 2) for n in ns]
            bytes_ax.plot(ns, flash, style, color=color, label=f"flash, d={d}, M={sram // 1024} KiB")
            ratio = [eager_traffic(n, n, d, 2) / f for n, f in zip(ns, flash)]
            ratio_ax.plot(ns, ratio, style, color=color, label=f"d={d}, M={sram // 1024} KiB")
    for ax in (bytes_ax, ratio_ax):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length n (full attention, one head, fp16)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    bytes_ax.set_yscale("log")
    bytes_ax.set_ylabel("bytes read + written in HBM")
    bytes_ax.set_title("HBM traffic: Θ(n·d + n²) against Θ(n²·d²/M)", fontsize=10)
    ratio_ax.set_ylabel("eager / flash")
    ratio_ax.set_title("traffic saved: about M / (2·d²·e) for large n", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
