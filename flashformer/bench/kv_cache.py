"""`flashformer bench generate --model FILE --cache-types f16,q8_0,q8_0/q4_0 --context 4096`: the
KV cache's element types at a long context: bytes, decode speed, and how far each moves the tokens.

Each fresh process (`processes` of them) loads the model once and, for every type (KEYS[/VALUES];
one name: both), fills a cache of that type with the same `context` prompt tokens (a real text,
repeated), then times `new_tokens` greedy decode steps after it, in turns over the types,
`rounds` times (the cache rewound to the prompt each time; the median is kept). Decode tokens/s
at that depth is the figure; the KV bytes per token are what the cache holds for one more token
(every layer's keys and values). "same tokens" says whether a type's greedy continuation equals
the first type's (quantized keys and values move the logits; how far, measured by KL-divergence,
is `flashformer eval kld`'s job). The best process is reported, with the range.

With --llama-cpp-dir DIR, llama-bench (DIR/bin) measures llama.cpp's decode at the same depth
(-d CONTEXT -n NEW_TOKENS -p 0, flash attention on: llama.cpp quantizes V only with it) for the
same types, once per process, so the ratios can be compared with its own.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from flashformer.bench.common import grouped_bars, run_worker
from flashformer.kernels import kv_blocks

TEXT = (
    "The history of the lighthouse is a history of the coast itself: of wrecks and of the people who "
    "lived from them, of engineers who learned to build on rock in open water, and of keepers who "
    "spent their lives tending a flame. Early lights were coal fires in iron baskets; oil lamps with "
    "reflectors followed, then lenses that gathered the light into a beam seen twenty miles away. "
)


def parse_types(text: str) -> list[tuple[str, str]]:
    """ "f16,q8_0,q8_0/q4_0" -> [(f16, f16), (q8_0, q8_0), (q8_0, q4_0)] (keys, values)."""
    pairs = []
    for item in text.split(","):
        keys, _, values = item.strip().partition("/")
        pairs.append(
            (
                kv_blocks.check_type(keys, "--cache-types"),
                kv_blocks.check_type(values or keys, "--cache-types"),
            )
        )
    return pairs


def label(pair) -> str:
    return pair[0] if pair[0] == pair[1] else f"{pair[0]}/{pair[1]}"


def timing_worker(point: dict) -> dict:
    """One fresh process: every type's cache filled, then decode timed in turns."""
    import flashformer
    from flashformer.generate.sampling import settings_from
    from flashformer.generate.session import make_session

    if point["threads"]:
        torch.set_num_threads(point["threads"])
    started = time.perf_counter()
    model, tokenizer = flashformer.load(point["model"], quantize=point["quantize"])
    load_seconds = time.perf_counter() - started
    ids = tokenizer.encode(TEXT)
    ids = (ids * (point["context"] // len(ids) + 1))[: point["context"]]
    prompt = torch.tensor([ids])
    new = point["new_tokens"]
    sessions, tokens, fill_seconds = {}, {}, {}
    for keys, values in point["types"]:
        settings = settings_from(
            model, max_new_tokens=new, cache_type_k=keys, cache_type_v=values, eos_token_id=[]
        )
        session = make_session(model, prompt, None, settings)
        started = time.perf_counter()
        logits = session.prefill()
        fill_seconds[label((keys, values))] = time.perf_counter() - started
        sessions[label((keys, values))] = (session, logits.argmax(-1))
    seconds = {name: [] for name in sessions}
    for _ in range(point["rounds"] + 1):  # a warm-up round first
        for name, (session, first) in sessions.items():
            session.rewind(point["context"])
            token, generated = first, []
            started = time.perf_counter()
            for _ in range(new):
                generated.append(int(token))
                token = session.step(token).argmax(-1)
            seconds[name].append(time.perf_counter() - started)
            tokens[name] = generated
    cache = {name: session.caches for name, (session, _) in sessions.items()}
    reference = next(iter(tokens.values()))
    return {
        "load_seconds": load_seconds,
        "fill_seconds": fill_seconds,
        "tokens_per_s": {name: new / statistics.median(s[1:]) for name, s in seconds.items()},
        "kv_bytes_per_token": {
            name: sum(c.nbytes for c in caches) / caches[0].max_len for name, caches in cache.items()
        },
        "same_tokens": {name: t == reference for name, t in tokens.items()},
    }


def llama_bench(binary: Path, model: str, pair, context: int, new_tokens: int, threads: int) -> float | None:
    """llama-bench's decode tokens/s at depth `context` with the cache types `pair`."""
    command = [
        str(binary), "-m", model, "-p", "0", "-n", str(new_tokens), "-d", str(context), "-t", str(threads),
        "-ctk", pair[0], "-ctv", pair[1], "-fa", "1", "-r", "2", "-o", "json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return None
    rows = json.loads(done.stdout)
    return float(rows[-1]["avg_ts"]) if rows else None


def run(model: str, config: dict, out_dir: Path, threads: int | None, timeout_s: float) -> dict:
    """config: types [(keys, values)], context, new_tokens, rounds, processes, quantize,
    llama_cpp_dir (or None)."""
    from flashformer.files import write_json
    from flashformer.kernels.machine import machine_info

    point = {
        "model": str(Path(model).resolve()),
        "types": config["types"],
        "context": config["context"],
        "new_tokens": config["new_tokens"],
        "rounds": config["rounds"],
        "threads": threads,
        "quantize": config["quantize"],
    }
    from flashformer.bench.llama_cpp_binaries import llama_bench_binary

    binary = llama_bench_binary(config["llama_cpp_dir"]) if config.get("llama_cpp_dir") else None
    bench_threads = threads or torch.get_num_threads()
    processes, peers = [], []
    for _ in range(config["processes"]):
        processes.append(run_worker("flashformer.bench.kv_cache", point, timeout_s, memory=False))
        if binary is not None:
            peers.append(
                {
                    label(pair): llama_bench(
                        binary, point["model"], pair, point["context"], point["new_tokens"], bench_threads
                    )
                    for pair in point["types"]
                }
            )
    good = [p for p in processes if "error" not in p]
    if not good:
        raise RuntimeError(f"every process failed: {processes}")
    names = [label(pair) for pair in point["types"]]
    first = names[0]
    rows = {}
    for name in names:
        rates = [p["tokens_per_s"][name] for p in good]
        row = {
            "tokens_per_s": max(rates),
            "tokens_per_s_range": [min(rates), max(rates)],
            "kv_bytes_per_token": good[0]["kv_bytes_per_token"][name],
            "kv_bytes_ratio": good[0]["kv_bytes_per_token"][name] / good[0]["kv_bytes_per_token"][first],
            "speed_ratio": max(rates) / max(p["tokens_per_s"][first] for p in good),
            "same_tokens": all(p["same_tokens"][name] for p in good),
        }
        peer_rates = [p[name] for p in peers if p.get(name)]
        if peer_rates:
            row["peer_tokens_per_s"] = max(peer_rates)
            first_peer = [p[first] for p in peers if p.get(first)]
            if first_peer:
                row["peer_speed_ratio"] = max(peer_rates) / max(first_peer)
        rows[name] = row
    payload = {
        "benchmark": "kv_cache",
        "model": point["model"],
        "config": dict(config, threads=bench_threads),
        "machine": machine_info(),
        "types": rows,
        "processes": processes,
        "peer_runs": peers,
    }
    write_json(out_dir / "kv_cache.json", payload)
    plot(payload, out_dir / "kv_cache.png")
    return payload


def table(payload: dict) -> str:
    from flashformer.formatting import markdown_table

    first = next(iter(payload["types"]))
    header = [
        "keys/values",
        "KV bytes per token",
        f"against {first}",
        "decode tok/s (range)",
        f"against {first}",
        "llama.cpp tok/s",
        f"llama.cpp against its {first}",
        f"same greedy tokens as {first}",
    ]
    rows = []
    for name, r in payload["types"].items():
        low, high = r["tokens_per_s_range"]
        rows.append(
            [
                name,
                f"{r['kv_bytes_per_token']:.0f}",
                f"{r['kv_bytes_ratio']:.2f}x",
                f"{r['tokens_per_s']:.1f} ({low:.1f}-{high:.1f})",
                f"{r['speed_ratio']:.2f}x",
                f"{r['peer_tokens_per_s']:.1f}" if "peer_tokens_per_s" in r else "-",
                f"{r['peer_speed_ratio']:.2f}x" if "peer_speed_ratio" in r else "-",
                "yes" if r["same_tokens"] else "no",
            ]
        )
    return markdown_table(header, rows)


# kld_table's columns: (heading, the run's name in the payload, the figure shown)
KLD_COLUMNS = (
    ("llama.cpp mean KLD", "llama.cpp (against its f16 cache, int8 activations)", "error"),
    ("ours", "flashformer (against its f16 cache, int8 activations)", "error"),
    ("ours / llama.cpp", None, "ratio"),
    ("ours, same top token", "flashformer (against its f16 cache, int8 activations)", "same top"),
    (
        "ours without the rotation",
        "flashformer without the rotation (against its f16 cache, int8 activations)",
        "mean",
    ),
    (
        "ours, float32 activations against an f32 cache",
        "flashformer (against its f32 cache, float32 activations)",
        "mean",
    ),
)


def kld_table(payload: dict) -> str:
    """The KL-divergence of each cache type from its program's own unquantized cache (the JSON of
    `flashformer eval kld` runs beside llama-perplexity's, gathered by hand: docs/benchmarks.md)."""
    from flashformer.formatting import markdown_table

    ours_name, theirs_name = KLD_COLUMNS[1][1], KLD_COLUMNS[0][1]
    rows = []
    for name, runs in payload["types"].items():
        row = [name]
        for _, run, shown in KLD_COLUMNS:
            if shown == "ratio":
                both = ours_name in runs and theirs_name in runs
                row.append(
                    f"{runs[ours_name]['mean_kld'] / runs[theirs_name]['mean_kld']:.2f}" if both else "-"
                )
            elif run not in runs:
                row.append("-")
            elif shown == "error":
                row.append(f"{runs[run]['mean_kld']:.6f} ± {runs[run]['kld_error']:.6f}")
            elif shown == "same top":
                row.append(f"{runs[run]['same_top_percent']:.2f} %")
            else:
                row.append(f"{runs[run]['mean_kld']:.6f}")
        rows.append(row)
    return markdown_table(["keys/values", *(heading for heading, _, _ in KLD_COLUMNS)], rows)


def plot(payload: dict, path: Path) -> None:
    """Each type's KV bytes and decode speed against the first type's, ours and llama.cpp's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = payload["types"]
    names = list(rows)
    series = {
        "KV bytes": [rows[n]["kv_bytes_ratio"] for n in names],
        "decode tok/s, flashformer": [rows[n]["speed_ratio"] for n in names],
    }
    if all("peer_speed_ratio" in rows[n] for n in names):
        series["decode tok/s, llama.cpp"] = [rows[n]["peer_speed_ratio"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    grouped_bars(ax, names, series)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_ylabel(f"against {names[0]}")
    config = payload["config"]
    ax.set_title(f"{Path(payload['model']).name}: {config['new_tokens']} tokens after {config['context']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--worker":  # run_worker's call
        print(json.dumps(timing_worker(json.loads(sys.argv[2]))))
