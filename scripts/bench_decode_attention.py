"""attention() for a few queries over a static KV cache on the CPU: the C++ kernel (backend
"cpu") against SDPA (backend "torch"); writes JSON and a PNG.

Each case is one attention() call, causal, its keys and values a view of a preallocated cache
(B, Hk, max_len, D) as a decode step sees them, for three models' head shapes (SmolLM2-135M
9/3 heads of 64, GPT-2-small 12/12 of 64, Llama-3-8B 32/8 of 128), batches of 1 and 8, 1, 4 or
8 queries a row and 128, 512 or 2048 keys. The backends are timed in turns; a case's time is the
minimum over rounds of the mean over calls (a shared machine's noise only adds). The ratio
decides cpu_kernel.MAX_Q_LEN.

    python scripts/bench_decode_attention.py [--threads N] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch

from flashformer.attention import attention
from flashformer.kernels.machine import machine_info

HEADS = {"SmolLM2 9/3x64": (9, 3, 64), "GPT-2 12/12x64": (12, 12, 64), "Llama-3-8B 32/8x128": (32, 8, 128)}
BACKENDS = ("cpu", "torch")


def best_us(fn, calls: int, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="bench_decode_attention")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    results = []
    with torch.no_grad():
        for model, (q_heads, kv_heads, dim) in HEADS.items():
            for batch in (1, 8):
                for q_len in (1, 4, 8):
                    for k_len in (128, 512, 2048):
                        cache = torch.randn(2, batch, kv_heads, k_len + 64, dim, generator=gen)
                        k, v = cache[0, :, :, :k_len], cache[1, :, :, :k_len]  # (B, Hk, Lk, D) views
                        q = torch.randn(batch, q_heads, q_len, dim, generator=gen)
                        calls = max(3, int(20000 / (batch * q_len * k_len * q_heads * dim / 64) ** 0.5))
                        times = {}
                        for _ in range(args.rounds):  # in turns
                            for backend in BACKENDS:
                                run = functools.partial(attention, q, k, v, causal=True, backend=backend)
                                times[backend] = min(times.get(backend, float("inf")), best_us(run, calls, 1))
                        row = {
                            "model": model,
                            "batch": batch,
                            "q_len": q_len,
                            "k_len": k_len,
                            "us": {name: round(value, 1) for name, value in times.items()},
                            "torch_over_cpu": round(times["torch"] / times["cpu"], 2),
                        }
                        print(json.dumps(row), flush=True)
                        results.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = {"machine": machine_info(), "threads": args.threads, "results": results}
    (out / "decode-attention-cpu.json").write_text(json.dumps(info, indent=1))
    _plot(results, out / "decode-attention-cpu.png")


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(HEADS), figsize=(15, 4.5), sharey=True)
    for ax, model in zip(axes, HEADS):
        rows = [r for r in results if r["model"] == model]
        labels = [f"B{r['batch']} q{r['q_len']}\nk{r['k_len']}" for r in rows]
        ratios = [r["torch_over_cpu"] for r in rows]
        colors = ["tab:green" if r["q_len"] <= 4 else "tab:gray" for r in rows]
        ax.bar(range(len(rows)), ratios, color=colors)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(rows)), labels, fontsize=6)
        ax.set_title(model, fontsize=9)
    axes[0].set_ylabel("SDPA time / C++ kernel time (> 1: kernel faster)")
    fig.suptitle("Decode attention over a static cache, CPU (green: what auto gives the kernel)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
