"""What every benchmark shares: fresh worker processes, honest peak memory,
timing, and the JSON + PNG it leaves behind.

Each measured point runs in a fresh Python process, so one point's memory
(allocator caches, freed-but-kept pages) never flatters the next. Inside the
worker the kernel's peak-RSS counter is reset right before the measured work
(/proc/self/clear_refs), and glibc is told to hand every allocation above
64 KiB straight back to the system, so "peak extra memory" is what the work
itself added on top of its inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from flashformer.checkpoints.loading import AUTO, QUANTIZE_CHOICES, quantize_mode

# ---- the command line every benchmark shares ----


def names(text: str) -> list[str]:
    """A comma-separated flag value ("float32,bfloat16") as a list."""
    return [item for item in text.split(",") if item]


def numbers(text: str) -> list[int]:
    """A comma-separated flag value of integers ("512,1024") as a list."""
    try:
        return [int(item) for item in names(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas; got {text!r}") from None


def add_quantize_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """--quantize as the commands take it (default auto: a GGUF file's own blocks); a benchmark
    resolves it once for its model (resolved_quantize) and records the mode its contender ran."""
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=AUTO, help=what)


def resolved_quantize(model: str, quantize: str | None) -> str | None:
    """The mode `flashformer.load(model, quantize=...)` applies: "gguf", "int8", "int4" or None (float)."""
    return quantize_mode(model, quantize)


def quantize_flags(mode: str | None) -> list[str]:
    """A resolved mode as a flashformer command's flag: None is "none" (no flag would be the default)."""
    return ["--quantize", mode or "none"]


def add_run_arguments(
    parser: argparse.ArgumentParser, quick: str, timeout: float, what: str = "point"
) -> None:
    """--quick (what it shrinks to), --out (the JSON and PNG's folder) and --timeout (per worker)."""
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for JSON and PNG")
    parser.add_argument("--timeout", type=float, default=timeout, help=f"seconds allowed per {what}")


def run_worker(
    module: str, point: dict, timeout_s: float, memory: bool = True, env: dict | None = None
) -> dict:
    """Run `python -m module --worker JSON` in a fresh process; returns its JSON result.
    memory=False: a worker that only times, with glibc's own allocation thresholds, as users
    run (handing every allocation above 64 KiB to the system costs fresh page faults each time).
    env: variables set for the worker (ATEN_CPU_CAPABILITY: what PyTorch reads once, at start)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    if memory:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    command = [sys.executable, "-m", module, "--worker", json.dumps(point)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if done.returncode != 0:
        reason = "killed (out of memory?)" if done.returncode < 0 else f"exit code {done.returncode}"
        tail = done.stderr.strip().splitlines()[-1:] or [""]
        return {"error": f"{reason}: {tail[0][:200]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench_main(prog: str, doc: str, add_arguments, main_from_args, worker, argv: list[str] | None) -> None:
    """`python -m flashformer.bench.X`: the benchmark itself, or, with --worker
    JSON (how run_worker calls it), one point measured in this fresh process,
    its result printed as the last line of JSON."""
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    main_from_args(args)


# ---- inside a worker ----


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_memory() -> int:
    """Resets the peak counter; returns the memory in use now, in bytes
    (RSS on the CPU, allocated device memory on CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kib("VmRSS") * 1024


def rss_bytes() -> int:
    """The process's resident memory now, in bytes."""
    return _status_kib("VmRSS") * 1024


def memory_status() -> dict[str, int]:
    """The process's memory now, in bytes: VmRSS (resident), VmHWM (its peak), RssAnon (the
    heap's and tensors' own pages) and RssFile (pages of mapped files: code, and weights used
    in place from a GGUF file's map), with the part of each on huge pages (AnonHugePages,
    FilePmdMapped: smaps_rollup; absent where the kernel lacks it)."""
    found = {key: _status_kib(key) * 1024 for key in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("AnonHugePages", "FilePmdMapped"):
                found[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return found


def peak_memory() -> int:
    """Peak RSS in bytes since the last reset (device memory on CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _status_kib("VmHWM") * 1024


def measure_peak(work: Callable[[], None]) -> dict:
    """The peak memory one call of `work` adds on top of what was in use."""
    baseline = reset_peak_memory()
    work()
    return {"peak_extra_bytes": max(0, peak_memory() - baseline)}


def time_in_turns(works: dict[str, Callable[[], None]], rounds: int = 3, warmup: bool = True) -> dict:
    """Median seconds of each work, timed round-robin (A B C, B C A, ...).

    Taking turns within one process means a noisy neighbour slows every
    contender alike, so the ratios between them stay meaningful.
    """
    names = list(works)
    if warmup:
        for name in names:
            works[name]()
    times = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            _sync()
            started = time.perf_counter()
            works[name]()
            _sync()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) for name, t in times.items()}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- results ----


def grouped_bars(ax, names: list[str], series: dict[str, list[float]]) -> None:
    """One group of bars per name, one bar per series in each (a figure's axes, matplotlib)."""
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(names))], values, width, label=label)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(names))], names)
