"""`flashformer bench attention --device cuda`: TFLOP/s of attention kernels on a GPU.

For each head dim D, causal or not, and sequence length n, q, k, v are
bfloat16 tensors of shape (B, H, n, D) with B * n = 16384 tokens and
H * D = 2048 (the sizes flash-attn's own benchmarks use), and each method is
timed forward and backward (CUDA events; median of repeats after warm-up).
FLOPs follow the usual convention: forward 4 * B * H * n * n * D (two
matmuls), halved for causal; backward 2.5x the forward (five matmuls, two of
them recomputation-free in the count).

Methods: flashformer's `triton` and `flash` backends; PyTorch SDPA forced to
each of its backends (flash, efficient, cudnn) with sdpa_kernel; and
FlexAttention compiled with torch.compile (a block mask for causal). Each
method runs in its own process, so a kernel that fails (or a CUDA error that
poisons the context) costs only its own points; a method that runs out of its
time keeps the points it finished. Writes attention_cuda.json and
attention_cuda.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from flashformer.files import write_json
from flashformer.kernels.machine import machine_info

TOKENS, MODEL_DIM = 16384, 2048
METHODS = ["triton", "flash", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex"]
FULL = {"ns": [512, 1024, 2048, 4096, 8192, 16384], "head_dims": [64, 128, 256], "causal": [False, True]}
QUICK = {"ns": [1024, 4096, 8192], "head_dims": [64, 128], "causal": [False, True]}
FLASH_MAX_N = 4096  # the PyTorch-ops tiled backend runs its tile loop in Python: slow beyond this
MODULE = "flashformer.bench.attention_cuda"


def flops(batch: int, heads: int, n: int, dim: int, causal: bool, mode: str) -> float:
    forward = 4.0 * batch * heads * n * n * dim / (2 if causal else 1)
    return forward if mode == "forward" else 2.5 * forward


def _attention_fn(method: str, causal: bool, n: int):
    """A function (q, k, v) -> out for one method (built once per point)."""
    import torch.nn.functional as F

    import flashformer

    if method in ("triton", "flash"):
        return lambda q, k, v: flashformer.attention(q, k, v, causal=causal, backend=method)
    if method.startswith("sdpa_"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {
            "sdpa_flash": SDPBackend.FLASH_ATTENTION,
            "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
            "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
        }[method]

        def sdpa(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return sdpa
    if method == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = _compiled_flex(flex_attention)
        block_mask = None
        if causal:
            block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, n, n)
        return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


_flex_cache: list = []


def _compiled_flex(flex_attention):
    if not _flex_cache:
        _flex_cache.append(torch.compile(flex_attention))
    return _flex_cache[0]


def _median_ms(fn, min_reps: int = 5, max_reps: int = 30, budget_ms: float = 300.0) -> float:
    """Median of timed calls (CUDA events), after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    while len(times) < max_reps and (len(times) < min_reps or sum(times) < budget_ms):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(method: str, dim: int, causal: bool, n: int) -> dict:
    """Forward and backward TFLOP/s of one point."""
    batch, heads = max(1, TOKENS // n), MODEL_DIM // dim
    point = {"method": method, "head_dim": dim, "causal": causal, "n": n, "batch": batch, "heads": heads}
    if method == "flash" and n > FLASH_MAX_N:
        return {**point, "skipped": f"n > {FLASH_MAX_N} (the tile loop runs in Python)"}
    torch.manual_seed(0)
    q, k, v = (
        torch.randn(batch, heads, n, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    grad_out = torch.randn_like(q)
    attend = _attention_fn(method, causal, n)

    def forward():
        with torch.no_grad():
            attend(q, k, v)

    out = attend(q, k, v)

    def backward():
        torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)

    for mode, fn in (("forward", forward), ("backward", backward)):
        ms = _median_ms(fn)
        point[mode] = {"ms": ms, "tflops": flops(batch, heads, n, dim, causal, mode) / (ms * 1e-3) / 1e12}
    return point


def worker(config: dict) -> None:
    """Measures one method over the config, printing one JSON line per point."""
    for dim in config["head_dims"]:
        for causal in config["causal"]:
            for n in config["ns"]:
                try:
                    point = measure(config["method"], dim, causal, n)
                except Exception as error:  # a kernel's refusal or failure is a result, not a crash
                    point = {"method": config["method"], "head_dim": dim, "causal": causal, "n": n}
                    point["error"] = (
                        f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
                    )
                print(json.dumps(point), flush=True)
                torch.cuda.empty_cache()


def _run_method(method: str, config: dict, timeout_s: float) -> list[dict]:
    command = [sys.executable, "-m", MODULE, "--worker", json.dumps({**config, "method": method})]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
        stdout, note = done.stdout, None
        if done.returncode != 0:
            tail = (done.stderr.strip().splitlines() or [""])[-1]
            note = f"worker exit code {done.returncode}: {tail[:200]}"
    except subprocess.TimeoutExpired as expired:
        stdout = expired.stdout.decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        note = f"timed out after {timeout_s:.0f} s"
    points = []
    for line in stdout.splitlines():
        if line.startswith("{"):
            points.append(json.loads(line))
    if note:
        done_keys = {(p["head_dim"], p["causal"], p["n"]) for p in points}
        for dim in config["head_dims"]:
            for causal in config["causal"]:
                for n in config["ns"]:
                    if (dim, causal, n) not in done_keys:
                        points.append(
                            {"method": method, "head_dim": dim, "causal": causal, "n": n, "error": note}
                        )
    return points


def _row(p: dict) -> str:
    head = f"{p['method']:>15} D={p['head_dim']:>3} {'causal' if p['causal'] else 'full':>6} n={p['n']:>6}"
    if "skipped" in p:
        return f"{head}  skipped: {p['skipped']}"
    if "error" in p:
        return f"{head}  error: {p['error']}"
    return (
        f"{head}  fwd {p['forward']['tflops']:7.1f} TFLOP/s ({p['forward']['ms']:8.3f} ms)"
        f"   bwd {p['backward']['tflops']:7.1f} TFLOP/s ({p['backward']['ms']:8.3f} ms)"
    )


def _tflops(points, method, dim, causal, n, mode):
    for p in points:
        if (p["method"], p["head_dim"], p["causal"], p["n"]) == (method, dim, causal, n) and mode in p:
            return p[mode]["tflops"]
    return None


def targets(points: list[dict]) -> dict:
    """The issue's targets read off this run: bf16, D = 128, n >= 4096 (None where not measured)."""
    result = {}
    for causal in (False, True):
        for n in sorted({p["n"] for p in points if p["n"] >= 4096}):
            for mode, goal in (("forward", 450), ("backward", 250)):
                mine = _tflops(points, "triton", 128, causal, n, mode)
                sdpa = [_tflops(points, m, 128, causal, n, mode) for m in METHODS if m.startswith("sdpa_")]
                best = max((s for s in sdpa if s is not None), default=None)
                label = f"D128 {'causal' if causal else 'full'} n={n} {mode}"
                result[f"{label}: triton TFLOP/s (target >= {goal})"] = mine
                result[f"{label}: triton / best SDPA backend (target >= 0.9)"] = (
                    None if mine is None or not best else mine / best
                )
    return result


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config, points = payload["config"], payload["points"]
    columns = [(causal, mode) for causal in config["causal"] for mode in ("forward", "backward")]
    fig, axes = plt.subplots(
        len(config["head_dims"]),
        len(columns),
        figsize=(4.5 * len(columns), 3.6 * len(config["head_dims"])),
        squeeze=False,
    )
    for row, dim in enumerate(config["head_dims"]):
        for col, (causal, mode) in enumerate(columns):
            ax = axes[row][col]
            for method in payload["methods"]:
                xs = [n for n in config["ns"] if _tflops(points, method, dim, causal, n, mode) is not None]
                if xs:
                    ys = [_tflops(points, method, dim, causal, n, mode) for n in xs]
                    ax.plot(xs, ys, marker="o", label=method)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length n")
            ax.set_ylabel("TFLOP/s")
            ax.set_title(f"D={dim}, {'causal' if causal else 'non-causal'}, {mode}", fontsize=10)
            ax.grid(True, alpha=0.3)
            if row == 0 and col == 0:
                ax.legend(fontsize=8)
    fig.suptitle(f"attention, bf16, B*n={TOKENS}, H*D={MODEL_DIM}, {payload['machine'].get('cuda')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main_from_args(args: argparse.Namespace) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available to torch")
    config = {key: list(value) for key, value in (QUICK if args.quick else FULL).items()}
    if args.ns:
        config["ns"] = args.ns
    if args.head_dims:
        config["head_dims"] = args.head_dims
    methods = args.methods or METHODS
    print(
        f"attention on {torch.cuda.get_device_name()}: bf16, B*n={TOKENS}, H*D={MODEL_DIM}, "
        f"methods {', '.join(methods)}, each in its own process"
    )
    points = []
    for method in methods:
        method_points = _run_method(method, config, args.method_timeout)
        for point in method_points:
            print(_row(point), flush=True)
        points += method_points
    payload = {
        "benchmark": "attention_cuda",
        "dtype": "bfloat16",
        "tokens": TOKENS,
        "model_dim": MODEL_DIM,
        "flop_convention": "forward 4*B*H*n*n*D (halved for causal); backward 2.5x forward",
        "machine": machine_info(),
        "config": config,
        "methods": methods,
        "points": points,
        "targets": targets(points),
    }
    write_json(args.out / "attention_cuda.json", payload)
    plot(payload, args.out / "attention_cuda.png")
    print("\ntargets (measured in this run):")
    for name, value in payload["targets"].items():
        print(f"  {name}: {'not measured' if value is None else f'{value:.3g}'}")
    print(f"\nwrote {args.out / 'attention_cuda.json'} and {args.out / 'attention_cuda.png'}")
    return payload


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=MODULE)
    parser.add_argument("--worker", required=True)
    worker(json.loads(parser.parse_args(argv).worker))


if __name__ == "__main__":
    main()
