"""Speed of the quantized layers' activation schemes on one GGUF file, each scheme in fresh
processes taken in turns: batch-1 decode tokens/s (128 tokens after a short prompt) and prompt
tokens/s (512 tokens), 2 threads, the native decoder (scripts/bench_isa_turns.py's measure).

    PYTHONPATH=. python scripts/bench_activations.py FILE [--activations int8,int8-float32-head]
                                                      [--repeats 5] [--threads 2] [--out FILE.json]

Prints one line per process with the load average, then each scheme's best, median and range and
its best and median over the first scheme's; --out writes them with every process's rates and
the machine as JSON (docs/figures/activations/, tabled in docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

NEW, PROMPT = 128, 512


def worker(path: str, activations: str, threads: int) -> dict:
    import torch

    import flashformer
    from flashformer.kernels.quantized import kernel_isa

    torch.set_num_threads(threads)
    model, tokenizer = flashformer.load(path, quantize="gguf", activations=activations)
    ids = torch.tensor([tokenizer.encode("Once upon a time, in a lighthouse by the sea,")])
    long_ids = torch.tensor([(ids[0].tolist() * PROMPT)[:PROMPT]])

    def run(batch, n):
        started = time.perf_counter()
        model.generate(batch, max_new_tokens=n, eos_token_id=[])
        return time.perf_counter() - started

    run(ids, 4)
    run(long_ids, 1)
    decode = min(run(ids, NEW + 1) - run(ids, 1) for _ in range(2))
    prompt = min(run(long_ids, 1) for _ in range(2))
    return {"isa": kernel_isa(), "decode": NEW / decode, "prompt": PROMPT / prompt}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument("--activations", default="int8,int8-float32-head", help="schemes, the baseline first")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.file, args.worker, args.threads)))
        return
    schemes = args.activations.split(",")
    runs: dict[str, list] = {name: [] for name in schemes}
    for repeat in range(args.repeats):
        for name in schemes if repeat % 2 == 0 else schemes[::-1]:
            load = os.getloadavg()[0]
            cmd = [sys.executable, __file__, args.file, "--worker", name, "--threads", str(args.threads)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            rates = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{name:20s} {json.dumps(rates)} load {load:.2f}", flush=True)
            runs[name].append({**rates, "load_average": load})
    summary = {
        name: {
            key: {
                "best": max(r[key] for r in found),
                "median": statistics.median(r[key] for r in found),
                "worst": min(r[key] for r in found),
            }
            for key in ("decode", "prompt")
        }
        for name, found in runs.items()
    }
    first = summary[schemes[0]]
    for name, rates in summary.items():
        for key, r in rates.items():
            print(
                f"{name:20s} {key:6s} best {r['best']:.1f}, median {r['median']:.1f}, range "
                f"{r['worst']:.1f}-{r['best']:.1f}; over {schemes[0]}: best {r['best'] / first[key]['best']:.3f}, "
                f"median {r['median'] / first[key]['median']:.3f}"
            )
    if args.out:
        from flashformer.files import write_json
        from flashformer.kernels.machine import machine_info

        config = {"file": args.file, "schemes": schemes, "threads": args.threads, "repeats": args.repeats}
        write_json(args.out, {"machine": machine_info(), "config": config, "runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
