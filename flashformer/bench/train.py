"""`flashformer bench train`: training tokens/s and model FLOPs utilization.

One training step (forward with the loss, backward, gradient clipping, AdamW)
of the gpt2-small shape, flashformer against transformers' GPT2LMHeadModel on
the same weights and the same batch, timed in turns in one fresh process per
dtype (bf16 autocast, and float32 for reference).

MFU = the model's FLOPs per step (flashformer.costs: 3x the forward pass's
matmul FLOPs, attention included) / step time / the matmul peak. The peak is
measured in the same process, just before the steps: the best of float32 and
(autocast's) bfloat16 GEMMs of the model's own shapes, so the utilization is
against the fastest matrix multiply this machine did, whatever the dtype.
Writes train.json and train.png.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import flashformer
from flashformer.bench.common import add_run_arguments, bench_main, names, run_worker, time_in_turns
from flashformer.bench.model import batch as model_batch
from flashformer.bench.model import hf_model
from flashformer.files import write_json
from flashformer.formatting import markdown_table
from flashformer.kernels.machine import machine_info

BATCH, LENGTH = 4, 256
DTYPES = ["bfloat16", "float32"]
# rounds per dtype. transformers' bf16 step runs oneDNN's bf16 GEMMs, which on
# CPUs without bf16 matrix units (AVX2) go at 1-5 GFLOP/s (measured: 0.7 for
# the backward's g @ W): about ten minutes per gpt2-small step on 2 cores, so
# bf16 gets one timed round, and transformers no warm-up step there.
FULL = {"dtypes": DTYPES, "layers": None, "rounds": {"float32": 3, "bfloat16": 1}}
QUICK = {"dtypes": DTYPES, "layers": 2, "rounds": {"float32": 2, "bfloat16": 1}}
MODULE = "flashformer.bench.train"
CONTENDERS = ("flashformer", "transformers")


def matmul_peak(d_model: int, d_ff: int, tokens: int, repeats: int = 5) -> dict:
    """GFLOP/s of the model's largest GEMM, (tokens x d_model) @ (d_model x d_ff), per dtype.

    bfloat16 is timed as a native bf16 GEMM (what autocast would run); the
    peak is the best over dtypes and repeats.
    """
    generator = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(tokens, d_model, generator=generator).to(dtype)
        b = torch.randn(d_model, d_ff, generator=generator).to(dtype)
        a @ b  # warm-up
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - started)
        out[str(dtype).removeprefix("torch.")] = 2 * tokens * d_model * d_ff / best / 1e9
    out["peak"] = max(out.values())
    return out


def training_step(model, inputs: dict, dtype: str):
    """forward + loss, backward, clip to norm 1, AdamW step: what the trainer does per step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1)
    autocast = dtype == "bfloat16"

    def step():
        model.train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def timing_worker(point: dict) -> dict:
    from flashformer.costs import estimate

    torch.manual_seed(0)
    theirs = hf_model("gpt2", point["layers"], 0.0)
    with tempfile.TemporaryDirectory() as folder:
        theirs.save_pretrained(folder)
        ours = flashformer.from_pretrained(folder)
    inputs = model_batch("gpt2", ours.config.vocab_size)
    config = ours.config
    peak = matmul_peak(config.d_model, config.d_ff, BATCH * LENGTH)
    works = {
        "flashformer": training_step(ours, inputs, point["dtype"]),
        "transformers": training_step(theirs, inputs, point["dtype"]),
    }
    works["flashformer"]()  # warm-up: first-step allocations, AdamW's state
    if point["dtype"] == "float32":
        works["transformers"]()
    times = time_in_turns(works, rounds=point["rounds"], warmup=False)
    flops = estimate(config, seq_len=LENGTH, batch=BATCH).train_step_flops
    return {
        "times": times,
        "matmul_gflops": peak,
        "train_step_flops": flops,
        "layers": config.n_layers,
        "parameters": ours.num_parameters(),
        "attn_implementation": theirs.config._attn_implementation,
    }


def run(config: dict, out_dir: Path, timeout_s: float) -> dict:
    points, peaks = [], {}
    for dtype in config["dtypes"]:
        rounds = config["rounds"]
        point = {
            "dtype": dtype,
            "layers": config["layers"],
            "rounds": rounds if isinstance(rounds, int) else rounds[dtype],
        }
        result = run_worker(MODULE, point, timeout_s)
        if "error" in result:
            points.append({"dtype": dtype, "error": result["error"]})
            print(f"{dtype:>8}  error: {result['error']}", flush=True)
            continue
        peaks[dtype] = result["matmul_gflops"]
        peak_flops = result["matmul_gflops"]["peak"] * 1e9
        for contender in CONTENDERS:
            seconds = result["times"][contender]
            points.append(
                {
                    "dtype": dtype,
                    "contender": contender,
                    "time_s": seconds,
                    "tokens_per_s": BATCH * LENGTH / seconds,
                    "achieved_gflops": result["train_step_flops"] / seconds / 1e9,
                    "mfu": result["train_step_flops"] / seconds / peak_flops,
                    "train_step_flops": result["train_step_flops"],
                    "layers": result["layers"],
                    "parameters": result["parameters"],
                    "transformers_attention": result["attn_implementation"],
                }
            )
        print(_rows(points, dtype, result["matmul_gflops"]), flush=True)
    payload = {
        "benchmark": "train",
        "batch": BATCH,
        "length": LENGTH,
        "machine": machine_info(),
        "config": config,
        "matmul_gflops": peaks,
        "points": points,
        "ratios": ratios(points),
    }
    write_json(out_dir / "train.json", payload)
    plot(payload, out_dir / "train.png")
    return payload


def _point(points: list[dict], dtype: str, contender: str) -> dict | None:
    for p in points:
        if p.get("dtype") == dtype and p.get("contender") == contender:
            return p
    return None


def _rows(points: list[dict], dtype: str, peak: dict) -> str:
    lines = [
        f"{dtype:>8}  matmul GFLOP/s: "
        + ", ".join(f"{k} {v:.1f}" for k, v in peak.items() if k != "peak")
        + f" (peak {peak['peak']:.1f})"
    ]
    for contender in CONTENDERS:
        p = _point(points, dtype, contender)
        lines.append(
            f"{'':>8}  {contender:>12}: {p['tokens_per_s']:8.1f} tok/s  {p['time_s']:7.2f} s/step  "
            f"{p['achieved_gflops']:6.1f} GFLOP/s  MFU {100 * p['mfu']:5.1f} %"
        )
    return "\n".join(lines)


def ratios(points: list[dict]) -> dict:
    """flashformer tokens/s over transformers tokens/s, per dtype."""
    out = {}
    for dtype in DTYPES:
        ours, theirs = _point(points, dtype, "flashformer"), _point(points, dtype, "transformers")
        if ours and theirs:
            out[dtype] = ours["tokens_per_s"] / theirs["tokens_per_s"]
    return out


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in payload["points"] if "error" not in p]
    dtypes = [d for d in DTYPES if any(p["dtype"] == d for p in points)]
    colors = {"flashformer": "tab:blue", "transformers": "tab:orange"}
    fig, (speed, mfu) = plt.subplots(1, 2, figsize=(10, 4.5))
    width = 0.38
    for offset, contender in enumerate(CONTENDERS):
        xs = [i + (offset - 0.5) * width for i in range(len(dtypes))]
        found = [_point(points, d, contender) for d in dtypes]
        speed.bar(
            xs,
            [p["tokens_per_s"] if p else 0 for p in found],
            width,
            label=contender,
            color=colors[contender],
        )
        mfu.bar(
            xs, [100 * p["mfu"] if p else 0 for p in found], width, label=contender, color=colors[contender]
        )
    for ax, label in ((speed, "training tokens / s"), (mfu, "MFU, % of the measured matmul peak")):
        ax.set_xticks(range(len(dtypes)))
        ax.set_xticklabels(["bf16 autocast" if d == "bfloat16" else d for d in dtypes])
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    layers = {p["layers"] for p in points}
    fig.suptitle(
        f"gpt2-small shape (layers {sorted(layers)}), batch {payload['batch']} x {payload['length']}, "
        f"{payload['machine']['cpu']}, torch {payload['machine']['torch']}",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, quick="2 layers, 2 rounds", timeout=7200, what="dtype")
    parser.add_argument("--dtypes", type=names, help=f"from {','.join(DTYPES)}")
    parser.add_argument("--layers", type=int, help="override the number of layers (default: 12)")
    parser.add_argument("--rounds", type=int, help="timed rounds per contender, for every dtype")


def main_from_args(args: argparse.Namespace) -> dict:
    config = dict(QUICK if args.quick else FULL)
    for key in ("dtypes", "layers", "rounds"):
        if getattr(args, key):
            config[key] = getattr(args, key)
    print(
        f"training benchmark: gpt2-small shape, batch {BATCH} x {LENGTH}, {config['dtypes']}, "
        f"layers {config['layers'] or 12}; one fresh process per dtype, contenders timed in turns"
    )
    payload = run(config, args.out, args.timeout)
    print("\nflashformer / transformers training tokens/s:")
    for dtype, value in payload["ratios"].items():
        print(f"  {dtype}: {value:.2f}x")
    print(f"\nwrote {args.out / 'train.json'} and {args.out / 'train.png'}")
    return payload


def main(argv: list[str] | None = None) -> None:
    bench_main("flashformer bench train", __doc__, add_arguments, main_from_args, timing_worker, argv)


if __name__ == "__main__":
    main()


def table(payload: dict) -> str:
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
