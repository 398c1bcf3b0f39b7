"""llama.cpp's own programs as the benchmarks' peers: `llama-server` (bench serve) and
`llama-bench` (bench generate), given by path, checked before anything starts.

llama-bench times its own tests on an empty context, each repeated `-r` times: pp512 is
one 512-token prompt (tokens/s of prompt processing) and tg128 128 generated tokens one at a
time (tokens/s of decoding). Its JSON (`-o json`) is a list with one object per test:
n_prompt and n_gen say which test, avg_ts and stddev_ts its tokens/s over the repetitions,
samples_ts each repetition's, besides the build (build_commit, build_number), cpu_info,
backends, n_threads and the model's type and size.

How to build both (CPU only, no downloads): docs/benchmarks.md, "The peers".
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

PROMPT_TOKENS = 512  # llama-bench -p: its pp test
GENERATED_TOKENS = 128  # llama-bench -n: its tg test
REPETITIONS = 3


def executable(path: str | os.PathLike, flag: str) -> Path:
    """PATH given to `flag`, checked before anything starts: an executable file."""
    found = Path(path).expanduser()
    if not found.is_file():
        raise FileNotFoundError(
            f"{flag}: no file at {str(path)!r} (build it: docs/benchmarks.md, 'The peers')"
        )
    if not os.access(found, os.X_OK):
        raise ValueError(f"{flag}: {str(path)!r} is not executable")
    return found.resolve()


def version(binary: str | os.PathLike) -> str:
    """What a llama.cpp program says of its build (`--version`: its number, commit, compiler)."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unknown ({error})"
    return " ".join((done.stdout + done.stderr).split())


def llama_server_command(
    binary: Path, model: str, threads: int, slots: int, context: int, cache: bool = True
):
    """llama-server on MODEL with `slots` parallel slots of `context` tokens each, "{port}" where
    the port goes; cache=False turns its prompt cache off (a slot's last prompt, and the RAM cache)."""
    command = [str(binary), "-m", str(model), "-t", str(threads), "-np", str(slots), "-c", str(slots * context),
               "--host", "127.0.0.1", "--port", "{port}", "--no-webui"]  # fmt: skip
    return command + ([] if cache else ["--no-cache-prompt", "--cache-ram", "0"])


def llama_bench_binary(folder: str | os.PathLike) -> Path:
    """DIR/llama-bench, or DIR/bin/llama-bench (a cmake build folder), checked."""
    folder = Path(folder).expanduser()
    inside = folder / "bin" / "llama-bench"
    return executable(inside if inside.is_file() else folder / "llama-bench", "--llama-cpp-dir")


def llama_bench_command(binary: Path, model: str, threads: int, repetitions: int = REPETITIONS) -> list[str]:
    return [str(binary), "-m", str(model), "-t", str(threads), "-p", str(PROMPT_TOKENS),
            "-n", str(GENERATED_TOKENS), "-r", str(repetitions), "-o", "json"]  # fmt: skip


def parse_llama_bench(text: str) -> dict:
    """llama-bench's JSON -> {"pp512": {...}, "tg128": {...}, "build": ..., "cpu_info": ...}, each
    test's tokens/s (avg_ts), its standard deviation and samples over the repetitions."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"llama-bench's output is not JSON ({error}): {text[:200]!r}") from None
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"llama-bench's JSON: expected a list of tests, got {text[:200]!r}")
    found = {}
    for test in tests:
        prompt, generated = test["n_prompt"], test["n_gen"]
        name = (
            f"pp{prompt}"
            if generated == 0
            else f"tg{generated}"
            if prompt == 0
            else f"pp{prompt}+tg{generated}"
        )
        found[name] = {
            "tokens_per_s": test["avg_ts"],
            "stddev": test["stddev_ts"],
            "samples": test["samples_ts"],
        }
    first = tests[0]
    return {
        **found,
        "build": f"{first['build_commit']} ({first['build_number']})",
        "cpu_info": first["cpu_info"],
        "backends": first["backends"],
        "threads": first["n_threads"],
        "model_type": first["model_type"],
    }


def run_llama_bench(
    folder: str | os.PathLike,
    model: str,
    threads: int,
    timeout_s: float = 900,
    repetitions: int = REPETITIONS,
) -> dict:
    """llama-bench of DIR on MODEL: its pp512 and tg128 (parse_llama_bench), or {"error": ...};
    `repetitions` of each (-r: fewer for a model whose pp512 takes minutes)."""
    binary = llama_bench_binary(folder)
    command = llama_bench_command(binary, model, threads, repetitions)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"binary": str(binary), "error": f"timed out after {timeout_s:.0f} s"}
    if done.returncode != 0:
        tail = " ".join(done.stderr.split()[-40:])
        return {"binary": str(binary), "error": f"exit code {done.returncode}: {tail}"}
    return {"binary": str(binary), "command": " ".join(command), **parse_llama_bench(done.stdout)}
