"""The tables scripts/docs.py writes into README.md and docs/, each drawn from JSON stored under
docs/figures: the runs' own JSON where it was kept, and where it was not, the figures transcribed
from the page that first printed them (`transcribed_table`, each file's "provenance" says whence).
"""

from __future__ import annotations

import json
from pathlib import Path

from flashformer.bench import serve_report, turns
from flashformer.formatting import markdown_table

# ---- tables drawn from several stored runs: README.md's headline, docs/benchmarks.md's summaries ----


def stored(docs: Path, relative: str) -> dict:
    """A stored run's JSON, docs/figures/RELATIVE."""
    path = docs / "figures" / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the stored run a generated table is drawn from is missing")
    return json.loads(path.read_text())


# the native decoder against llama-bench (scripts/bench_isa_turns.py): (file, JSON name, decode target)
TURNS_FILES = (
    ("SmolLM2-135M Q4_1", "smollm2", 1.3),
    ("Gemma 3 270M Q4_K_M", "gemma3", 1.3),
    ("Llama-3.2-1B shapes Q4_K_M (0.8 GB)", "llama1b-shape", 1.1),
)
TURNS_PATHS = (("native (AMX, VNNI)", "native"), ("AMX off (AVX-512 VNNI)", "vnni"), ("AVX2", "avx2"))
PROMPT_TARGET = 2.0
# flashformer serve against llama-server, one client and 16: (label, JSON name)
SERVE_RUNS = (
    ("SmolLM2, native", "smollm2-native"),
    ("SmolLM2, AVX2", "smollm2-avx2-forced"),
    ("Gemma 3, native", "gemma3-native"),
    ("Gemma 3, AVX2", "gemma3-avx2-forced"),
)


def turns_runs(docs: Path, paths: tuple[tuple[str, str], ...]):
    """The stored turns runs (scripts/bench_isa_turns.py), file by file and path by path in the
    tables' order, each read once: (file label, JSON name, decode target, path label, path suffix,
    its payload). A run not stored is left out."""
    for file, name, target in TURNS_FILES:
        for label, suffix in paths:
            relative = f"measured/turns-{name}-{suffix}.json"
            if (docs / "figures" / relative).is_file():
                yield file, name, target, label, suffix, stored(docs, relative)


def measured_on(payload: dict) -> str:
    """The day a turns run was measured (bench_isa_turns.py's config), or "-" if it says none."""
    return payload["config"].get("date", "-")


def native_decoder_table(docs: Path) -> str:
    rows = [
        (file, f"{label}, {measured_on(payload)}", payload, target, PROMPT_TARGET)
        for file, _, target, label, _, payload in turns_runs(docs, TURNS_PATHS)
    ]
    return turns.summary_table(rows)


def serve_versus_table(docs: Path, folder: str) -> str:
    """SERVE_RUNS' one-client and 16-client runs stored in docs/figures/FOLDER, a row each."""
    rows = [
        (
            label,
            stored(docs, f"{folder}/serve-{name}-1-client.json"),
            stored(docs, f"{folder}/serve-{name}.json"),
        )
        for label, name in SERVE_RUNS
    ]
    return serve_report.versus_table(rows)


def native_serve_table(docs: Path) -> str:
    return serve_versus_table(docs, "measured")


# the headline's CPU paths (label, turns JSON suffix), and the served runs beside two of them
HEADLINE_PATHS = (("Xeon, AMX", "native"), ("same Xeon, AMX off", "vnni"), ("same Xeon, AVX2 forced", "avx2"))
SERVED_SUFFIX = {"native": "native", "avx2": "avx2-forced"}


def readme_headline(docs: Path) -> str:
    """README.md's one table: what a user types with no flags (`flashformer.load(FILE)`, the file's
    own blocks) against llama.cpp on the same files, a row per CPU path, from the runs
    docs/benchmarks.md's "The native decoder" tabulates in full."""

    def ratio(ours: float, theirs: float, digits: int) -> str:
        return f"{ours:.{digits}f} / {theirs:.{digits}f} (**{ours / theirs:.1f}x**)"

    rows, machine = [], None
    for file, name, _, label, suffix, payload in turns_runs(docs, HEADLINE_PATHS):
        machine = machine or payload["machine"]
        ours, theirs = payload["summary"]["flashformer"], payload["summary"]["llama.cpp"]
        decode_digits = 0 if ours["decode"]["best"] > 50 else 1
        row = [
            file,
            f"{label}, {measured_on(payload)}",
            ratio(ours["decode"]["best"], theirs["decode"]["best"], decode_digits),
            ratio(ours["prompt"]["best"], theirs["prompt"]["best"], 0),
            turns.memory_line(payload),
        ]
        served = f"measured/serve-{name}-{SERVED_SUFFIX[suffix]}.json" if suffix in SERVED_SUFFIX else None
        if served and (docs / "figures" / served).is_file():
            ours_served, theirs_served = serve_report.ours_and_theirs(stored(docs, served))
            row.append(ratio(ours_served["output_tokens_per_s"], theirs_served["output_tokens_per_s"], 0))
        else:
            row.append("-")
        rows.append(row)
    header = [
        "GGUF file",
        "CPU, measured",
        "decode tokens/s: flashformer / llama.cpp",
        "512-token prompt tokens/s",
        "our peak RSS: file + KV + the rest, MB",
        "served, 16 clients: tokens/s against llama-server",
    ]
    return (
        f"`flashformer.load(FILE)` as typed, no flags (the file's own blocks), on a 2-core {machine['cpu']} "
        'virtual machine (Sapphire Rapids: AVX-512 VNNI and AMX; "AMX off" and "AVX2 forced" run the '
        "kernels a CPU without them runs, `FLASHFORMER_CPU_ISA`), 2 threads, batch 1, greedy; best of fresh "
        "processes in turns against llama-bench's tg128 and pp512 on the same file, llama.cpp built for the "
        "same CPU (AVX2 rows: its AVX2-only build). This virtual machine's speed moves with its host's load "
        "from day to day, ours and llama.cpp's alike: compare the ratios, each taken within one run. On a "
        "real AVX2-only CPU (AMD EPYC Zen 3) the lead is "
        "smaller: [docs/benchmarks.md](docs/benchmarks.md#the-native-decoder-the-default-path-against-llamacpp)."
        "\n\n" + markdown_table(header, rows)
    )


# ---- the maintainer scripts' attention runs (scripts/bench_paged_attention.py, bench_decode_attention.py) ----

# a column of the paged-attention table: its heading, and the run it shows (a name in ms_per_step)
PAGED_COLUMNS = {
    "cpu": (
        ("paged, cpu (one C++ call; auto)", "paged/cpu (one call)"),
        ("paged, torch (per sequence, SDPA)", "paged/torch (per sequence, SDPA)"),
        ("paged, flash (per sequence)", "paged/flash"),
        ("one padded call", "batched (not invariant)"),
        ("dense static cache", "dense static cache"),
    ),
    "cuda": (
        ("paged, triton (splits of 256)", "paged/triton split 256"),
        ("triton, splits 64-512", "paged/triton split"),  # the range over every split length
        ("paged, auto per sequence (SDPA)", "paged/auto"),
        ("paged, flash per sequence", "paged/flash"),
        ("one padded call (not invariant)", "batched (not invariant)"),
        ("dense static cache", "dense static cache"),
    ),
}


def paged_attention_table(payload: dict) -> str:
    """One decode step's attention over every layer's paged pool, ms per step, by batch and lengths."""
    columns = PAGED_COLUMNS[payload["device"]]
    rows = []
    for result in payload["results"]:
        row = [str(result["batch"]), result["lengths"]]
        for _, run in columns:
            if run in result["ms_per_step"]:
                row.append(f"{result['ms_per_step'][run]:.1f}")
            else:
                splits = [ms for name, ms in result["ms_per_step"].items() if name.startswith(run + " ")]
                row.append(f"{min(splits):.1f}-{max(splits):.1f}")
        rows.append(row)
    return markdown_table(["batch", "keys per sequence", *(heading for heading, _ in columns)], rows)


LOAD_FILES = (  # docs/figures/load/NAME.json (scripts/gguf_memory.py --out), the table's rows in order
    ("SmolLM2-135M Q4_1", "smollm2"),
    ("Gemma 3 270M Q4_K_M", "gemma3"),
    ("Llama-3.2-1B shapes Q4_K_M", "llama1b-shape"),
)


def load_time_table(docs: Path) -> str:
    """The load alone (our flashformer.load against llama.cpp's model and context) and the whole
    wait, process start to first token, fresh processes in turns: best (worst) seconds."""
    header = ["file (size)", "load: flashformer", "llama.cpp", "best / best", "to first token: flashformer",
              "llama.cpp", "best / best", "peak RSS MB ours / llama.cpp", "load average"]  # fmt: skip
    rows = []
    for label, name in LOAD_FILES:
        run = stored(docs, f"load/{name}.json")
        ours, theirs = run["load_s"]["flashformer"], run["load_s"]["llama.cpp"]
        cold = run["cold_start"]["summary"]
        first, second = cold["flashformer"], cold["llama.cpp"]
        cells = [f"{label} ({run['file_bytes'] / 1e6:.0f} MB)", f"{min(ours):.2f} ({max(ours):.2f}) s",
                 f"{min(theirs):.2f} ({max(theirs):.2f}) s", f"**{min(ours) / min(theirs):.2f}x**",
                 f"{first['best']:.2f} ({first['worst']:.2f}) s", f"{second['best']:.2f} ({second['worst']:.2f}) s",
                 f"**{first['best'] / second['best']:.2f}x**",
                 f"{first['max_rss_of_best'] / 1e6:.0f} / {second['max_rss_of_best'] / 1e6:.0f}",
                 " -> ".join(f"{v:.1f}" for v in run["load_average"])]  # fmt: skip
        rows.append(cells)
    return markdown_table(header, rows)


COLD_START_COMMANDS = ("generate", "chat", "serve")  # scripts/cold_start_turns.py's, the table's rows


def cold_start_table(payload: dict) -> str:
    """scripts/cold_start_turns.py's run: each command's wall seconds to its first token (serve: to
    /health) from the base tree and this one, and what it takes beyond a bare `import torch`."""
    summary = payload["summary"]
    torch_best, torch_median = summary["import torch"]["best"], summary["import torch"]["median"]

    def seconds(s: dict | None) -> str:
        if not s or "best" not in s:
            return "-"
        return f"{s['best']:.2f} / {s['median']:.2f} ({s['best']:.2f}-{s['worst']:.2f})"

    def cpu(s: dict | None) -> str:
        return "-" if not s or "best" not in s else f"{s['cpu_median']:.2f}"

    rows = [["`python -c \"import torch\"`", "-", seconds(summary["import torch"]), "-", "-",
             cpu(summary["import torch"])]]  # fmt: skip
    for name in COLD_START_COMMANDS:
        before, after = summary.get(f"{name} (base)"), summary.get(f"{name} (this)")
        beyond = "-"
        if after and "best" in after:
            beyond = f"**{after['best'] - torch_best:+.2f}** / {after['median'] - torch_median:+.2f}"
        rows.append([f"`{name}`", seconds(before), seconds(after), beyond, cpu(before), cpu(after)])
    loads = [v for s in summary.values() if "load_average" in s for v in s["load_average"]]
    head = (
        f"{payload['config']['runs']} fresh processes of each, in turns; wall seconds best / median (range); "
        f"load average {min(loads):.1f}-{max(loads):.1f}\n\n"
    )
    header = ["command", "before: seconds", "after: seconds", "after - import torch: best / median",
              "CPU s before (median)", "after"]  # fmt: skip
    return head + markdown_table(header, rows) + "\n\n" + cold_start_phases_table(payload)


def cold_start_phases_table(payload: dict) -> str:
    """`generate`'s phases in its main thread's CPU seconds, the median over the turns, each tree."""
    from cold_start_turns import phase_medians

    medians = phase_medians(payload)
    trees = [tree for tree in ("base", "this") if tree in medians]
    names = list(medians[trees[-1]])
    rows = [[name, *(f"{medians[tree][name] * 1e3:.0f}" if name in medians[tree] else "-" for tree in trees)]
            for name in names]  # fmt: skip
    if "import torch" in medians:
        alone = f"{medians['import torch']['total'] * 1e3:.0f}"
        rows.append(['`python -c "import torch"` (its interpreter included)', *[alone] * len(trees)])
    header = [
        "`generate`, main thread CPU ms (median)",
        *("before" if t == "base" else "after" for t in trees),
    ]
    return markdown_table(header, rows)


ROW_COST_MODELS = (  # scripts/row_cost.py's model file names, the table's order, and their labels
    ("llama-1b-shape.q4_k_m.gguf", "Llama-3.2-1B shapes Q4_K_M"),
    ("gemma-3-270m-q4_k_m.gguf", "Gemma 3 270M Q4_K_M"),
)


def row_cost_table(payload: dict, before: str = "before", after: str = "after") -> str:
    """scripts/row_cost.py's runs of two labels: per model and rows, the best forward over the
    fresh processes of each label (ms, the range), their ratio, and what each row past the first
    costs against the label's own one-row forward."""
    header = ["model", "rows", f"{before} ms", f"{after} ms", f"{after} / {before}",
              f"a row past the first, {before}", f"{after}"]  # fmt: skip
    rows = []
    for model, label in ROW_COST_MODELS:
        # label -> rows -> (the best process's best ms, the worst process's best ms)
        best = {}
        for name in (before, after):
            runs = [r for r in payload["runs"] if r["model"] == model and r["label"] == name]
            if runs:
                times = {n: [run["rows"][n]["best_s"] * 1e3 for run in runs] for n in runs[0]["rows"]}
                best[name] = {n: (min(ms), max(ms)) for n, ms in times.items()}
        if len(best) < 2:
            continue
        for n in (n for n in best[after] if n in best[before]):
            (b, b_hi), (a, a_hi) = best[before][n], best[after][n]
            per_row = ["" if n == "1" else f"{(best[name][n][0] / best[name]['1'][0] - 1) / (int(n) - 1):.2f}"
                       for name in (before, after)]  # fmt: skip
            rows.append(
                [label, n, f"{b:.1f} ({b_hi:.1f})", f"{a:.1f} ({a_hi:.1f})", f"**{a / b:.2f}x**", *per_row]
            )
    return markdown_table(header, rows)


def speculative_runs_table(docs: Path, runs: tuple[tuple[str, str], ...]) -> str:
    """Several `bench generate --prompt-lookup` runs of one model side by side, a row each: each
    workload's lookup / plain ratio (its best process against its best) and the served passes'."""
    payloads = [(label, stored(docs, f"speculative/{name}.json")) for label, name in runs]
    workloads = list(payloads[0][1]["summary"])
    clients = list(payloads[0][1].get("served", {}))
    header = ["run", *workloads, *(f"served, {c} client{'s' if c != '1' else ''}" for c in clients)]
    rows = [
        [label, *(f"{payload['summary'][w]['speculative / plain']:.2f}x" for w in workloads)]
        + [f"{payload['served'][c]['speculative / plain']:.2f}x" for c in clients]
        for label, payload in payloads
    ]
    return markdown_table(header, rows)


def served_runs_table(docs: Path, runs: tuple[tuple[str, str], ...]) -> str:
    """The served passes of several runs side by side, a row each: speculative / plain output
    tokens/s at each client count (its best server against its best), "-" where a run had none."""
    payloads = [(label, stored(docs, f"speculative/{name}.json")["served"]) for label, name in runs]
    clients = sorted({c for _, served in payloads for c in served}, key=int)
    header = ["run", *(f"{c} client{'s' if c != '1' else ''}" for c in clients)]
    rows = [
        [label, *(f"{served[c]['speculative / plain']:.2f}x" if c in served else "-" for c in clients)]
        for label, served in payloads
    ]
    return markdown_table(header, rows)


def kld_programs_table(payload: dict) -> str:
    """eval kld beside llama-perplexity on one text: each run's base, each program's figures, and
    the mean KLD over llama-perplexity's on the same base."""
    header = ["MODEL", "base file", "program", "PPL(Q)", "PPL(base)", "mean KLD", "median KLD", "99 % KLD",
              "RMS Δp", "same top", "mean KLD / llama-perplexity's"]  # fmt: skip
    sections = []
    for run in payload["runs"]:
        theirs = {
            (r["model"], r["base"]): r["mean_kld"] for r in run["rows"] if r["program"] == "llama-perplexity"
        }
        rows = []
        for r in run["rows"]:
            ratio = r["mean_kld"] / theirs[r["model"], r["base"]]
            cells = [r["model"], r["base"], r["program"], f"{r['ppl_q']:.4f}", f"{r['ppl_base']:.4f}",
                     f"{r['mean_kld']:.6f} ± {r['kld_error']:.6f}", f"{r['median_kld']:.4g}", f"{r['p99_kld']:.4g}",
                     f"{r['rms_dp_percent']:.3f} %", f"{r['same_top_percent']:.2f} %", f"{ratio:.3f}"]  # fmt: skip
            rows.append(cells)
        sections.append(
            f"{run['date']}, the base's tokens: {run['base_tokens']}\n\n" + markdown_table(header, rows)
        )
    return "\n\n".join(sections)


def decode_attention_table(payload: dict) -> str:
    """attention() over a static cache, backend "cpu" against "torch", µs a call, by key count."""
    lengths = sorted({r["k_len"] for r in payload["results"]})
    cells: dict[tuple, dict[int, str]] = {}
    for r in payload["results"]:
        key = (r["model"], r["batch"], r["q_len"])
        cells.setdefault(key, {})[r["k_len"]] = (
            f"{r['us']['cpu']:.0f} / {r['us']['torch']:.0f} ({r['torch_over_cpu']:.2f})"
        )
    header = [
        "heads (q/kv x dim)",
        "batch",
        "queries a row",
        f"{lengths[0]} keys: cpu / torch µs (torch/cpu)",
        *(f"{n} keys" for n in lengths[1:]),
    ]
    rows = [
        [model, str(batch), str(q_len), *(row.get(n, "-") for n in lengths)]
        for (model, batch, q_len), row in cells.items()
    ]
    return markdown_table(header, rows)


# ---- tables whose runs' JSON was not kept: their figures transcribed from the page, cell for cell ----

# (page, marker) -> docs/figures/RELATIVE holding {"provenance", "header", "rows"}
TRANSCRIBED = {
    ("benchmarks.md", "mapped-weights-load"): "load/mapped-weights.json",
    ("benchmarks.md", "llama8b-shape-targets"): "shapes/llama8b-targets.json",
    ("benchmarks.md", "speculative-served"): "speculative/served-smollm2.json",
    ("benchmarks.md", "epyc-turns"): "turns/epyc-compiled.json",
    ("benchmarks.md", "epyc-avx2-turns"): "turns/epyc-avx2-issue61.json",
    ("benchmarks.md", "compile-cache"): "compile/session-graphs.json",
    ("benchmarks.md", "step-thread"): "serve/step-thread.json",
    ("benchmarks.md", "served-token-engine"): "serve/served-token-engine.json",
    ("benchmarks.md", "served-token-bench"): "serve/served-token-bench.json",
    ("benchmarks.md", "kquant-kernels"): "kernels/kquant-kernels.json",
    ("serving.md", "grammar-engines"): "structured/grammar-engines.json",
    ("serving.md", "structured-overhead"): "structured/overhead.json",
    ("serving.md", "structured-served"): "structured/served.json",
    ("serving.md", "serve-targets"): "serve/targets.json",
    ("serving.md", "avx2-serve"): "serve/avx2-llama-server.json",
    ("serving.md", "prefill-budget"): "serve/prefill-budget.json",
    ("serving.md", "prefix-cache"): "serve/prefix-cache.json",
    ("serving.md", "serve-under-load"): "serve/llama-server-2026-12-02.json",
}


def transcribed_table(payload: dict) -> str:
    """A table stored as its header and rows of cell text; an empty cell stays `| |`."""

    def line(cells: list[str]) -> str:
        return "|" + "".join(f" {cell} |" if cell else " |" for cell in cells)

    header = payload["header"]
    return "\n".join([line(header), "|" + "---|" * len(header), *(line(row) for row in payload["rows"])])


# ---- flashformer serve against llama-server, from the runs' own JSON ----


def epyc_serve_table(docs: Path) -> str:
    """The AVX-512 EPYC's campaign (2026-12-05, the decode step compiled), docs/figures/serve-epyc:
    the same runs as SERVE_RUNS; the one-client ITL column (the first of the two) names that
    campaign's target."""
    table = serve_versus_table(docs, "serve-epyc")
    return table.replace("| ITL p99 ms |", "| ITL p99 ms (target ratio <= 1.2) |", 1)


ACTIVATION_FILES = (("SmolLM2-135M Q4_1", "smollm2"), ("Gemma 3 270M Q4_K_M", "gemma3"))


def activations_table(docs: Path) -> str:
    """Each activation scheme's KL divergence (`flashformer eval kld --base` the same file with
    float32 activations: activations/kld-NAME-SCHEME.json, llama.cpp's logits as kld-NAME-llama.cpp)
    beside its speed (scripts/bench_activations.py: activations/speed-NAME.json), the schemes in
    the order that run timed them."""
    rows = []
    for label, name in ACTIVATION_FILES:
        run = stored(docs, f"activations/speed-{name}.json")
        speed = run["summary"]
        theirs = stored(docs, f"activations/kld-{name}-llama.cpp.json")["kld"]["mean"]
        for scheme in ("llama.cpp", *run["config"]["schemes"]):
            rates = speed.get(scheme)
            if scheme == "float32":
                kld_cells = ["0 (the base)", "", ""]
            else:
                found = stored(docs, f"activations/kld-{name}-{scheme}.json")
                kld = found["kld"]
                kld_cells = [
                    f"{kld['mean']:.5f} ± {kld['error']:.5f}",
                    "1" if scheme == "llama.cpp" else f"**{kld['mean'] / theirs:.2f}**",
                    f"{100 * found['same_top']['mean']:.1f} %",
                ]
            if rates is None:
                speed_cells = ["-", "-"]
            else:
                base = speed["int8"]
                speed_cells = [
                    f"{rates[k]['best']:.0f} / {rates[k]['median']:.0f} "
                    f"({rates[k]['best'] / base[k]['best']:.2f}, {rates[k]['median'] / base[k]['median']:.2f})"
                    for k in ("decode", "prompt")
                ]
            rows.append([label, scheme, *kld_cells, *speed_cells])
    header = [
        "file",
        "activations",
        "mean KLD against float32 activations",
        "over llama.cpp's",
        "same top token",
        "decode tokens/s best / median (over int8's)",
        "512-token prompt tokens/s (over int8's)",
    ]
    return markdown_table(header, rows)


QUANTIZED_KLD_FILES = (("MXFP4_MOE", "experts MXFP4, the rest Q8_0"), ("Q8_0", "every matrix Q8_0"))


def quantized_kld_table(docs: Path, folder: str = "mxfp4") -> str:
    """Each quantized file's KL divergence from its F32 file's logits, each side against its own:
    llama.cpp's (its logits of both files: FOLDER/kld-TYPE-llama.cpp.json) and ours with int8 and
    float32 activations (FOLDER/kld-TYPE-int8.json, -float32.json), over the same tokens."""
    rows = []
    for name, mix in QUANTIZED_KLD_FILES:
        theirs = stored(docs, f"{folder}/kld-{name}-llama.cpp.json")["kld"]["mean"]
        for scheme in ("llama.cpp", "int8", "float32"):
            found = stored(docs, f"{folder}/kld-{name}-{scheme}.json")
            kld = found["kld"]
            rows.append(
                [
                    f"{name} ({mix})",
                    "llama.cpp" if scheme == "llama.cpp" else f"ours, {scheme} activations",
                    f"{kld['mean']:.6f} ± {kld['error']:.6f}",
                    "1" if scheme == "llama.cpp" else f"**{kld['mean'] / theirs:.2f}**",
                    f"{100 * found['same_top']['mean']:.1f} %",
                ]
            )
    header = ["file", "run by", "mean KLD against the F32 file", "over llama.cpp's", "same top token"]
    return markdown_table(header, rows)
