"""`flashformer bench serve MODEL`: a server under load, as its users see it.

A load generator (the `openai` async client) keeps `--clients` streamed chat
requests in flight until `--requests` are done. Each request's prompt and
output length are drawn from a fixed seeded distribution (a question of
5..150 words built from Python's own docstrings, 16..`--max-tokens` output
tokens, greedy), so every server gets the same load. Reported per server:
output tokens/s over the whole run, time to first token and the gaps between
tokens (inter-token latency), p50 and p99. A model without a chat template (a
base model such as Gemma 3 270M) is asked over /v1/completions instead, the
question (after the system prompt, if any) as the prompt, by every server alike.

Servers, started one after the other on the same machine with the same
threads (serve_peers.py): flashformer with continuous batching (--max-batch
clients), the same server one request at a time (--max-batch 1: the
baseline), and llama.cpp's own server on the same GGUF file (--llama-server
PATH: `-np` clients slots, continuous batching), or else llama-cpp-python's
server, marked unbatched. Also measured with one client alone: its tokens/s,
the prefill time of one prompt (its time to first token) and the step time
(its inter-token latency), which the targets are stated against. Beside the
servers, the library itself (serve_library.py: the same file loaded as the servers
load it, in a fresh process, no server) answers the one-client questions: what a
served token costs beyond the model's step is read against it, as the decode rate
(the tokens after each answer's first over the time they took) of both.

Two more workloads (--workloads), run by flashformer's batching server with
its prefix cache on and off (--no-prefix-cache), and by llama-server with its
prompt cache on and off:
- shared-prefix: every request begins with the same system prompt of
  --system-tokens tokens (an agent's or a chat front-end's), then its question;
- multi-turn: --chats chats in flight, each --turns turns: the first message
  is a document of --history-tokens tokens and a question, every later turn
  re-sends the whole history (the answers included) and a new question, as
  chat front-ends do. One chat alone gives the TTFT of turn 2 against turn 1.
With --json-schema FILE, every answer of the mixed workload follows that schema
(response_format json_schema): run with and without it to see what constraining costs.
Writes serve.json and serve.png (serve_report.py: the tables and the figure).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from flashformer.bench import serve_library
from flashformer.bench.common import add_quantize_argument, quantize_flags, resolved_quantize
from flashformer.bench.llama_cpp_binaries import version
from flashformer.bench.serve_load import (
    WORKLOADS,
    chats,
    drive,
    drive_chats,
    names,
    shared_prefix_jobs,
    workload,
)
from flashformer.bench.serve_peers import (
    SLOT_CONTEXT,
    Server,
    free_port,
    kernel_path,
    peer_targets,
    peers,
    start,
)
from flashformer.bench.serve_replicas import (
    cache_counters,
    hit_rate,
    kill_drill,
    replica_targets,
    replicas_command,
)
from flashformer.bench.serve_report import plot, table
from flashformer.files import write_json
from flashformer.kernels.machine import machine_info


def servers(model: str, args) -> dict[str, Server]:
    """name -> Server: flashformer's (batching, its prefix cache on and off, one at a time), then
    the peers (serve_peers.py), one started after the other."""
    ours = [sys.executable, "-m", "flashformer.cli", "serve", model, "--port", "{port}", "--api-key", "bench"]
    if args.threads:
        ours += ["--threads", str(args.threads)]
    ours += quantize_flags(args.quantize)
    for flag in ("prefill_chunk", "prefill_budget", "kv_blocks"):
        if getattr(args, flag, None):
            ours += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    chosen = set(names(args.workloads))
    cached = chosen - {"mixed"}  # the workloads measured with the prefix cache on and off
    batching = ours + ["--max-batch", str(args.clients)]
    found = {
        f"flashformer (max batch {args.clients})": Server(batching, chosen),
        f"flashformer (max batch {args.clients}, no prefix cache)": Server(
            batching + ["--no-prefix-cache"], cached
        ),
        "flashformer (one at a time)": Server(ours + ["--max-batch", "1"], chosen & {"mixed"}),
        **peers(model, args, chosen),
    }
    if getattr(args, "replicas", None):  # bench/serve_replicas.py: the same engines on Ray Serve
        found[replicas_name(args)] = Server(
            replicas_command(batching, args.replicas, args.threads or 2),
            chosen | ({"kill"} if args.kill_replica else set()),
        )
    return {name: server for name, server in found.items() if server.workloads}


def replicas_name(args) -> str:
    return f"flashformer ({args.replicas} replicas x {max(1, (args.threads or 2) // args.replicas)} threads, Ray Serve)"


def run(model: str, args) -> dict:
    if getattr(args, "kill_replica", False) and not getattr(args, "replicas", None):
        raise ValueError("--kill-replica needs --replicas N (the replicas to kill one of)")
    measured = servers(model, args)  # first: a missing --llama-server is refused before any work
    load_before = list(os.getloadavg())
    jobs = workload(args.requests, args.max_tokens, args.seed)
    # one client alone asks other questions: the loaded run's must not be in the prefix cache
    solo = workload(4, args.max_tokens, args.seed + 1)
    chosen = names(args.workloads)
    structured = None  # --json-schema: the mixed workload's answers follow the schema
    if getattr(args, "json_schema", None):
        schema = json.loads(Path(args.json_schema).read_text(encoding="utf-8"))
        structured = {
            "response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
        }
    from flashformer.checkpoints.loading import load_tokenizer

    tokenizer = load_tokenizer(model)
    # a base model (no chat template) is asked over /v1/completions, by every server alike
    completions = not tokenizer.chat_template
    if completions and "multi-turn" in chosen:
        raise ValueError(f"--workloads multi-turn needs a chat template, and {model} has none")
    if set(chosen) - {"mixed"}:
        shared = shared_prefix_jobs(tokenizer, args)
        conversations = chats(tokenizer, args)
    results = {}
    if "mixed" in chosen and not getattr(args, "no_library", False):
        print(f"{serve_library.LIBRARY}: measuring", flush=True)
        try:
            found = serve_library.measure(model, solo, args.threads, args.quantize, completions)
            results[serve_library.LIBRARY] = {"load_average": list(os.getloadavg()), **found}
        except RuntimeError as error:
            results[serve_library.LIBRARY] = {"error": str(error)}
    for name, (template, runs, ready_path) in measured.items():
        port = free_port()
        url = f"http://127.0.0.1:{port}/v1"
        command = [part.replace("{port}", str(port)) for part in template]
        print(f"{name}: starting", flush=True)
        started = time.perf_counter()
        try:
            process = start(command, f"http://127.0.0.1:{port}{ready_path}")
        except RuntimeError as error:
            results[name] = {"error": str(error)}
            continue
        start_s = time.perf_counter() - started  # launch to ready (/health 200): imports, loading
        print(f"{name}: ready after {start_s:.1f} s", flush=True)
        try:
            from openai import OpenAI

            served = OpenAI(base_url=url, api_key="bench").models.list().data[0].id
            results[name] = {"load_average": list(os.getloadavg()), "start_s": start_s}
            if "mixed" in runs:
                alone = asyncio.run(drive(url, served, solo, 1, "bench", structured, completions))
                loaded = asyncio.run(drive(url, served, jobs, args.clients, "bench", structured, completions))
                results[name].update(alone=alone, loaded=loaded)
                print(
                    f"{name}: {loaded['output_tokens_per_s']:.1f} tokens/s with {args.clients} clients",
                    flush=True,
                )
            if "shared-prefix" in runs:
                before = cache_counters(url)
                result = asyncio.run(drive(url, served, shared, args.clients, "bench", None, completions))
                result["prefix_hit_rate"] = hit_rate(before, cache_counters(url))
                results[name]["shared_prefix"] = result
                print(f"{name}: shared prefix, TTFT p50 {result['ttft_p50_s']:.3f} s", flush=True)
            if "multi-turn" in runs:
                limit = args.turn_tokens
                alone = asyncio.run(drive_chats(url, served, conversations[:1], limit, "bench"))
                before = cache_counters(url)
                loaded = asyncio.run(drive_chats(url, served, conversations, limit, "bench"))
                loaded["prefix_hit_rate"] = hit_rate(before, cache_counters(url))
                results[name]["multi_turn"] = {"alone": alone, "loaded": loaded}
                print(
                    f"{name}: multi-turn, one chat's TTFT by turn {alone['ttft_p50_by_turn_s']}", flush=True
                )
            if "kill" in runs:
                drill = asyncio.run(kill_drill(url, served, jobs, args.clients, args.replicas))
                results[name]["kill_drill"] = drill
                print(f"{name}: a replica killed: {drill}", flush=True)
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
            "workloads": chosen,
            "system_tokens": args.system_tokens,
            "chats": args.chats,
            "turns": args.turns,
            "history_tokens": args.history_tokens,
            "turn_tokens": args.turn_tokens,
            "kv_blocks": args.kv_blocks,
            "json_schema": str(args.json_schema) if getattr(args, "json_schema", None) else None,
            "api": "completions" if completions else "chat",
            "threads": args.threads,
            "replicas": getattr(args, "replicas", None),
            "llama_server": None
            if args.llama_server is None
            else {
                "path": str(args.llama_server),
                "version": version(args.llama_server),
                "slot_context": args.llama_server_context,
            },
            "kernel_isa": kernel_path(args.quantize),
            "load_average_before": load_before,
            "load_average": list(os.getloadavg()),  # after the run
        },
        "servers": results,
        "targets": {
            **targets(results, args.clients),
            **replica_targets(
                results.get(f"flashformer (max batch {args.clients})", {}),
                results.get(replicas_name(args), {}) if getattr(args, "replicas", None) else {},
            ),
        },
    }


def targets(results: dict, clients: int) -> dict:
    """The issues' ratios: flashformer's batching server against itself alone and one at a time,
    with its prefix cache against without, against llama-server when it ran, and one client's
    decode rate against the library's own."""
    ours = results.get(f"flashformer (max batch {clients})", {})
    single = results.get("flashformer (one at a time)", {})
    uncached = results.get(f"flashformer (max batch {clients}, no prefix cache)", {})
    found = peer_targets(ours, results.get(f"llama-server (-np {clients})", {}), clients)
    found.update(library_targets(ours, results.get(serve_library.LIBRARY, {})))
    found = {name: value for name, value in found.items() if value is not None}
    if "shared_prefix" in ours and "shared_prefix" in uncached:
        on, off = ours["shared_prefix"], uncached["shared_prefix"]
        found["shared prefix: TTFT p50, cache on / off (<= 0.5)"] = on["ttft_p50_s"] / off["ttft_p50_s"]
        found["shared prefix: output tokens/s, cache on / off (>= 1.25)"] = (
            on["output_tokens_per_s"] / off["output_tokens_per_s"]
        )
    if "multi_turn" in ours:
        turns = ours["multi_turn"]["alone"]["ttft_p50_by_turn_s"]
        if len(turns) > 1 and None not in turns[:2]:
            found["multi-turn, one chat: turn 2's TTFT / turn 1's (<= 0.15)"] = turns[1] / turns[0]
    if "loaded" not in ours or "loaded" not in single:
        return found
    alone = ours["alone"]
    return {
        **found,
        f"aggregate tokens/s, {clients} clients / one at a time (>= 4)": ours["loaded"]["output_tokens_per_s"]
        / single["loaded"]["output_tokens_per_s"],
        "p99 inter-token latency / one client's step time (<= 3)": ours["loaded"]["itl_p99_s"]
        / alone["itl_p50_s"],
        "p50 time to first token / one prompt's prefill (<= 2)": ours["loaded"]["ttft_p50_s"]
        / alone["ttft_p50_s"],
    }


def library_targets(ours: dict, library: dict) -> dict:
    """One client's decode rate served against the library's batch-1 decode (bench generate's
    way), and against the library's on the same questions; its output tokens/s (the prompts
    included) against the library's on the same questions."""
    alone = ours.get("alone", {}).get("decode_tokens_per_s")
    if "alone" not in library or alone is None:
        return {}
    theirs = library["alone"]
    return {
        "1 client: decode tokens/s / the library's batch-1 decode (>= 0.85)": alone
        / library["decode_tokens_per_s"],
        "1 client: decode tokens/s / the library's on the same questions": alone
        / theirs["decode_tokens_per_s"],
        "1 client: output tokens/s / the library's on the same questions": ours["alone"][
            "output_tokens_per_s"
        ]
        / theirs["output_tokens_per_s"],
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="a GGUF file, a Hugging Face folder or a run")
    parser.add_argument("--clients", type=int, default=16, help="requests in flight")
    parser.add_argument("--requests", type=int, default=48, help="requests in all")
    parser.add_argument("--max-tokens", type=int, default=128, help="the longest output drawn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="threads of every server")
    add_quantize_argument(parser, "how flashformer's servers load the model (as `serve --quantize`)")
    parser.add_argument(
        "--prefill-chunk", type=int, help="flashformer serve's --prefill-chunk (default: its own)"
    )
    parser.add_argument(
        "--prefill-budget", type=int, help="flashformer serve's --prefill-budget (default: its own)"
    )
    parser.add_argument("--kv-blocks", type=int, help="flashformer serve's --kv-blocks (default: its own)")
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, of {', '.join(WORKLOADS)} (mixed: today's questions; the others run "
        "with the prefix cache on and off)",
    )
    parser.add_argument(
        "--system-tokens", type=int, default=512, help="shared-prefix: the system prompt's tokens"
    )
    parser.add_argument("--chats", type=int, default=4, help="multi-turn: chats in flight")
    parser.add_argument("--turns", type=int, default=3, help="multi-turn: turns of each chat")
    parser.add_argument(
        "--history-tokens", type=int, default=1000, help="multi-turn: tokens of a chat's first message"
    )
    parser.add_argument("--turn-tokens", type=int, default=32, help="multi-turn: max_tokens of each turn")
    parser.add_argument(
        "--json-schema",
        type=Path,
        metavar="FILE",
        help="mixed workload: every answer follows this JSON schema (response_format json_schema)",
    )
    parser.add_argument(
        "--llama-server",
        metavar="PATH",
        help="llama.cpp's llama-server binary: measured on the same GGUF file with --clients parallel "
        "slots (-np), its prompt cache on and off, instead of llama-cpp-python's unbatched server",
    )
    parser.add_argument(
        "--llama-server-context",
        type=int,
        default=SLOT_CONTEXT,
        help="tokens of each llama-server slot (-c is --clients times this)",
    )
    parser.add_argument(
        "--no-llama-cpp", action="store_true", help="leave llama-cpp-python's server out (no --llama-server)"
    )
    parser.add_argument(
        "--no-library",
        action="store_true",
        help="leave out the library's own run of the one-client questions (batch 1, no server)",
    )
    parser.add_argument(
        "--long-context",
        type=int,
        metavar="TOKENS",
        help="instead of the workloads: one prompt of TOKENS tokens per KV type, a fresh server each "
        "(bench/long_context.py): KV bytes per token, TTFT, decode, RSS; with --llama-server its too",
    )
    parser.add_argument(
        "--cache-types",
        help="with --long-context: KEYS[/VALUES] types, comma-separated (f16,q8_0,q8_0/q4_0,q4_0)",
    )
    parser.add_argument(
        "--timeout", type=float, default=3600, help="with --long-context: seconds a request may take"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        metavar="N",
        help="also flashformer serve --replicas N (Ray Serve), --threads split between the replicas "
        "(bench/serve_replicas.py), on the same workloads",
    )
    parser.add_argument(
        "--kill-replica",
        action="store_true",
        help="with --replicas: then the mixed workload's questions again, one replica killed 5 s in "
        "(hung and failed requests, seconds until the replicas are back)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for JSON and PNG")


def main_from_args(args: argparse.Namespace) -> dict:
    args.quantize = resolved_quantize(args.model, args.quantize)
    if args.long_context is not None:
        return _long_context(args)
    if args.cache_types is not None:
        raise ValueError("--cache-types is a --long-context option")
    payload = run(args.model, args)
    write_json(args.out / "serve.json", payload)
    plot(payload, args.out / "serve.png")
    print(table(payload))
    print(f"\nwrote {args.out / 'serve.json'} and {args.out / 'serve.png'}")
    return payload


def _long_context(args: argparse.Namespace) -> dict:
    from flashformer.bench import long_context

    if args.long_context < 1:
        raise ValueError(f"--long-context must be a positive number of tokens; got {args.long_context}")
    args.out.mkdir(parents=True, exist_ok=True)
    payload = long_context.run(args.model, args)
    write_json(args.out / "long-context.json", payload)
    long_context.plot(payload, args.out / "long-context.png")
    print(long_context.table(payload))
    print(f"\nwrote {args.out / 'long-context.json'} and {args.out / 'long-context.png'}")
    return payload
