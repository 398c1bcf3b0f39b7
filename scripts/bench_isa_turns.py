"""flashformer against llama.cpp on one GGUF file, each in fresh processes taken in turns, as
issue 27's table asks: batch-1 decode tokens/s (128 tokens after a short prompt) and prompt
tokens/s (512 tokens), 2 threads; the best of --repeats fresh processes per contender.

    PYTHONPATH=. python scripts/bench_isa_turns.py FILE [--isa avx2] [--llama-bench PATH]
                                                   [--repeats 5] [--threads 2] [--out FILE.json]

Contenders: flashformer as typed (`flashformer.load(FILE)`, no flag: the file's own blocks on
the native decoder, nothing compiled; its peak RSS beside the file's and the KV cache's bytes; --isa sets FLASHFORMER_CPU_ISA and ATEN_CPU_CAPABILITY
in its processes),
llama.cpp's `llama-bench -p 512 -n 128 -r 3` (-r: --llama-bench-repetitions) when --llama-bench is given, else
llama-cpp-python (native only). Prints one line per process with the load average, then each
contender's best, median and range (and --out writes them, every process's rates and the
machine as JSON, which flashformer/bench/turns.py tables in docs/benchmarks.md).
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


def flashformer_worker(path: str, threads: int) -> dict:
    import torch

    import flashformer
    from flashformer.kernels.quantized import kernel_isa

    torch.set_num_threads(threads)
    model, tokenizer = flashformer.load(path)  # as typed: no flag (a GGUF file's own blocks)
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
    return {"isa": kernel_isa(), "decode": NEW / decode, "prompt": PROMPT / prompt, **memory(model, path)}


def memory(model, path: str) -> dict:
    """The process's peak RSS against what it must hold: the file, and the KV cache of the longest
    sequence run (the prompt's 512 + 1 tokens, keys and values in the model's cache type)."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    config = model.config
    element = 2 if getattr(model, "kv_cache_dtype", None) is not None else 4  # float16, else float32
    kv = 2 * config.n_layers * config.n_kv_heads * config.head_dim * (PROMPT + 1) * element
    return {
        "peak_rss_bytes": int(status["VmHWM"].split()[0]) * 1024,
        "file_bytes": os.path.getsize(path),
        "kv_bytes": kv,
    }


def llama_cpp_python_worker(path: str, threads: int) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
    ids = llm.tokenize(b"Once upon a time, in a lighthouse by the sea,")
    long_ids = (ids * PROMPT)[:PROMPT]

    def decode():
        llm.reset()
        started, out = None, 0
        for _ in llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            out += 1
            if out == 1:
                started = time.perf_counter()
            if out == NEW + 1:
                break
        return time.perf_counter() - started

    def prompt():
        llm.reset()
        started = time.perf_counter()
        llm.eval(long_ids)
        return time.perf_counter() - started

    decode(), prompt()
    return {
        "decode": NEW / min(decode() for _ in range(2)),
        "prompt": PROMPT / min(prompt() for _ in range(2)),
    }


def llama_bench(binary: str, path: str, threads: int, repetitions: int = 3) -> dict:
    cmd = [binary, "-m", path, "-t", str(threads), "-p", str(PROMPT), "-n", str(NEW), "-r", str(repetitions),
           "-o", "json"]  # fmt: skip
    rows = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    rates = {("prompt" if row["n_prompt"] else "decode"): row["avg_ts"] for row in rows}
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("file")
    parser.add_argument(
        "--isa", default=None, help="FLASHFORMER_CPU_ISA for flashformer (and ATEN_CPU_CAPABILITY)"
    )
    parser.add_argument("--llama-bench", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--llama-bench-repetitions",
        type=int,
        default=3,
        help="llama-bench's -r (fewer at 8B: its pp512 is slow)",
    )
    parser.add_argument("--only", default=None, help="flashformer or llama.cpp")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker = flashformer_worker if args.worker == "flashformer" else llama_cpp_python_worker
        print(json.dumps(worker(args.file, args.threads)))
        return
    names = [n for n in ("flashformer", "llama.cpp") if args.only in (None, n)]
    runs: dict[str, list] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            load = os.getloadavg()[0]
            if name == "llama.cpp" and args.llama_bench:
                rates = llama_bench(args.llama_bench, args.file, args.threads, args.llama_bench_repetitions)
            else:
                env = dict(os.environ)
                if name == "flashformer" and args.isa:
                    from flashformer.kernels.machine import aten_capability

                    env["FLASHFORMER_CPU_ISA"] = args.isa
                    env["ATEN_CPU_CAPABILITY"] = aten_capability(args.isa)  # clamped to the CPU
                cmd = [sys.executable, __file__, args.file, "--worker", name, "--threads", str(args.threads)]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                rates = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{name:12s} {json.dumps(rates)} load {load:.2f}", flush=True)
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
    for name, rates in summary.items():
        for key, r in rates.items():
            print(
                f"{name:12s} {key:6s} best {r['best']:.1f}, median {r['median']:.1f} "
                f"({r['median'] / r['best']:.2f} of the best), range {r['worst']:.1f}-{r['best']:.1f}"
            )
    if args.out:
        from flashformer.files import write_json
        from flashformer.kernels.machine import machine_info

        config = {
            "file": args.file,
            "isa": args.isa,
            "llama_bench": args.llama_bench,
            "threads": args.threads,
            "llama_bench_repetitions": args.llama_bench_repetitions,
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
        }
        write_json(args.out, {"machine": machine_info(), "config": config, "runs": runs, "summary": summary})


if __name__ == "__main__":
    main()
