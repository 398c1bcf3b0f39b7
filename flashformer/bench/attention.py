"""`flashformer bench attention`: time and peak memory of each backend against n.

For every (variant, dtype, n, backend) a fresh worker process builds
q, k, v of shape (B=1, H=8, n, D=64) and measures the forward pass (no grad)
and the forward + backward pass: median time, and the peak memory added on
top of the inputs (see common.py). Variants: causal; causal with ALiBi
slopes; causal with a T5-style relative bias given as a function of
positions. Eager and torch materialize an (n, n) bias for the last two; flash
never does. Writes attention.json and attention.png to the output folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import flashformer
from flashformer import costs
from flashformer.bench.common import (
    add_run_arguments,
    bench_main,
    measure_peak,
    names,
    numbers,
    run_worker,
    time_in_turns,
)
from flashformer.files import write_json
from flashformer.formatting import format_bytes, markdown_table
from flashformer.kernels.machine import machine_info
from flashformer.model.positional import alibi_slopes, t5_relative_bucket

BATCH, HEADS, HEAD_DIM = 1, 8, 64
BACKENDS = ["eager", "flash", "torch"]
VARIANTS = ["causal", "alibi", "relative_bias"]
FULL = {"ns": [512, 1024, 2048, 4096, 8192, 16384], "dtypes": ["float32", "bfloat16"], "variants": VARIANTS}
# SDPA's bfloat16 backward on the CPU takes minutes per call beyond this
LARGEST_N = {"bfloat16": 8192, "float16": 8192}
QUICK = {"ns": [256, 512, 1024, 2048], "dtypes": ["float32"], "variants": ["causal", "alibi"]}
MODULE = "flashformer.bench.attention"
MEMORY_LIMIT = 0.75  # of the machine's RAM: points predicted above it are skipped, not run


def attention_kwargs(variant: str, device, train: bool) -> dict:
    kwargs = {"causal": True}
    if variant == "alibi":
        kwargs["alibi_slopes"] = alibi_slopes(HEADS).to(device)
    elif variant == "relative_bias":
        table = torch.randn(32, HEADS, device=device, requires_grad=train)  # T5's (buckets, heads)

        def relative_bias(q_pos, k_pos):  # (H, len(q_pos), len(k_pos))
            # The bias depends on k - q alone: bucket the len(q) + len(k) - 1
            # distinct distances of this tile of consecutive positions, then
            # lay them out as a Toeplitz tile (row i starts at distance k0 - q_i).
            distances = torch.arange(int(k_pos[0] - q_pos[-1]), int(k_pos[-1] - q_pos[0]) + 1, device=device)
            per_distance = table[t5_relative_bucket(distances, bidirectional=False)].T  # (H, Lq+Lk-1)
            return per_distance.unfold(1, len(k_pos), 1).flip(1)  # (H, Lq, Lk)

        kwargs["bias"] = relative_bias
    return kwargs


def _inputs(point: dict):
    torch.manual_seed(0)
    dtype = getattr(torch, point["dtype"])
    shape = (BATCH, HEADS, point["n"], HEAD_DIM)
    q, k, v = (torch.randn(shape, dtype=dtype, device=point["device"]) for _ in range(3))
    return q, k, v, torch.randn_like(q)


def _work(point: dict, backend: str, train: bool, q, k, v, grad_out):
    """One forward (no grad) or one forward + backward of one backend."""
    for t in (q, k, v):
        t.requires_grad_(train)
    kwargs = attention_kwargs(point["variant"], point["device"], train)

    def work():
        if not train:
            with torch.no_grad():
                flashformer.attention(q, k, v, backend=backend, **kwargs)
            return
        out = flashformer.attention(q, k, v, backend=backend, **kwargs)
        out.backward(grad_out)
        for t in (q, k, v):
            t.grad = None

    return work


def memory_worker(point: dict) -> dict:
    """Peak extra memory of one forward and one forward + backward."""
    q, k, v, grad_out = _inputs(point)
    return {
        mode: measure_peak(_work(point, point["backend"], mode == "train", q, k, v, grad_out))
        for mode in ("forward", "train")
    }


def timing_worker(point: dict) -> dict:
    """Median times of several backends, timed in turns in one process so
    that the machine's load at any moment weighs on all of them alike."""
    q, k, v, grad_out = _inputs(point)
    return time_in_turns(
        {
            f"{backend}/{mode}": _work(point, backend, mode == "train", q, k, v, grad_out)
            for backend in point["backends"]
            for mode in ("forward", "train")
        },
        rounds=point["rounds"],
        warmup=point["warmup"],
    )


def predicted_bytes(backend: str, variant: str, n: int, dtype: str) -> float:
    """A rough upper estimate of a point's peak, to skip what cannot fit.

    Eager keeps about seven (H, n, n) float32 tensors alive in its backward
    (measured: 6.1 at n = 2048); torch keeps about three when it must
    materialize a bias.
    """
    square = BATCH * HEADS * n * n * 4
    if backend == "eager":
        return 7 * square
    if backend == "torch" and variant != "causal":
        return 3 * square
    return 64 * BATCH * HEADS * n * HEAD_DIM * 4


def total_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 16 * 2**30


def run(config: dict, out_dir: Path, device: str, timeout_s: float) -> dict:
    limit = MEMORY_LIMIT * total_memory()
    points = []
    for variant in config["variants"]:
        for dtype in config["dtypes"]:
            for n in config["ns"]:
                if n > LARGEST_N.get(dtype, n):
                    continue
                group = []
                for backend in BACKENDS:
                    point = {"variant": variant, "dtype": dtype, "n": n, "backend": backend, "device": device}
                    estimate = predicted_bytes(backend, variant, n, dtype)
                    if estimate > limit:
                        point["skipped"] = f"predicted {format_bytes(estimate)} > limit {format_bytes(limit)}"
                    else:
                        point.update(run_worker(MODULE, {"kind": "memory", **point}, timeout_s))
                    group.append(point)
                timed = [p["backend"] for p in group if "skipped" not in p and "error" not in p]
                if config.get("memory_only"):
                    timed = []
                large = n >= 8192
                times = (
                    {}
                    if not timed
                    else run_worker(
                        MODULE,
                        {
                            "kind": "timing",
                            "variant": variant,
                            "dtype": dtype,
                            "n": n,
                            "device": device,
                            "backends": timed,
                            "rounds": 2 if large else 3,
                            "warmup": not large,
                        },
                        timeout_s * len(timed),
                    )
                )
                for point in group:
                    if "error" in times and point["backend"] in timed:
                        point["error"] = times["error"]
                    for mode in ("forward", "train"):
                        if f"{point['backend']}/{mode}" in times:
                            point.setdefault(mode, {})["time_s"] = times[f"{point['backend']}/{mode}"]
                    points.append(point)
                    print(_row(point), flush=True)
    payload = {
        "benchmark": "attention",
        "shape": {"batch": BATCH, "heads": HEADS, "head_dim": HEAD_DIM},
        "machine": machine_info(),
        "config": config,
        "points": points,
        "targets": targets(points),
    }
    write_json(out_dir / "attention.json", payload)
    plot(payload, out_dir / "attention.png")
    return payload


def _row(p: dict) -> str:
    head = f"{p['variant']:>13} {p['dtype']:>8} n={p['n']:>6} {p['backend']:>5}"
    if "skipped" in p:
        return f"{head}  skipped: {p['skipped']}"
    if "error" in p:
        return f"{head}  error: {p['error']}"
    fwd, train = p.get("forward", {}), p.get("train", {})
    return (
        f"{head}  fwd {_ms(fwd.get('time_s'))} {format_bytes(fwd.get('peak_extra_bytes')):>10}"
        f"   fwd+bwd {_ms(train.get('time_s'))} {format_bytes(train.get('peak_extra_bytes')):>10}"
    )


def _ms(seconds: float | None) -> str:
    return f"{'-':>9}   " if seconds is None else f"{seconds * 1e3:9.1f} ms"


def _lookup(points, variant, dtype, n, backend, mode, key):
    for p in points:
        if (p["variant"], p["dtype"], p["n"], p["backend"]) == (variant, dtype, n, backend):
            return p.get(mode, {}).get(key)
    return None


def targets(points: list[dict]) -> dict:
    """The issue's targets, as ratios read off this run (None where not measured)."""

    def ratio(a, b):
        return None if a is None or b is None or b == 0 else a / b

    def get(variant, dtype, n, backend, key="time_s", mode="train"):
        return _lookup(points, variant, dtype, n, backend, mode, key)

    mem = "peak_extra_bytes"
    materializing = [
        get(v, "float32", 8192, b, mem) for v in ("alibi", "relative_bias") for b in ("eager", "torch")
    ]
    return {
        "fp32_n8192_train_time_flash_over_torch (<= 1.5)": ratio(
            get("causal", "float32", 8192, "flash"), get("causal", "float32", 8192, "torch")
        ),
        "fp32_n8192_train_memory_flash_over_torch (<= 2)": ratio(
            get("causal", "float32", 8192, "flash", mem), get("causal", "float32", 8192, "torch", mem)
        ),
        "fp32_n8192_train_memory_flash_over_eager (<= 0.1)": ratio(
            get("causal", "float32", 8192, "flash", mem), get("causal", "float32", 8192, "eager", mem)
        ),
        "fp32_train_memory_growth_flash_n4096_to_n16384 (<= 5)": ratio(
            get("causal", "float32", 16384, "flash", mem), get("causal", "float32", 4096, "flash", mem)
        ),
        "fp32_n8192_alibi_train_memory_materializing_over_flash (>= 10)": ratio(
            min((m for m in materializing[:2] if m is not None), default=None),
            get("alibi", "float32", 8192, "flash", mem),
        ),
        "fp32_n8192_relative_bias_train_memory_materializing_over_flash (>= 10)": ratio(
            min((m for m in materializing[2:] if m is not None), default=None),
            get("relative_bias", "float32", 8192, "flash", mem),
        ),
        "bf16_n8192_train_time_flash_over_torch (<= 3)": ratio(
            get("causal", "bfloat16", 8192, "flash"), get("causal", "bfloat16", 8192, "torch")
        ),
    }


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config, points = payload["config"], payload["points"]
    variants = config["variants"]
    columns = [
        ("forward", "time_s", "forward time (s)"),
        ("train", "time_s", "forward+backward time (s)"),
        ("train", "peak_extra_bytes", "forward+backward peak extra memory (MiB)"),
    ]
    fig, axes = plt.subplots(len(variants), 3, figsize=(15, 4 * len(variants)), squeeze=False)
    colors = {"eager": "tab:red", "flash": "tab:blue", "torch": "tab:green"}
    styles = {"float32": "-", "bfloat16": "--"}
    for row, variant in enumerate(variants):
        for col, (mode, key, label) in enumerate(columns):
            ax = axes[row][col]
            for dtype in config["dtypes"]:
                for backend in BACKENDS:
                    xs, ys = [], []
                    for n in config["ns"]:
                        value = _lookup(points, variant, dtype, n, backend, mode, key)
                        if value is not None:
                            xs.append(n)
                            ys.append(value / 2**20 if key == "peak_extra_bytes" else value)
                    if xs:
                        ax.plot(
                            xs,
                            ys,
                            styles.get(dtype, ":"),
                            marker="o",
                            color=colors[backend],
                            label=f"{backend} {dtype}",
                        )
            if not ax.lines:  # e.g. the times of a --memory-only run
                ax.text(0.5, 0.5, "not measured in this run", ha="center", transform=ax.transAxes)
                ax.set_xticks([])
                ax.set_yticks([])
            else:
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
            ax.set_xlabel("sequence length n")
            ax.set_title(f"{variant}: {label}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if (
                row == 0
                and ax.get_legend_handles_labels()[0]
                and not any(a.get_legend() for a in axes[0][:col])
            ):
                ax.legend(fontsize=8)  # once, in the first panel with data (memory-only runs have no times)
    shape = payload["shape"]
    fig.suptitle(
        f"attention, B={shape['batch']} H={shape['heads']} D={shape['head_dim']}, "
        f"{payload['machine']['cpu']}, torch {payload['machine']['torch']}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, quick="a small run: n <= 2048, float32", timeout=1800, what="point")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ns", type=numbers, help="e.g. 512,1024")
    parser.add_argument("--dtypes", type=names, help="e.g. float32,bfloat16")
    parser.add_argument("--variants", type=names, help=f"from {','.join(VARIANTS)}")
    parser.add_argument("--memory-only", action="store_true", help="peak memory only, no timing")
    parser.add_argument("--head-dims", type=numbers, help="--device cuda: e.g. 64,128")
    parser.add_argument("--methods", type=names, help="--device cuda: e.g. triton,sdpa_flash")
    parser.add_argument(
        "--method-timeout", type=float, default=900, help="--device cuda: seconds allowed per method"
    )


def main_from_args(args: argparse.Namespace) -> dict:
    if args.device.startswith("cuda"):  # TFLOP/s of the GPU kernels: its own module
        from flashformer.bench import attention_cuda

        return attention_cuda.main_from_args(args)
    config = dict(QUICK if args.quick else FULL)
    for key in ("ns", "dtypes", "variants"):
        if getattr(args, key):
            config[key] = getattr(args, key)
    config["memory_only"] = bool(getattr(args, "memory_only", False))
    print(
        f"attention benchmark: B={BATCH} H={HEADS} D={HEAD_DIM}, device {args.device}, "
        f"each point in a fresh process"
    )
    payload = run(config, args.out, args.device, args.timeout)
    print("\ntargets (ratios measured in this run):")
    for name, value in payload["targets"].items():
        print(f"  {name}: {'not measured' if value is None else f'{value:.3g}'}")
    print(f"\nwrote {args.out / 'attention.json'} and {args.out / 'attention.png'}")
    return payload


def worker(point: dict) -> dict:
    return (memory_worker if point["kind"] == "memory" else timing_worker)(point)


def main(argv: list[str] | None = None) -> None:
    bench_main("flashformer bench attention", __doc__, add_arguments, main_from_args, worker, argv)


if __name__ == "__main__":
    main()


# ---- tables and figures of the results (docs/benchmarks.md, docs/costs.md) ----


def table(payload: dict) -> str:
    """Time and peak memory of each point, with the formulas' memory beside the measured one."""

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
