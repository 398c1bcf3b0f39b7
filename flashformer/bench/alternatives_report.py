"""The alternatives study's crossovers, tables and figure, from its JSON (bench/alternatives.py)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

from flashformer.formatting import format_bytes, markdown_table

# metric of the speed points -> (where it is, which way is better)
SPEED_METRICS = {
    "decode tokens/s": ("decode", "decode_tokens_per_s", "higher"),
    "decoding state bytes": ("decode", "state_bytes", "lower"),
    "decode peak RSS": ("decode", "peak_extra_bytes", "lower"),
    "training tokens/s": ("train_speed", "tokens_per_s", "higher"),
}


def _curve(points: list[dict], key: str) -> dict[int, float]:
    return {p["n"]: p[key] for p in points if p.get(key) is not None and p[key] > 0}


def crossovers(payload: dict) -> list[dict]:
    """Where one family's speed or memory passes another's: for every pair of families and metric
    whose order changes between two measured n, the n where the ratio crosses 1 (interpolated in
    log n and log ratio). Pairs whose order never changes are listed with n None and the winner."""
    found = []
    for metric, (section, key, better) in SPEED_METRICS.items():
        curves = {name: _curve(points, key) for name, points in payload[section].items()}
        for a, b in itertools.combinations(sorted(curves), 2):
            ns = sorted(set(curves[a]) & set(curves[b]))
            if ns:
                found += _pair_crossovers(metric, a, b, curves, ns, better)
    return found


def _pair_crossovers(metric: str, a: str, b: str, curves: dict, ns: list[int], better: str) -> list[dict]:
    ratio = [math.log(curves[a][n] / curves[b][n]) for n in ns]  # > 0: a's value is larger
    sign = 1 if better == "higher" else -1
    winners = [a if sign * r > 0 else b for r in ratio]
    margins = [round(math.exp(abs(ratio[0])), 3), round(math.exp(abs(ratio[-1])), 3)]  # better / worse
    found = []
    for i in range(len(ns) - 1):
        r0, r1 = ratio[i], ratio[i + 1]
        if r0 * r1 < 0:
            t = r0 / (r0 - r1)
            at = math.exp(math.log(ns[i]) + t * (math.log(ns[i + 1]) - math.log(ns[i])))
            found.append(
                {
                    "metric": metric,
                    "families": [a, b],
                    "n": round(at),
                    "between": [ns[i], ns[i + 1]],
                    "before": winners[i],
                    "after": winners[i + 1],
                    "margins": margins,
                }
            )
    if found:
        return found
    return [
        {
            "metric": metric,
            "families": [a, b],
            "n": None,
            "between": [ns[0], ns[-1]],
            "before": winners[0],
            "after": winners[-1],
            "margins": margins,
        }
    ]


# ---- tables ----


def _spread(values: list[float], digits: int = 3) -> str:
    """mean (min-max) over seeds."""
    if not values:
        return "-"
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _at(points: list[dict], n: int, key: str):
    for p in points:
        if p["n"] == n:
            return p.get(key)
    return None


def headline_table(payload: dict) -> str:
    """One row per family: sizes, bits/byte, task accuracies, training and decoding speed."""
    tasks = list(payload["tasks"])
    ns = payload["config"]["decode_ns"]
    low, high = ns[0], ns[-1]
    header = ["family", "width", "parameters", "val bits/byte", *[f"{t} accuracy" for t in tasks]]
    header += [
        "train tokens/s",
        f"decode tokens/s n={low}",
        f"n={high}",
        f"state n={high}",
        f"peak RSS n={high}",
    ]
    rows = []
    for name, entry in payload["families"].items():
        corpus = payload["corpus"][name]["runs"]
        decode = payload["decode"][name]
        row = [
            f"**{name}**",
            f"{entry['corpus']['width']} / {entry['tasks']['width']}",
            f"{entry['corpus']['parameters'] / 1e3:.0f}k / {entry['tasks']['parameters'] / 1e3:.0f}k",
            _spread([r["val_bits_per_byte"] for r in corpus]),
            *[_spread([r["accuracy"] for r in payload["tasks"][t][name]["runs"]]) for t in tasks],
            _rate(_mean([r["train_tokens_per_s"] for r in corpus])),
            _rate(_at(decode, low, "decode_tokens_per_s")),
            _rate(_at(decode, high, "decode_tokens_per_s")),
            format_bytes(_at(decode, high, "state_bytes")),
            format_bytes(_at(decode, high, "peak_extra_bytes")),
        ]
        rows.append(row)
    return markdown_table(header, rows)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def distance_table(payload: dict, task: str) -> str:
    """Accuracy per octave of distance (mean over seeds, the range beside it)."""
    by_family = payload["tasks"][task]
    labels = sorted(
        {label for entry in by_family.values() for r in entry["runs"] for label in r["by_distance"]},
        key=lambda label: int(label.split("-")[0]),
    )
    rows = []
    for name, entry in by_family.items():
        cells = [
            _spread([r["by_distance"][label] for r in entry["runs"] if label in r["by_distance"]], 2)
            for label in labels
        ]
        rows.append([f"**{name}**", *cells])
    return markdown_table(["family", *[f"d {label}" for label in labels]], rows)


def speed_table(payload: dict) -> str:
    """Decoding tokens/s, state and peak RSS against n; training tokens/s against n."""
    ns = sorted(set(payload["config"]["decode_ns"]) | set(payload["config"]["train_ns"]))
    rows = []
    for name, points in payload["decode"].items():
        rate = [_rate(_at(points, n, "decode_tokens_per_s")) for n in ns]
        state = [format_bytes(_at(points, n, "state_bytes")) for n in ns]
        peak = [format_bytes(_at(points, n, "peak_extra_bytes")) for n in ns]
        prefill = [_seconds(_at(points, n, "prefill_s")) for n in ns]
        rows += [[f"**{name}**", "decode tokens/s", *rate], ["", "prefill s", *prefill]]
        rows += [["", "state", *state], ["", "peak RSS", *peak]]
    for name, points in payload["train_speed"].items():
        rows.append([f"**{name}**", "train tokens/s", *[_rate(_at(points, n, "tokens_per_s")) for n in ns]])
    return markdown_table(["family", "measure", *[f"n={n}" for n in ns]], rows)


def crossover_table(payload: dict) -> str:
    crossed = [c for c in payload["crossovers"] if c["n"] is not None]
    if not crossed:
        return "No crossover within the measured n: every pair kept its order on every measure."
    rows = [
        [
            c["metric"],
            " vs ".join(c["families"]),
            f"{c['n']:,}",
            f"{c['between'][0]}-{c['between'][1]}",
            c["before"],
            c["after"],
            " / ".join(f"{m:.2f}x" for m in c.get("margins", [])) or "-",
        ]
        for c in crossed
    ]
    header = ["measure", "families", "crossover n", "between", "better before", "better after"]
    return (
        markdown_table([*header, "margin at the first / last n"], rows)
        + "\n\nA margin within a few percent is within this machine's noise."
    )


def minutes_table(payload: dict) -> str:
    rows = []
    for name in payload["families"]:
        corpus = [r["minutes"] for r in payload["corpus"][name]["runs"]]
        tasks = [r["minutes"] for t in payload["tasks"] for r in payload["tasks"][t][name]["runs"]]
        rows.append([f"**{name}**", _spread(corpus, 2), _spread(tasks, 2)])
    return markdown_table(["family", "minutes per corpus run", "minutes per task run"], rows)


def settings(payload: dict) -> str:
    """One sentence: seeds, sizes, budgets, the machine and its load, the minutes."""
    c, minutes, load = payload["config"], payload["minutes"], payload["load_average"]
    machine = payload["machine"]
    return (
        f"{len(c['seeds'])} seeds ({', '.join(map(str, c['seeds']))}), mean (min-max); {c['layers']} layers; "
        f"corpus: {c['corpus_steps']} steps x {c['batch_size']} x {c['corpus_seq_len']} tokens "
        f"({c['tokenizer']} tokens); tasks: {c['task_steps']} steps x {c['batch_size']} x {c['task_seq_len']}. "
        f"Measured on {machine['cpu']} (threads: {machine['threads']}), torch {machine['torch']}, "
        f"load average {load['start'][0]:.1f} at the start, {load['end'][0]:.1f} at the end; "
        f"{minutes['total']:.1f} minutes in all ({minutes['training']:.1f} training, {minutes['speed']:.1f} speed)."
    )


def headline(payload: dict) -> str:
    """The study's settings and headline table (the start of docs/alternatives.md's section)."""
    return settings(payload) + "\n\n" + headline_table(payload)


def table(payload: dict) -> str:
    """The study's Markdown: settings, the headline table, accuracy against distance, speed and
    memory against n, the crossovers, minutes per run."""
    parts = [
        settings(payload),
        "Width and parameters: corpus / tasks (the vocabularies differ). Accuracy: on the answer tokens only.",
        headline_table(payload),
        *[
            f"Accuracy against distance d, {task}:\n\n" + distance_table(payload, task)
            for task in payload["tasks"]
        ],
        "Speed and memory against context n (random weights; decode after a prefill of n tokens; "
        "state: the session's tensors; peak RSS: what the whole decode added):\n\n" + speed_table(payload),
        "Crossovers:\n\n" + crossover_table(payload),
        "Minutes per run:\n\n" + minutes_table(payload),
    ]
    return "\n\n".join(parts)


# ---- the figure ----


def _log2_axis(axis) -> None:
    """A base-2 log axis labelled with plain integers (the measured n and octaves are powers of 2)."""
    from matplotlib.ticker import NullLocator, ScalarFormatter

    axis.axes.set_xscale("log", base=2)
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_locator(NullLocator())


def plot(payload: dict, path: Path) -> None:
    """Accuracy against distance per task; decode tokens/s, state bytes and training tokens/s
    against n; one line per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(payload["tasks"])
    fig, axes = plt.subplots(2, 3, figsize=(13, 7.5))
    for ax, task in zip(axes[0], tasks):
        for name, entry in payload["tasks"][task].items():
            labels = sorted(
                {k for r in entry["runs"] for k in r["by_distance"]}, key=lambda k: int(k.split("-")[0])
            )
            xs = [int(label.split("-")[0]) for label in labels]
            ys = [
                _mean([r["by_distance"][k] for r in entry["runs"] if k in r["by_distance"]]) for k in labels
            ]
            ax.plot(xs, ys, marker="o", label=name)
        ax.set(xlabel="distance d (tokens, octave start)", ylabel="accuracy", title=task, ylim=(-0.02, 1.02))
        _log2_axis(ax.xaxis)
        ax.grid(alpha=0.3)
    speed_panels = (
        ("decode", "decode_tokens_per_s", "decode tokens/s"),
        ("decode", "state_bytes", "decoding state (bytes)"),
        ("train_speed", "tokens_per_s", "training tokens/s (one sequence)"),
    )
    for ax, (section, key, title) in zip(axes[1], speed_panels):
        for name, points in payload[section].items():
            curve = _curve(points, key)
            ax.plot(list(curve), list(curve.values()), marker="o", label=name)
        ax.set(yscale="log", xlabel="context n (tokens)", title=title)
        _log2_axis(ax.xaxis)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("The alternatives at matched parameters (docs/alternatives.md)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
