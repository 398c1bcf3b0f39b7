"""`flashformer bench serve MODEL --long-context 32000 --cache-types f16,q8_0,q4_0`: one long
prompt through the server, for each KV cache type: what it holds per token, how long the prompt
takes, how fast the answer comes after it, and the server's memory.

For each type (KEYS[/VALUES]) a fresh `flashformer serve` (max batch 1, a pool of just enough
blocks for the prompt and the answer) is sent one streamed greedy /v1/completions request whose
prompt is `--long-context` token ids (Python's docstrings, the bench's corpus, repeated), asking
for `--max-tokens` tokens. Measured: the time to the first token (the prompt's prefill), the
decode tokens/s after it, the server's peak and final RSS (/proc), and from its /metrics the KV
bytes its sequence held at most (kv_bytes_in_use_peak: every layer's blocks, both groups) and
the pools' bytes. KV bytes per token = that peak / the tokens the sequence held.

A model with sliding-window layers beside full ones (Gemma 2 and 3) keeps those layers' keys in
a pool of their own that holds only each sequence's window (serve/paged_cache.py's window group):
their share does not grow with the context. "if every layer kept every key" is computed from the
pools' block sizes (the layout before the window group), for comparison; it is not measured.

With --llama-server PATH the same prompt goes to llama.cpp's server on the same file (-c just
large enough, -np 1, -fa on, -ctk/-ctv the same types), whose own log states its KV cache's
size; its time to first token, decode and RSS are measured the same way.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.request
from pathlib import Path

from flashformer.bench.common import grouped_bars, quantize_flags
from flashformer.bench.kv_cache import label, parse_types
from flashformer.bench.serve_load import corpus
from flashformer.bench.serve_peers import free_port, start
from flashformer.kernels.machine import machine_info

BLOCK_SIZE = 16


def prompt_ids(tokenizer, tokens: int) -> list[int]:
    """`tokens` token ids of the corpus, repeated as often as needed (a document the model reads)."""
    words = corpus()
    ids = tokenizer.encode(" ".join(words))
    return (ids * (tokens // len(ids) + 1))[:tokens]


def server_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (its peak) of process `pid`, in bytes."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(value.split()[0]) * 1024
    return found


def metrics(port: int) -> dict[str, float]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics", headers={"Authorization": "Bearer bench"}
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        text = reply.read().decode()
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            found[name.removeprefix("flashformer_")] = float(value)
    return found


def stream_completion(port: int, prompt: list[int], max_tokens: int, timeout_s: float) -> dict:
    """One streamed greedy completion of max_tokens tokens (eos ignored): seconds to the first
    event, then the decode rate over the events after it. Events, not text, are counted: a random
    model's tokens may have no text in one server's vocabulary (llama.cpp writes pad tokens as
    nothing); the tokens are the usage's completion_tokens."""
    models = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": "Bearer bench"}
    )
    with urllib.request.urlopen(models, timeout=30) as reply:
        served = json.loads(reply.read())["data"][0]["id"]
    body = {
        "model": served,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer bench"},
    )
    sent = time.perf_counter()
    arrivals, text, tokens = [], "", None
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"the server answered an error: {event['error']}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event.get("choices"):
                arrivals.append(time.perf_counter())
                text += event["choices"][0].get("text", "")
    if not arrivals:
        raise RuntimeError("the server streamed no token")
    tokens = tokens or max_tokens
    ttft = arrivals[0] - sent
    decode_s = arrivals[-1] - arrivals[0]
    return {
        "ttft_s": ttft,
        "prompt_tokens_per_s": len(prompt) / ttft,
        "completion_tokens": tokens,
        "decode_tokens_per_s": (tokens - 1) / decode_s if decode_s > 0 else None,
        "text": text,
    }


def ours(model: str, pair, prompt: list[int], args) -> dict:
    """One fresh flashformer server for KV types `pair`, one long request."""
    need = -(-(len(prompt) + args.max_tokens + 1) // BLOCK_SIZE) + 1  # + the scratch block
    port = free_port()
    command = [sys.executable, "-m", "flashformer.cli", "serve", model, "--port", str(port)]
    command += ["--threads", str(args.threads)]
    command += ["--max-batch", "1", "--kv-blocks", str(need), "--block-size", str(BLOCK_SIZE)]
    command += ["--cache-type-k", pair[0], "--cache-type-v", pair[1], "--api-key", "bench"]
    command += quantize_flags(args.quantize)
    process = start(command, f"http://127.0.0.1:{port}/health")
    try:
        idle = server_status(process.pid)
        found = stream_completion(port, prompt, args.max_tokens, args.timeout)
        served = metrics(port)
        status = server_status(process.pid)
    finally:
        process.terminate()
        process.wait(timeout=60)
    held_tokens = len(prompt) + args.max_tokens
    peak = served["kv_bytes_in_use_peak"]
    every_key = None
    if "kv_window_block_bytes" in served:  # the layout without a window group: every layer in one pool
        blocks = -(-held_tokens // BLOCK_SIZE)
        every_key = blocks * (served["kv_block_bytes"] + served["kv_window_block_bytes"])
    return {
        "kv_bytes_peak": peak,
        "kv_bytes_per_token": peak / held_tokens,
        "kv_pool_bytes": served["kv_bytes_total"],
        "window_blocks": served.get("kv_window_blocks_total"),
        "kv_bytes_if_every_key_kept": every_key,
        "rss_idle": idle["VmRSS"],
        "rss_peak": status["VmHWM"],
        "rss_after": status["VmRSS"],
        **found,
    }


# its log's KV lines (at -lv 4), one per cache (an iSWA model has two: full layers, then SWA layers):
# "llama_kv_cache: size =   96.00 MiB ( 32768 cells,   3 layers, ...)"
LLAMA_KV_SIZE = re.compile(r"llama_kv_cache:\s+size\s*=\s*([\d.]+)\s*MiB")


def theirs(binary: str, model: str, pair, prompt: list[int], args) -> dict:
    """llama-server on the same file and prompt: its log's KV size, the request timed alike."""
    port = free_port()
    context = len(prompt) + args.max_tokens + 64
    log = Path(args.out) / f"llama-server-{label(pair).replace('/', '-')}.log"
    command = [binary, "-m", model, "--port", str(port), "-t", str(args.threads), "-c", str(context)]
    command += ["-np", "1", "-fa", "on", "-ctk", pair[0], "-ctv", pair[1], "--api-key", "bench"]
    command += ["--log-file", str(log), "-lv", "4"]
    process = start(command, f"http://127.0.0.1:{port}/health")
    try:
        idle = server_status(process.pid)
        try:
            found = stream_completion(port, prompt, args.max_tokens, args.timeout)
        except (RuntimeError, OSError) as error:  # its KV size is still worth reading
            found = {"error": str(error)}
        status = server_status(process.pid)
    finally:
        process.terminate()
        process.wait(timeout=60)
    sizes = [float(m) * 2**20 for m in LLAMA_KV_SIZE.findall(log.read_text(errors="replace"))]
    return {
        "kv_bytes_reported": sum(sizes) if sizes else None,
        "kv_log_lines": len(sizes),
        "rss_idle": idle["VmRSS"],
        "rss_peak": status["VmHWM"],
        **found,
    }


def run(model: str, args) -> dict:
    from flashformer.checkpoints.loading import load_tokenizer

    tokenizer = load_tokenizer(model)
    prompt = prompt_ids(tokenizer, args.long_context)
    pairs = parse_types(args.cache_types or "f16")
    load_before = list(os.getloadavg())
    results = {}
    for pair in pairs:
        name = label(pair)
        print(f"flashformer {name}: {len(prompt)} prompt tokens", flush=True)
        results[name] = {"flashformer": ours(model, pair, prompt, args)}
        if args.llama_server:
            print(f"llama-server {name}", flush=True)
            try:
                results[name]["llama.cpp"] = theirs(args.llama_server, model, pair, prompt, args)
            except RuntimeError as error:
                results[name]["llama.cpp"] = {"error": str(error)}
        print(json.dumps({k: v for k, v in results[name]["flashformer"].items() if k != "text"}), flush=True)
    return {
        "benchmark": "long-context",
        "model": str(model),
        "machine": machine_info(),
        "config": {
            "prompt_tokens": len(prompt),
            "max_tokens": args.max_tokens,
            "threads": args.threads,
            "quantize": args.quantize,
            "block_size": BLOCK_SIZE,
            "llama_server": args.llama_server,
            "load_average_before": load_before,
            "load_average": list(os.getloadavg()),
        },
        "types": results,
    }


def table(payload: dict) -> str:
    from flashformer.formatting import markdown_table

    rows = []
    mib = 2**20
    for name, found in payload["types"].items():
        ours_ = found["flashformer"]
        every = ours_["kv_bytes_if_every_key_kept"]
        theirs_ = found.get("llama.cpp", {})
        rows.append(
            [
                name,
                f"{ours_['kv_bytes_per_token']:.0f}",
                f"{ours_['kv_bytes_peak'] / mib:.1f}",
                "-" if every is None else f"{every / mib:.1f}",
                f"{ours_['ttft_s']:.1f}",
                "-" if ours_["decode_tokens_per_s"] is None else f"{ours_['decode_tokens_per_s']:.1f}",
                f"{ours_['rss_peak'] / mib:.0f}",
                "-" if not theirs_.get("kv_bytes_reported") else f"{theirs_['kv_bytes_reported'] / mib:.1f}",
                "-" if "ttft_s" not in theirs_ else f"{theirs_['ttft_s']:.1f}",
                "-" if not theirs_.get("decode_tokens_per_s") else f"{theirs_['decode_tokens_per_s']:.1f}",
                "-" if "rss_peak" not in theirs_ else f"{theirs_['rss_peak'] / mib:.0f}",
            ]
        )
    header = [
        "keys/values",
        "KV bytes / token",
        "KV MiB held",
        "MiB if every layer kept every key (computed)",
        "TTFT s",
        "decode tok/s",
        "peak RSS MiB",
        "llama.cpp KV MiB (its log)",
        "llama.cpp TTFT s",
        "llama.cpp decode tok/s",
        "llama.cpp peak RSS MiB",
    ]
    return markdown_table(header, rows)


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(payload["types"])
    series = {
        "flashformer KV MiB held": [
            payload["types"][n]["flashformer"]["kv_bytes_peak"] / 2**20 for n in names
        ]
    }
    every = [payload["types"][n]["flashformer"]["kv_bytes_if_every_key_kept"] for n in names]
    if all(e is not None for e in every):
        series["every layer every key (computed)"] = [e / 2**20 for e in every]
    reported = [payload["types"][n].get("llama.cpp", {}).get("kv_bytes_reported") for n in names]
    if all(r for r in reported):
        series["llama.cpp KV MiB (its log)"] = [r / 2**20 for r in reported]
    fig, ax = plt.subplots(figsize=(7, 4))
    grouped_bars(ax, names, series)
    ax.set_ylabel("MiB")
    ax.set_title(f"{Path(payload['model']).name}: {payload['config']['prompt_tokens']} prompt tokens")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
