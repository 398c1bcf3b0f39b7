"""`flashformer bench serve MODEL`: a server under load, as its users see it.

A load generator (the `openai` async client) keeps `--clients` streamed chat
requests in flight until `--requests` are done. Each request's prompt and
output length are drawn from a fixed seeded distribution (a question of
5..150 words built from Python's own docstrings, 16..`--max-tokens` output
tokens, greedy), so every server gets the same load. Reported per server:
output tokens/s over the whole run, time to first token and the gaps between
tokens (inter-token latency), p50 and p99.

Servers, started one after the other on the same machine with the same
threads: flashformer with continuous batching (--max-batch clients), the same
server one request at a time (--max-batch 1: the baseline), and, when
llama-cpp-python[server] is installed and MODEL is a GGUF file, llama.cpp's
OpenAI-compatible server on the same file. Also measured with one client
alone: the prefill time of one prompt (its time to first token) and the step
time (its inter-token latency), which the targets are stated against.
Writes serve.json and serve.png.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

from flashformer.files import write_json
from flashformer.formatting import markdown_table
from flashformer.kernels.machine import machine_info
from flashformer.model.quantize import MODES


def workload(count: int, max_tokens: int, seed: int) -> list[tuple[str, int]]:
    """(question, max_tokens) per request: the same for every server."""
    import collections
    import json as json_module

    words = " ".join(
        inspect.getdoc(obj) or ""
        for module in (collections, json_module, asyncio, argparse)
        for obj in vars(module).values()
        if callable(obj)
    ).split()
    rng = random.Random(seed)
    jobs = []
    for _ in range(count):
        length = rng.randint(5, 150)
        start = rng.randrange(0, max(1, len(words) - length))
        question = "Summarize: " + " ".join(words[start : start + length])
        jobs.append((question, rng.randint(16, max_tokens)))
    return jobs


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def drive(url: str, model: str, jobs: list[tuple[str, int]], clients: int, api_key: str) -> dict:
    """Run the jobs with `clients` in flight; timings per request."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=3600)
    queue = list(enumerate(jobs))
    ttfts, gaps, tokens, errors = [], [], 0, 0

    async def one(question: str, limit: int):
        nonlocal tokens, errors
        started = time.perf_counter()
        last, chunks, counted = None, 0, False
        try:
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": question}],
                max_tokens=limit,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].delta.content:
                    if last is None:
                        ttfts.append(now - started)
                    else:
                        gaps.append(now - last)
                    last = now
                    chunks += 1
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens
                    counted = True
            if not counted:  # a server without stream usage (llama-cpp-python's): a token per chunk
                tokens += chunks
        except Exception:
            errors += 1

    async def worker():
        while queue:
            _, (question, limit) = queue.pop(0)
            await one(question, limit)

    started = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(clients)])
    wall = time.perf_counter() - started
    await client.close()
    return {
        "requests": len(jobs),
        "clients": clients,
        "errors": errors,
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], url: str, timeout_s: float = 600) -> subprocess.Popen:
    import tempfile
    import urllib.request

    # the server's output goes to a file: a pipe nobody reads fills up and blocks a chatty server
    log = tempfile.TemporaryFile(mode="w+")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{command[:4]} exited: {log.read()[-500:]}")
        try:
            ready = urllib.request.Request(url + "/models", headers={"Authorization": "Bearer bench"})
            with urllib.request.urlopen(ready, timeout=2) as reply:
                if reply.status == 200:
                    return process
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{command[:4]} did not answer within {timeout_s} s")


def servers(model: str, args) -> dict[str, list[str]]:
    """name -> the command that serves MODEL on {port}."""
    ours = [sys.executable, "-m", "flashformer.cli", "serve", model, "--port", "{port}", "--api-key", "bench"]
    if args.threads:
        ours += ["--threads", str(args.threads)]
    if args.quantize:
        ours += ["--quantize", args.quantize]
    for flag in ("prefill_chunk", "prefill_budget"):
        if getattr(args, flag, None):
            ours += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    found = {
        f"flashformer (max batch {args.clients})": ours + ["--max-batch", str(args.clients)],
        "flashformer (one at a time)": ours + ["--max-batch", "1"],
    }
    if not args.no_llama_cpp and Path(model).is_file() and importlib.util.find_spec("llama_cpp") is not None:
        threads = str(args.threads or 2)
        found["llama.cpp (llama-cpp-python server)"] = [
            sys.executable, "-m", "llama_cpp.server", "--model", model, "--port", "{port}",
            "--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", "4096", "--api_key", "bench",
        ]  # fmt: skip
    return found


def run(model: str, args) -> dict:
    jobs = workload(args.requests, args.max_tokens, args.seed)
    results = {}
    for name, template in servers(model, args).items():
        port = free_port()
        url = f"http://127.0.0.1:{port}/v1"
        command = [part.replace("{port}", str(port)) for part in template]
        print(f"{name}: starting", flush=True)
        try:
            process = start(command, url)
        except RuntimeError as error:
            results[name] = {"error": str(error)}
            continue
        try:
            from openai import OpenAI

            served = OpenAI(base_url=url, api_key="bench").models.list().data[0].id
            alone = asyncio.run(drive(url, served, jobs[:4], 1, "bench"))
            loaded = asyncio.run(drive(url, served, jobs, args.clients, "bench"))
            results[name] = {"alone": alone, "loaded": loaded}
            print(
                f"{name}: {loaded['output_tokens_per_s']:.1f} tokens/s with {args.clients} clients",
                flush=True,
            )
        finally:
            process.terminate()
            process.wait(timeout=60)
    return {
        "benchmark": "serve",
        "model": str(model),
        "machine": machine_info(),
        "config": {
            "clients": args.clients,
            "requests": args.requests,
            "max_tokens": args.max_tokens,
            "seed": args.seed,
            "quantize": args.quantize,
        },
        "servers": results,
        "targets": targets(results, args.clients),
    }


def targets(results: dict, clients: int) -> dict:
    """The issue's ratios, for flashformer's batching server against itself alone and one at a time."""
    ours = results.get(f"flashformer (max batch {clients})", {})
    single = results.get("flashformer (one at a time)", {})
    if "loaded" not in ours or "loaded" not in single:
        return {}
    alone = ours["alone"]
    return {
        f"aggregate tokens/s, {clients} clients / one at a time (>= 4)": ours["loaded"]["output_tokens_per_s"]
        / single["loaded"]["output_tokens_per_s"],
        "p99 inter-token latency / one client's step time (<= 3)": ours["loaded"]["itl_p99_s"]
        / alone["itl_p50_s"],
        "p50 time to first token / one prompt's prefill (<= 2)": ours["loaded"]["ttft_p50_s"]
        / alone["ttft_p50_s"],
    }


def table(payload: dict) -> str:
    def ms(value):
        return "-" if value is None else f"{1e3 * value:.0f}"

    rows = []
    for name, result in payload["servers"].items():
        if "error" in result:
            rows.append([name, f"not measured: {result['error'][:80]}"] + ["-"] * 5)
            continue
        loaded = result["loaded"]
        rows.append(
            [
                name,
                f"{loaded['output_tokens_per_s']:.1f}",
                ms(loaded["ttft_p50_s"]),
                ms(loaded["ttft_p99_s"]),
                ms(loaded["itl_p50_s"]),
                ms(loaded["itl_p99_s"]),
                f"{ms(result['alone']['ttft_p50_s'])} / {ms(result['alone']['itl_p50_s'])}",
            ]
        )
    config = payload["config"]
    header = [
        "server",
        "output tokens/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "alone: TTFT / ITL ms",
    ]
    text = (
        f"{Path(payload['model']).name}; {config['requests']} streamed chat requests, {config['clients']} clients "
        f"in flight, up to {config['max_tokens']} output tokens each, greedy"
        + (f"; flashformer's weights quantized ({config['quantize']})" if config.get("quantize") else "")
        + ".\n\n"
        + markdown_table(header, rows)
    )
    if payload["targets"]:
        text += "\n\n" + "; ".join(f"{name}: {value:.2f}" for name, value in payload["targets"].items())
    return text


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = {name: r for name, r in payload["servers"].items() if "loaded" in r}
    fig, (rate, latency) = plt.subplots(1, 2, figsize=(11, 3.8))
    names = list(measured)
    rate.barh(names, [measured[n]["loaded"]["output_tokens_per_s"] for n in names], color="tab:blue")
    rate.set_xlabel("output tokens/s")
    for offset, (key, label) in enumerate((("ttft_p50_s", "TTFT p50"), ("itl_p99_s", "ITL p99"))):
        values = [1e3 * (measured[n]["loaded"][key] or 0) for n in names]
        latency.barh([i + 0.4 * offset for i in range(len(names))], values, height=0.4, label=label)
    latency.set_yticks([i + 0.2 for i in range(len(names))], names)
    latency.set_xscale("log")
    latency.set_xlabel("ms")
    latency.legend(fontsize=8)
    fig.suptitle(f"{Path(payload['model']).name}: {payload['config']['clients']} clients", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="a GGUF file, a Hugging Face folder or a run")
    parser.add_argument("--clients", type=int, default=16, help="requests in flight")
    parser.add_argument("--requests", type=int, default=48, help="requests in all")
    parser.add_argument("--max-tokens", type=int, default=128, help="the longest output drawn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="threads of every server")
    parser.add_argument("--quantize", choices=MODES, help="flashformer's servers load the model quantized so")
    parser.add_argument(
        "--prefill-chunk", type=int, help="flashformer serve's --prefill-chunk (default: its own)"
    )
    parser.add_argument(
        "--prefill-budget", type=int, help="flashformer serve's --prefill-budget (default: its own)"
    )
    parser.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp's server out")
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for JSON and PNG")


def main_from_args(args: argparse.Namespace) -> dict:
    payload = run(args.model, args)
    write_json(args.out / "serve.json", payload)
    plot(payload, args.out / "serve.png")
    print(table(payload))
    print(f"\nwrote {args.out / 'serve.json'} and {args.out / 'serve.png'}")
    return payload
