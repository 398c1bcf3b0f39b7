"""Fresh processes in turns (scripts/bench_isa_turns.py): flashformer's default path against
llama.cpp's llama-bench on one GGUF file, each contender in N fresh processes taken in turns, 2
threads, batch 1, greedy. Decode: 128 tokens after a short prompt (llama-bench's tg128: 128 from
an empty context); prompt: 512 tokens (pp512). This module renders the script's JSON: each
contender's best, median and range, and our best and median over theirs."""

from __future__ import annotations

from pathlib import Path

KINDS = ("decode", "prompt")


def memory(payload: dict) -> dict | None:
    """Our processes' peak RSS against what they must hold (the file and the KV cache of the
    prompt's 513 tokens; scripts/bench_isa_turns.py's worker reads both): the smallest and largest
    peak, and the overhead beyond file + KV. None for runs stored before the worker measured it."""
    found = [r for r in payload.get("runs", {}).get("flashformer", []) if "peak_rss_bytes" in r]
    if not found:
        return None
    peaks = [r["peak_rss_bytes"] for r in found]
    held = found[0]["file_bytes"] + found[0]["kv_bytes"]
    return {
        "peak_min": min(peaks),
        "peak_max": max(peaks),
        "file": found[0]["file_bytes"],
        "kv": found[0]["kv_bytes"],
        "overhead_max": max(peaks) - held,
    }


def memory_line(payload: dict) -> str:
    """'480-484 MB: file 98 + KV 12 + 374' (the smallest and largest peak, then the largest one
    parted), or '-' where not measured."""
    m = memory(payload)
    if m is None:
        return "-"
    mb = 1e6
    return (
        f"{m['peak_min'] / mb:.0f}-{m['peak_max'] / mb:.0f} MB: file {m['file'] / mb:.0f} + KV "
        f"{m['kv'] / mb:.0f} + {m['overhead_max'] / mb:.0f}"
    )


def table(payload: dict) -> str:
    from flashformer.formatting import markdown_table

    config, summary = payload["config"], payload["summary"]
    ours, theirs = summary.get("flashformer"), summary.get("llama.cpp")
    # the path our workers reported (the best this CPU has, or --isa's)
    path = next((r["isa"] for r in payload["runs"].get("flashformer", []) if r.get("isa")), config.get("isa"))
    binary = config.get("llama_bench")
    peer = f"llama-bench of {Path(binary).parent.parent.name}" if binary else "llama-cpp-python"
    if binary and config.get("llama_bench_repetitions", 3) != 3:  # its -r, where fewer than its usual 3
        peer += f" (-r {config['llama_bench_repetitions']})"
    head = (
        f"{Path(config['file']).name}, {config['threads']} threads, our kernels' path {path or 'best'}, "
        f"llama.cpp: {peer}; {len(payload['runs'].get('flashformer', []))} fresh processes each, in turns"
    )
    rss = memory_line(payload)
    if rss != "-":
        head += f"; our peak RSS {rss} (the rest: Python, torch, the kernels, buffers)"
    head += "\n\n"
    rows = []
    for kind in KINDS:
        row = [kind]
        for rates in (ours, theirs):
            if rates is None:
                row += ["-"]
                continue
            r = rates[kind]
            row += [f"{r['best']:.1f} / {r['median']:.1f} ({r['worst']:.1f}-{r['best']:.1f})"]
        if ours and theirs:
            row += [
                f"{ours[kind]['best'] / theirs[kind]['best']:.2f}",
                f"{ours[kind]['median'] / theirs[kind]['median']:.2f}",
                f"{ours[kind]['median'] / ours[kind]['best']:.2f}",
            ]
        else:
            row += ["-", "-", "-"]
        rows.append(row)
    header = [
        "tokens/s",
        "flashformer: best / median (range)",
        "llama.cpp: best / median (range)",
        "best / best",
        "median / median",
        "our median / our best",
    ]
    return head + markdown_table(header, rows)


def summary_table(rows: list[tuple[str, str, dict, float, float]]) -> str:
    """One line per run of the script: (file, path, its payload, decode target, prompt target),
    the targets as our best over llama.cpp's best. A ratio is bold where it meets its target."""
    from flashformer.formatting import markdown_table

    def ratio(ours: dict, theirs: dict, target: float) -> tuple[str, str]:
        best = ours["best"] / theirs["best"]
        shown = f"**{best:.2f}**" if best >= target else f"{best:.2f}"
        return (
            f"{shown} ({ours['median'] / theirs['median']:.2f})",
            f"{target:g}: {'met' if best >= target else 'not met'}",
        )

    lines = []
    for file, path, payload, decode_target, prompt_target in rows:
        ours, theirs = payload["summary"]["flashformer"], payload["summary"]["llama.cpp"]
        decode, prompt = ours["decode"], ours["prompt"]
        lines.append(
            [
                file,
                path,
                f"{decode['best']:.1f} / {decode['median']:.1f} against "
                f"{theirs['decode']['best']:.1f} / {theirs['decode']['median']:.1f}",
                *ratio(decode, theirs["decode"], decode_target),
                f"{prompt['best']:.0f} / {prompt['median']:.0f} against "
                f"{theirs['prompt']['best']:.0f} / {theirs['prompt']['median']:.0f}",
                *ratio(prompt, theirs["prompt"], prompt_target),
                f"{decode['median'] / decode['best']:.2f}, {prompt['median'] / prompt['best']:.2f}",
                memory_line(payload),
            ]
        )
    header = [
        "file",
        "path",
        "decode tokens/s: ours best / median against llama.cpp's",
        "ratio best (median)",
        "target",
        "pp512 tokens/s: ours against llama.cpp's",
        "ratio best (median)",
        "target",
        "our median / best: decode, prompt",
        "our peak RSS: file + KV + the rest, MB",
    ]
    return markdown_table(header, lines)


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3))
    for ax, kind in zip(axes, KINDS):
        names = list(payload["runs"])
        for i, name in enumerate(names):
            rates = [run[kind] for run in payload["runs"][name]]
            ax.scatter(rates, [i] * len(rates), color="tab:blue" if name == "flashformer" else "tab:orange")
        ax.set_yticks(range(len(names)), names)
        ax.set_xlabel(f"{kind} tokens/s, each fresh process")
        ax.set_xlim(left=0)
    fig.suptitle(
        f"{Path(payload['config']['file']).name}, {payload['config'].get('isa') or 'best'}", fontsize=10
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
