"""bench serve's report: its tables (the servers, ours against theirs, the drills, the
workloads), the one-client decode lines and its figure, read from serve.json's payload.

Kept beside serve.py (which runs the servers and states the targets) so that scripts/docs.py
and the tests read a payload without the machinery that measured it.
"""

from __future__ import annotations

from pathlib import Path

from flashformer.bench.serve_library import LIBRARY
from flashformer.formatting import markdown_table


def decode_lines(payload: dict) -> str:
    """The one-client decode rates (and the library's run), for runs that measured them ("" for
    older ones)."""
    servers = payload["servers"]
    rates = [
        f"{RENAMED.get(name, name)} {result['alone']['decode_tokens_per_s']:.1f}"
        for name, result in servers.items()
        if "loaded" in result and result["alone"].get("decode_tokens_per_s") is not None
    ]
    lines = []
    library = servers.get(LIBRARY, {})
    if "error" in library:
        lines.append(f"{LIBRARY}: not measured: {' '.join(library['error'].split())[:80]}")
    elif "alone" in library:
        alone, ms = library["alone"], lambda value: f"{1e3 * value:.0f}"
        lines.append(
            f"{LIBRARY}, the same one-client questions in a fresh process: {alone['output_tokens_per_s']:.1f} "
            f"output tokens/s, TTFT p50 {ms(alone['ttft_p50_s'])} ms, ITL p50 / p99 {ms(alone['itl_p50_s'])} / "
            f"{ms(alone['itl_p99_s'])} ms, decode {alone['decode_tokens_per_s']:.1f} tokens/s; its batch-1 "
            f"decode as bench generate measures it: {library['decode_tokens_per_s']:.1f} tokens/s"
        )
    if rates:
        lines.append(
            "1 client: decode tokens/s (the tokens after each answer's first over their time): "
            + ", ".join(rates)
        )
    return "".join("\n\n" + line for line in lines)


# names of older runs' servers, as the table gives them today
RENAMED = {"llama.cpp (llama-cpp-python server)": "llama-cpp-python server (unbatched)"}


def table(payload: dict) -> str:
    def ms(value):
        return "-" if value is None else f"{1e3 * value:.0f}"

    rows = []
    for name, result in payload["servers"].items():
        if "error" not in result and "loaded" not in result:
            continue
        if "error" in result:
            rows.append([name, f"not measured: {' '.join(result['error'].split())[:80]}"] + ["-"] * 7)
            continue
        loaded = result["loaded"]
        rows.append(
            [
                RENAMED.get(name, name),
                f"{loaded['output_tokens_per_s']:.1f}",
                ms(loaded["ttft_p50_s"]),
                ms(loaded["ttft_p99_s"]),
                ms(loaded["itl_p50_s"]),
                ms(loaded["itl_p99_s"]),
                f"{result['alone']['output_tokens_per_s']:.1f}",
                f"{ms(result['alone']['ttft_p50_s'])} / {ms(result['alone']['itl_p50_s'])} / "
                f"{ms(result['alone']['itl_p99_s'])}",
                f"{result['start_s']:.0f}" if "start_s" in result else "-",
            ]
        )
    config = payload["config"]
    if not rows:
        return (
            workload_table(payload).lstrip("\n")
            + drills(payload)
            + (
                "\n\n" + "; ".join(f"{name}: {value:.2f}" for name, value in payload["targets"].items())
                if payload["targets"]
                else ""
            )
        )
    header = [
        "server",
        "output tokens/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "1 client: tokens/s",
        "1 client: TTFT / ITL p50 / p99 ms",
        "ready after s",
    ]
    kind = "completion" if config.get("api") == "completions" else "chat"  # no chat template: completions
    text = (
        f"{Path(payload['model']).name}; {config['requests']} streamed {kind} requests, {config['clients']} clients "
        f"in flight, up to {config['max_tokens']} output tokens each, greedy"
        + (f"; flashformer's weights quantized ({config['quantize']})" if config.get("quantize") else "")
        + (f", its kernels' path {config['kernel_isa']}" if config.get("kernel_isa") else "")
        + (f"; {config['threads']} threads a server" if config.get("threads") else "")
        + (f"; load average {_load(config)}" if "load_average_before" in config else "")
        + ".\n\n"
        + markdown_table(header, rows)
    )
    text += decode_lines(payload) + workload_table(payload) + drills(payload)
    if payload["targets"]:
        text += "\n\n" + "; ".join(f"{name}: {value:.2f}" for name, value in payload["targets"].items())
    return text


def ours_and_theirs(payload: dict) -> tuple[dict, dict]:
    """The batching flashformer server's run and llama-server's, as `loaded` measured them."""
    servers = payload["servers"]
    ours = next(r for name, r in servers.items() if name.startswith("flashformer (max batch"))
    theirs = next(r for name, r in servers.items() if name.startswith("llama-server"))
    return ours["loaded"], theirs["loaded"]


def versus_table(rows: list[tuple[str, dict, dict]]) -> str:
    """flashformer's server against llama-server: (label, the one-client run's payload, the
    16-client run's), one line each; tokens/s ours / theirs, latencies ours / theirs."""

    def ms(a: dict, b: dict, key: str) -> str:
        return f"{1e3 * a[key]:.0f} / {1e3 * b[key]:.0f}"

    def rate(a: dict, b: dict) -> str:
        ours, theirs = a["output_tokens_per_s"], b["output_tokens_per_s"]
        return f"{ours:.1f} / {theirs:.1f} (**{ours / theirs:.2f}x**)"

    lines = []
    for label, one_client, many_clients in rows:
        one, many = ours_and_theirs(one_client), ours_and_theirs(many_clients)
        lines.append(
            [
                label,
                rate(*one),
                ms(*one, "itl_p99_s"),
                rate(*many),
                ms(*many, "ttft_p50_s"),
                ms(*many, "itl_p99_s"),
            ]
        )
    clients = ours_and_theirs(rows[0][2])[0]["clients"] if rows else 16
    header = [
        "file, path",
        "1 client: tokens/s ours / theirs",
        "ITL p99 ms",
        f"{clients} clients: tokens/s",
        "TTFT p50 ms",
        "ITL p99 ms",
    ]
    return markdown_table(header, lines)


def drills(payload: dict) -> str:
    """The kill drills (bench/serve_replicas.py) as sentences ("" if none ran)."""
    found = []
    for name, result in payload["servers"].items():
        drill = result.get("kill_drill")
        if drill is None:
            continue
        back = drill["replicas_back_s"]
        first = drill["first_answer_after_kill_s"]
        found.append(
            f"{name}, one replica killed {drill['killed_after_s']:.0f} s into {drill['requests']} requests "
            f"({drill['clients']} in flight): {drill['answered']} answered, {drill['errored']} ended with an "
            f"error, {drill['hung']} hung; a request started after the kill answered "
            + ("never" if first is None else f"{first:.1f} s after it")
            + "; the replicas were back "
            + ("never (300 s)" if back is None else f"after {back:.1f} s")
            + "."
        )
    return "".join("\n\n" + line for line in found)


def workload_table(payload: dict) -> str:
    """The shared-prefix and multi-turn workloads, the prefix cache on and off ("" if not run)."""

    def ms(value):
        return "-" if value is None else f"{1e3 * value:.0f}"

    rows = []
    for name, result in payload["servers"].items():
        for key, label in (("shared_prefix", "shared prefix"), ("multi_turn", "multi-turn")):
            measured = result.get(key)
            if measured is None:
                continue
            loaded = measured.get("loaded", measured)
            by_turn = measured["alone"]["ttft_p50_by_turn_s"] if key == "multi_turn" else []
            rate = loaded.get("prefix_hit_rate")
            rows.append([label, name, f"{loaded['output_tokens_per_s']:.1f}", ms(loaded["ttft_p50_s"]),
                         ms(loaded["ttft_p99_s"]), ms(loaded["itl_p50_s"]), ms(loaded["itl_p99_s"]),
                         " / ".join(ms(t) for t in by_turn) or "-",
                         "-" if rate is None else f"{100 * rate:.1f} %"])  # fmt: skip
    if not rows:
        return ""
    config = payload["config"]
    header = ["workload", "server", "output tokens/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
              "ITL p99 ms", "one chat: TTFT by turn ms", "prefix-cache hit rate"]  # fmt: skip
    return (
        f"\n\nshared prefix: {config['requests']} requests after one {config['system_tokens']}-token system "
        f"prompt, {config['clients']} clients; multi-turn: {config['chats']} chats of {config['turns']} turns "
        f"in flight, a {config['history_tokens']}-token first message, {config['turn_tokens']} tokens a turn; "
        f"load average {_load(config)}.\n\n" + markdown_table(header, rows)
    )


def _load(config: dict) -> str:
    """The 1-minute load average at the run's start and end (the end alone in older runs)."""
    after = f"{config['load_average'][0]:.1f}"
    return f"{config['load_average_before'][0]:.1f} -> {after}" if "load_average_before" in config else after


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = {name: r for name, r in payload["servers"].items() if "loaded" in r}
    if not measured:  # only the shared-prefix and multi-turn workloads ran: one bar each
        for name, result in payload["servers"].items():
            for key, label in (("shared_prefix", "shared prefix"), ("multi_turn", "multi-turn")):
                if key in result:
                    measured[f"{label}: {name}"] = {"loaded": result[key].get("loaded", result[key])}
    wide = max((len(name) for name in measured), default=0) > 40
    fig, (rate, latency) = plt.subplots(
        1, 2, figsize=(15 if wide else 11, max(3.8, 0.45 * len(measured) + 1.5)), sharey=wide
    )
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
