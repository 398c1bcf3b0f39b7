"""`flashformer bench generate`: tokens per second of greedy generation.

The model has GPT-2-small's shape (12 layers, d_model 768, 12 heads, vocab
50257) with random weights. flashformer writes it with save_pretrained and
transformers loads the same folder, so both generate from the same numbers.
For every (batch, dtype) a fresh worker process times, in turns (A B C, B C
A, ...), transformers' generate, flashformer's generate, and flashformer's
generate with the decode step compiled by torch.compile: a 32-token prompt
and 256 new tokens, greedy, no eos (every run produces all 256 tokens).

tokens/s = batch * new tokens / median wall time of one generate call,
prefill included. The compile itself (once per worker) is reported apart.
In float32 the greedy tokens of flashformer and transformers are compared.

The CPU is shared: the load average before and after each point is kept in
the JSON, and --threads fixes torch's thread count (default: torch's own).
Writes generate.json and generate.png to the output folder.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from flashformer.bench import generate_model
from flashformer.bench.common import (
    add_quantize_argument,
    add_run_arguments,
    bench_main,
    names,
    numbers,
    resolved_quantize,
    run_worker,
    time_in_turns,
)
from flashformer.bench.llama_cpp_binaries import REPETITIONS
from flashformer.bench.model_shapes import SHAPES, shape_named, write_shape
from flashformer.checkpoints.loading import QUANTIZE_CHOICES
from flashformer.files import write_json
from flashformer.formatting import markdown_table
from flashformer.generate.proposers import PROPOSERS
from flashformer.kernels.machine import machine_info

MODULE = "flashformer.bench.generate"
CONTENDERS = ["transformers", "flashformer", "flashformer+compile"]
FULL = {
    "batches": [1, 8],
    "dtypes": ["float32", "bfloat16"],
    "prompt_len": 32,
    "new_tokens": 256,
    "rounds": 3,
}
QUICK = {"batches": [1, 8], "dtypes": ["float32"], "prompt_len": 32, "new_tokens": 32, "rounds": 2}
TARGETS = {1: 2.0, 8: 1.5}  # CPU float32: flashformer (best of plain and compiled) over transformers


def build_models(dtype: torch.dtype):
    """(transformers model, flashformer model) with the same random GPT-2-small weights."""
    import transformers

    import flashformer

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = flashformer.build("gpt2", dropout=0.0, attention_dropout=0.0)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        theirs = transformers.GPT2LMHeadModel.from_pretrained(folder, dtype=dtype).eval()
        ours = flashformer.from_pretrained(folder, dtype=dtype).eval()
    theirs.generation_config.eos_token_id = None  # no early stop: every run makes all its tokens
    return theirs, ours


def timing_worker(point: dict) -> dict:
    """Median seconds per generate call of each contender, in turns, in this process."""
    if "model" in point:
        return generate_model.timing_worker(point)
    if point.get("threads"):
        torch.set_num_threads(point["threads"])
    dtype = getattr(torch, point["dtype"])
    theirs, ours = build_models(dtype)
    torch.manual_seed(1)
    ids = torch.randint(0, ours.config.vocab_size, (point["batch"], point["prompt_len"]))
    mask = torch.ones_like(ids)
    new = point["new_tokens"]

    def transformers_generate(n=new):
        with torch.no_grad():
            return theirs.generate(
                ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0
            )

    def flashformer_generate(n=new, compile=False):
        return ours.generate(ids, max_new_tokens=n, eos_token_id=[], compile=compile)

    works = {
        "transformers": transformers_generate,
        "flashformer": flashformer_generate,
        "flashformer+compile": lambda n=new: flashformer_generate(n, compile=True),
    }
    result = {"load_before": os.getloadavg()[0], "threads": torch.get_num_threads()}
    started = time.perf_counter()
    flashformer_generate(3, compile=True)  # compiles the specialized and the dynamic graph
    result["compile_s"] = time.perf_counter() - started
    for work in works.values():  # warm: allocator, caches, lazy initialization
        work(3)
    if dtype == torch.float32:
        result["same_tokens"] = transformers_generate().tolist() == flashformer_generate().tolist()
    times = time_in_turns(works, rounds=point["rounds"], warmup=False)
    result["load_after"] = os.getloadavg()[0]
    result["seconds"] = times
    result["tokens_per_s"] = {name: point["batch"] * new / t for name, t in times.items()}
    return result


def run(config: dict, out_dir: Path, threads: int | None, timeout_s: float) -> dict:
    points = []
    for dtype in config["dtypes"]:
        for batch in config["batches"]:
            point = {
                "batch": batch,
                "dtype": dtype,
                "prompt_len": config["prompt_len"],
                "new_tokens": config["new_tokens"],
                "rounds": config["rounds"],
                "threads": threads,
            }
            point.update(run_worker(MODULE, point, timeout_s))
            points.append(point)
            print(_row(point), flush=True)
    payload = {
        "benchmark": "generate",
        "model": "gpt2-small shape (12 layers, d_model 768, 12 heads, vocab 50257), random weights",
        "machine": machine_info(),
        "config": config,
        "points": points,
        "targets": targets(points),
    }
    write_json(out_dir / "generate.json", payload)
    plot(payload, out_dir / "generate.png")
    return payload


def _row(p: dict) -> str:
    head = f"batch {p['batch']:>2} {p['dtype']:>8}"
    if "error" in p:
        return f"{head}  error: {p['error']}"
    rates = "  ".join(f"{name} {p['tokens_per_s'][name]:7.1f} tok/s" for name in CONTENDERS)
    same = {True: "  same tokens", False: "  TOKENS DIFFER"}.get(p.get("same_tokens"), "")
    return (
        f"{head}  {rates}  (compile {p['compile_s']:.0f} s; load {p['load_before']:.1f} -> "
        f"{p['load_after']:.1f}; {p['threads']} threads){same}"
    )


def targets(points: list[dict]) -> dict:
    """flashformer's best (plain or compiled) over transformers, float32, per batch."""
    found = {}
    for p in points:
        if p["dtype"] != "float32" or "error" in p or p["batch"] not in TARGETS:
            continue
        rates = p["tokens_per_s"]
        best = max(rates["flashformer"], rates["flashformer+compile"])
        found[f"fp32_batch{p['batch']}_flashformer_over_transformers (>= {TARGETS[p['batch']]})"] = (
            best / rates["transformers"]
        )
    return found


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [p for p in payload["points"] if "error" not in p]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(CONTENDERS)
    colors = {"transformers": "tab:gray", "flashformer": "tab:blue", "flashformer+compile": "tab:green"}
    for i, name in enumerate(CONTENDERS):
        xs = [j + (i - (len(CONTENDERS) - 1) / 2) * width for j in range(len(measured))]
        ys = [p["tokens_per_s"][name] for p in measured]
        bars = ax.bar(xs, ys, width, label=name, color=colors[name])
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(measured)), [f"batch {p['batch']}\n{p['dtype']}" for p in measured])
    ax.set_ylabel("tokens / s (higher is better)")
    config = payload["config"]
    ax.set_title(
        f"greedy generation, GPT-2-small shape, {config['prompt_len']}-token prompt + "
        f"{config['new_tokens']} new tokens\n{payload['machine']['cpu']}, "
        f"torch {payload['machine']['torch']}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, quick="32 new tokens, float32 only, 2 rounds", timeout=7200, what="point")
    parser.add_argument("--batches", type=numbers, help="e.g. 1,8")
    parser.add_argument("--dtypes", type=names, help="e.g. float32,bfloat16")
    parser.add_argument("--new-tokens", type=int, help="new tokens per generate call")
    parser.add_argument("--rounds", type=int, help="timed calls per contender")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--model",
        help="a real model (GGUF file, HF folder, run) answering a chat message, instead of GPT-2-small "
        "with random weights: batch 1, --new-tokens (default 256), against transformers on the same weights",
    )
    parser.add_argument(
        "--write-shape",
        nargs=2,
        metavar=("NAME", "PATH"),
        help="the memory-bound case: write (unless PATH exists) a random-weight model of NAME's shapes ("
        + ", ".join(SHAPES)
        + ") as Q4_K_M with flashformer's exporter (bench/model_shapes.py), then benchmark it as --model PATH "
        "(--quantize gguf unless given; transformers left out: its float32 copy is 4 bytes a weight)",
    )
    parser.add_argument(
        "--write-1b-shape",
        type=Path,
        metavar="PATH",
        help="--write-shape llama-3.2-1b PATH",
    )
    parser.add_argument(
        "--cold-starts",
        type=int,
        default=0,
        metavar="N",
        help="with --model and --llama-cpp-dir: also load to first token in N fresh processes each, `flashformer "
        "generate` against the first build's llama-simple, in turns, with their peak RSS (bench/cold_start.py)",
    )
    parser.add_argument(
        "--llama-bench-repetitions",
        type=int,
        default=REPETITIONS,
        metavar="R",
        help="with --llama-cpp-dir: llama-bench's -r (fewer for a model whose pp512 takes minutes)",
    )
    parser.add_argument("--question", default=generate_model.QUESTION, help="with --model: the chat message")
    add_quantize_argument(parser, "with --model: how flashformer loads it (as `generate --quantize`)")
    parser.add_argument("--activations", choices=("int8", "float32"), default="int8", help="with --quantize")
    parser.add_argument(
        "--llama-cpp-dir",
        action="append",
        metavar="DIR",
        help="with --model: a llama.cpp build (DIR/llama-bench or DIR/bin/llama-bench) whose llama-bench "
        "runs pp512 and tg128 on the same file, before and after our worker; repeat for several builds",
    )
    parser.add_argument(
        "--isa",
        choices=tuple(generate_model.ISAS),
        default="best",
        help="with --model: our kernels' and PyTorch's instruction set (avx2: like with like against a "
        "llama.cpp built for AVX2 only)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="with --model: also time flashformer with its decode step under torch.compile (after the "
        "compile, which is reported)",
    )
    parser.add_argument(
        "--prompt-lookup",
        type=int,
        metavar="N",
        help="with --model: speculative decoding instead (bench/speculative.py): plain greedy against prompt "
        "lookup with N drafts on copying and free workloads, beside llama-lookup of --llama-cpp-dir",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=3,
        help="with --prompt-lookup or --cache-types: fresh processes, the best reported",
    )
    parser.add_argument(
        "--cache-types",
        metavar="TYPES",
        help="with --model: KV cache types to compare at --context, e.g. f16,q8_0,q8_0/q4_0 (keys/values; "
        "the first is the baseline)",
    )
    parser.add_argument(
        "--context", type=int, default=4096, help="with --cache-types: the prompt tokens decoding runs after"
    )
    parser.add_argument(
        "--draft",
        metavar="MODEL",
        help="with --prompt-lookup N: a draft model drafts up to N tokens instead (beside llama-speculative -md)",
    )
    parser.add_argument(
        "--draft-quantize", choices=QUANTIZE_CHOICES, help="with --draft: how the draft model loads"
    )
    parser.add_argument(
        "--speculative-method",
        choices=sorted(PROPOSERS),
        help="with --prompt-lookup N: the proposer that drafts up to N tokens (generate.proposers; default "
        "ngram, draft_model with --draft)",
    )
    parser.add_argument(
        "--serve-clients",
        type=numbers,
        help="with --prompt-lookup: also `flashformer serve` with and without --speculative-config, the "
        "copying workloads from these many clients in flight (e.g. 1,2,4,8,16)",
    )
    parser.add_argument(
        "--no-transformers",
        dest="transformers",
        action="store_false",
        help="with --model: leave transformers out (a model too large for its float32 copy)",
    )


def main_from_args(args: argparse.Namespace) -> dict:
    if args.write_1b_shape is not None:
        if args.write_shape is not None:
            raise ValueError("give --write-shape or --write-1b-shape, not both")
        args.write_shape = ["llama-3.2-1b", str(args.write_1b_shape)]
    if args.write_shape is not None:
        args.model = write_shape_once(args)
    if args.model is not None:  # the modes the contenders run, as `generate` would load them
        if args.draft is not None:  # a draft loads as --quantize unless told
            args.draft_quantize = resolved_quantize(args.draft, args.draft_quantize or args.quantize)
        args.quantize = resolved_quantize(args.model, args.quantize)
    if args.cache_types is not None:
        if args.model is None:
            raise ValueError("--cache-types needs --model")
        return run_kv_cache(args)
    if args.prompt_lookup is not None:
        if args.model is None:
            raise ValueError("--prompt-lookup needs --model (a real model's copying and free workloads)")
        return run_speculative(args)
    if args.model is not None:
        config = {
            "question": args.question,
            "new_tokens": args.new_tokens or 256,
            "rounds": args.rounds or 3,
            "quantize": args.quantize,
            "activations": args.activations,
            "batches": args.batches or [1],
            "transformers": args.transformers,
            "llama_cpp_dirs": args.llama_cpp_dir or [],
            "isa": args.isa,
            "compile": args.compile,
            "cold_starts": args.cold_starts,
            "llama_bench_repetitions": args.llama_bench_repetitions,
        }
        if getattr(args, "written", None):  # the export's own time, when this run wrote the file
            config["written"] = args.written
        print(
            f"generate benchmark: {args.model}, {config['new_tokens']} new tokens after a chat message "
            "(plain text for a base model), greedy"
        )
        payload = generate_model.run(args.model, config, args.out, args.threads, args.timeout)
        print(generate_model.table(payload))
        print(f"\nwrote results to {args.out}")
        return payload
    config = dict(QUICK if args.quick else FULL)
    for key in ("batches", "dtypes", "new_tokens", "rounds"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    print(
        f"generate benchmark: GPT-2-small shape, prompt {config['prompt_len']}, {config['new_tokens']} new "
        f"tokens, greedy; each (batch, dtype) in a fresh process, contenders timed in turns"
    )
    payload = run(config, args.out, args.threads, args.timeout)
    print("\ntargets (ratios measured in this run):")
    for name, value in payload["targets"].items():
        print(f"  {name}: {value:.3g}")
    print(f"\nwrote {args.out / 'generate.json'} and {args.out / 'generate.png'}")
    return payload


def write_shape_once(args: argparse.Namespace) -> str:
    """--write-shape NAME PATH: the file written unless PATH exists (whole or not at all), then
    benchmarked as --model PATH from its own blocks; returns PATH."""
    name, path = args.write_shape
    shape_named(name)  # refused by name before anything is written
    if args.model is not None:
        raise ValueError("give --model or --write-shape, not both")
    if not Path(path).exists():
        written = write_shape(name, path)
        print(f"wrote {path} ({written['bytes'] / 1e9:.2f} GB) in {written['seconds']:.0f} s")
        args.written = {"shape": name, "bytes": written["bytes"], "seconds": written["seconds"]}
    args.transformers = False
    return path


def run_speculative(args: argparse.Namespace) -> dict:
    from flashformer.bench import speculative

    dirs = args.llama_cpp_dir or []
    config = {
        "new_tokens": args.new_tokens or 256,
        "rounds": args.rounds or 3,
        "processes": args.processes,
        "quantize": args.quantize,
        "prompt_lookup": args.prompt_lookup,
        "llama_cpp_dir": dirs[0] if dirs else None,
        "serve_clients": args.serve_clients or [],
        "draft": args.draft,
        "draft_quantize": args.draft_quantize,
        "method": args.speculative_method,
    }
    print(
        f"speculative decoding benchmark: {args.model}, {config['new_tokens']} new tokens, greedy, "
        f"{'a draft model' if args.draft else args.speculative_method or 'ngram'} with up to "
        f"{args.prompt_lookup} drafts, "
        f"{args.processes} fresh processes"
    )
    payload = speculative.run(args.model, config, args.out, args.threads, args.timeout)
    print(speculative.table(payload))
    if payload["served"]:
        print(speculative.served_table(payload))
    print(f"\nwrote results to {args.out}")
    return payload


def run_kv_cache(args: argparse.Namespace) -> dict:
    from flashformer.bench import kv_cache

    dirs = args.llama_cpp_dir or []
    config = {
        "types": kv_cache.parse_types(args.cache_types),
        "context": args.context,
        "new_tokens": args.new_tokens or 64,
        "rounds": args.rounds or 3,
        "processes": args.processes,
        "quantize": args.quantize,
        "llama_cpp_dir": dirs[0] if dirs else None,
    }
    print(
        f"KV cache types benchmark: {args.model}, {config['new_tokens']} greedy tokens after {args.context} "
        f"prompt tokens, {args.processes} fresh processes"
    )
    payload = kv_cache.run(args.model, config, args.out, args.threads, args.timeout)
    print(kv_cache.table(payload))
    print(f"\nwrote results to {args.out}")
    return payload


def main(argv: list[str] | None = None) -> None:
    bench_main("flashformer bench generate", __doc__, add_arguments, main_from_args, timing_worker, argv)


if __name__ == "__main__":
    main()


def table(payload: dict) -> str:

    rows = []
    for p in payload["points"]:
        if "error" in p:
            rows.append(
                [str(p["batch"]), p["dtype"], f"not measured: {p['error']}"] + ["-"] * (len(CONTENDERS) + 1)
            )
            continue
        rates = p["tokens_per_s"]
        best = max(rates["flashformer"], rates["flashformer+compile"])
        same = {True: "yes", False: "NO"}.get(p.get("same_tokens"), "-")
        rows.append(
            [str(p["batch"]), p["dtype"]]
            + [f"{rates[name]:.1f}" for name in CONTENDERS]
            + [f"{best / rates['transformers']:.2f}x", same]
        )
    config = payload["config"]
    return (
        f"{config['prompt_len']}-token prompt, {config['new_tokens']} new tokens, greedy; tokens/s:\n\n"
        + markdown_table(
            ["batch", "dtype", *CONTENDERS, "best flashformer / transformers", "same greedy tokens"], rows
        )
    )
