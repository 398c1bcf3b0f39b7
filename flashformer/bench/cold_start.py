"""Load to first token in fresh processes, ours against llama.cpp's, in turns (`bench generate
--model FILE --llama-cpp-dir DIR --cold-starts N`):

    flashformer generate FILE --quantize gguf --prompt "Once upon a time" --max-new-tokens 1 --greedy
    DIR/bin/llama-simple -m FILE -n 1 "Once upon a time"

each timed from its start to its exit (the interpreter's imports included for ours: what a user
waits for), with its peak resident memory (GNU time's %M, the kernel's ru_maxrss of the program: weights
read in place from the file's map count once touched). llama-simple runs its default threads
(GGML_DEFAULT_N_THREADS, 4); ours torch's (one per core). The files stay in the page cache
between runs (nothing here drops it): these are warm starts. The programs run without
PYTHONDONTWRITEBYTECODE, so Python keeps its compiled modules as an installed package has them
(with it set, as on this project's machines, every run compiles flashformer's sources again:
about 0.25 s); the first run of ours writes them, and the best of the runs is reported.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flashformer.bench.llama_cpp_binaries import executable

PROMPT = "Once upon a time"
TIME = "/usr/bin/time"  # GNU time: the child's peak RSS


def commands(path: str, llama_cpp_dir: str) -> dict[str, list[str]]:
    """The two programs' commands on the file; llama-simple is DIR/bin/llama-simple or
    DIR/llama-simple, checked."""
    folder = Path(llama_cpp_dir).expanduser()
    simple = folder / "bin" / "llama-simple"
    simple = executable(simple if simple.is_file() else folder / "llama-simple", "--llama-cpp-dir")
    ours = [sys.executable, "-m", "flashformer.cli", "generate", str(path), "--quantize", "gguf",
            "--prompt", PROMPT, "--max-new-tokens", "1", "--greedy"]  # fmt: skip
    return {"flashformer": ours, "llama.cpp": [str(simple), "-m", str(path), "-n", "1", PROMPT]}


def timed(command: list[str], timeout_s: float) -> dict:
    """One fresh process: its wall seconds from start to exit and its peak RSS in bytes, or
    {"error": ...}. The peak is GNU time's (%M), not our own wait4's: a child forked from this
    process inherits its high-water mark until the exec, so ours would be at least this process's."""
    with tempfile.NamedTemporaryFile("r") as peak, tempfile.TemporaryFile() as errors:
        started = time.perf_counter()
        process = subprocess.Popen(
            [TIME, "-f", "%M", "-o", peak.name, *command],
            env={name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"},
            stdout=subprocess.DEVNULL,
            stderr=errors,
            start_new_session=True,  # its own process group: time and the program stop together
        )
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return {"error": f"timed out after {timeout_s:.0f} s"}
        seconds = time.perf_counter() - started
        if process.returncode != 0:
            errors.seek(0)
            tail = errors.read().decode(errors="replace").strip().splitlines()[-1:] or [""]
            return {"error": f"exit code {process.returncode}: {tail[0][:200]}"}
        return {"seconds": seconds, "max_rss": int(peak.read().split()[-1]) * 1024}


def run(path: str, llama_cpp_dir: str, runs: int, timeout_s: float = 600) -> dict:
    """`runs` fresh processes of each, in turns (ours first, then theirs first, ...): every
    run's seconds, peak RSS and the load average before it, and each side's best, median and
    worst seconds."""
    found: dict[str, list[dict]] = {}
    programs = commands(path, llama_cpp_dir)
    names = list(programs)
    for turn in range(runs):
        for name in names if turn % 2 == 0 else names[::-1]:
            load = os.getloadavg()[0]
            found.setdefault(name, []).append({**timed(programs[name], timeout_s), "load_average": load})
    summary = {}
    for name, results in found.items():
        seconds = [r["seconds"] for r in results if "seconds" in r]
        if seconds:
            best = min(results, key=lambda r: r.get("seconds", float("inf")))
            summary[name] = {"best": min(seconds), "median": statistics.median(seconds), "worst": max(seconds),
                             "max_rss_of_best": best["max_rss"]}  # fmt: skip
    return {
        "commands": {name: " ".join(c) for name, c in programs.items()},
        "runs": found,
        "summary": summary,
    }
