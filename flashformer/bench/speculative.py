"""`flashformer bench generate --model FILE --prompt-lookup N [--draft MODEL]`: speculative decoding
where it pays and where it does not, beside llama.cpp's own programs on the same files and prompts.

Workloads (greedy, batch 1, `new_tokens` new tokens, no stop token): two that copy their input
(edit this code and give it back whole; quote this passage), two that do not (a poem; an
explanation). A chat
model gets each as a message through its template, a base model as text that invites the copy.
Each fresh process (`processes` of them) loads the model once and times, in turns, plain greedy
decoding and speculative decoding with up to N drafts (streamed): prompt lookup, or with --draft
a draft model (--draft-quantize: how it loads), and checks that both give the same tokens.
Decode tokens/s counts the tokens after the first: (n - 1) / (the seconds from the first token
to the last), the median of `rounds` after a warm-up round.
The best process is reported, with the range.

With --llama-cpp-dir DIR, llama.cpp's `llama-lookup` (or with --draft `llama-speculative -md
DRAFT`; DIR/bin/, built from the vendored tree: docs/benchmarks.md, "The peers") decodes the same
prompt text with --spec-draft-n-max N, greedy (--temp 0), --ignore-eos, the same threads, once per
process; its own "decoded ... speed" line is its tokens/s (llama-lookup: its n-gram cache of
sizes 1-4 over the context so far).
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch

from flashformer.bench.common import grouped_bars, quantize_flags, run_worker
from flashformer.checkpoints.loading import load_draft_model

CODE = """def parse_range(text):
    start, _, end = text.partition("-")
    first = int(start)
    last = int(end) if end else first
    if last < first:
        raise ValueError(f"range {text!r} runs backwards")
    return list(range(first, last + 1))


def merge_ranges(ranges):
    merged = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return merged


def format_ranges(ranges):
    parts = []
    for first, last in merge_ranges(ranges):
        parts.append(str(first) if first == last else f"{first}-{last}")
    return ",".join(parts)
"""

PASSAGE = (
    "The lighthouse on the northern cape was built in 1871 from granite quarried two miles inland. "
    "Its lamp burned colza oil until 1904, then paraffin, and from 1931 an electric bulb of 1,000 "
    "watts behind a rotating lens that threw a white flash every ten seconds.\n\n"
    "The keepers lived in two cottages at the foot of the tower. Supplies came by boat once a fortnight, "
    "weather allowing; in the winter of 1947 no boat came for seven weeks, and the keepers rationed "
    "flour, lamp oil and tobacco until the relief arrived on the first calm morning of March.\n\n"
    "The light was automated in 1989. The cottages now hold a small museum, open from May to September."
)

# name -> (copies its input, chat message, base-model text)
WORKLOADS = {
    "edit-code": (
        True,
        "Rename the function merge_ranges to join_ranges everywhere in this code and reply with the "
        "whole code, nothing else:\n\n" + CODE,
        "# ranges.py\n" + CODE + "\n\n# ranges.py, with merge_ranges renamed to join_ranges:\n",
    ),
    "quote": (
        True,
        "Quote the second paragraph of this text exactly, word for word:\n\n" + PASSAGE,
        PASSAGE + '\n\nThe second paragraph, quoted exactly:\n\n"',
    ),
    "poem": (
        False,
        "Write a long poem about the sea at night.",
        "A long poem about the sea at night\n\n",
    ),
    # small models' poems repeat their own lines within 128 tokens (the lookup then pays); prose
    # that explains does not
    "explain": (
        False,
        "Explain in detail how a refrigerator works.",
        "How a refrigerator works, explained in detail.\n\n",
    ),
}


def prompt_text(tokenizer, message: str, base_text: str) -> str:
    """The prompt as text (special tokens written out): the chat template's rendering of the
    message, or the base model's text."""
    if getattr(tokenizer, "chat_template", None) is None:
        return base_text
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )


def timing_worker(point: dict) -> dict:
    """One fresh process: every workload, plain and speculative decoding timed in turns."""
    import flashformer

    if point["threads"]:
        torch.set_num_threads(point["threads"])
    model, tokenizer = flashformer.load(point["model"], quantize=point["quantize"])
    n, lookup = point["new_tokens"], point["prompt_lookup"]
    if point.get("draft"):
        draft = load_draft_model(point["draft"], point.get("draft_quantize"))
        speculation = dict(assistant_model=draft, num_assistant_tokens=lookup)
    else:  # a lookup of the table (generate.proposers): ngram unless told
        speculation = dict(prompt_lookup_num_tokens=lookup, speculative_method=point.get("method"))
    found = {}
    for name, (_, message, base_text) in WORKLOADS.items():
        ids = torch.tensor([tokenizer.encode(prompt_text(tokenizer, message, base_text))])
        contenders = {"plain": {}, "speculative": speculation}
        seconds = {label: [] for label in contenders}
        outputs = {}
        for round_index in range(point["rounds"] + 1):  # round 0 warms up
            order = list(contenders)[round_index % 2 :] + list(contenders)[: round_index % 2]
            for label in order:
                tokens, decode = decode_seconds(model, ids, n, contenders[label])
                outputs[label] = tokens
                if round_index:
                    seconds[label].append(decode)
        plain, speculative = (statistics.median(seconds[label]) for label in contenders)
        found[name] = {
            "prompt_tokens": ids.shape[1],
            "plain_tokens_per_s": (n - 1) / plain,
            "speculative_tokens_per_s": (n - 1) / speculative,
            "same_tokens": outputs["plain"] == outputs["speculative"],
            **acceptance(model, ids, n, speculation),
            "text": tokenizer.decode(outputs["plain"])[:400],
        }
    return {"workloads": found}


def decode_seconds(model, ids: torch.Tensor, n: int, extra: dict) -> tuple[list[int], float]:
    """n greedy tokens streamed (no stop token): the tokens, and the seconds from the first token
    (the prompt's prefill and the first choice done) to the last."""
    tokens, first = [], None
    for step in model.stream(ids, max_new_tokens=n, eos_token_id=[], **extra):
        tokens.append(int(step[0]))
        if first is None:
            first = time.perf_counter()
    return tokens, time.perf_counter() - first


def acceptance(model, ids: torch.Tensor, n: int, speculation: dict) -> dict:
    """How many drafts a speculative run proposed and kept, and its verify forwards."""
    from flashformer.generate import speculative
    from flashformer.generate.sampling import settings_from
    from flashformer.generate.session import DecoderSession

    s = settings_from(model, max_new_tokens=n, eos_token_id=[], **speculation)
    counters = speculative.Counters()
    for _ in speculative.speculative_tokens(
        DecoderSession(model, ids, None, s), s, None, None, counters=counters
    ):
        pass
    return {"forwards": counters.forwards, "drafted": counters.drafted, "accepted": counters.accepted}


# ---- llama.cpp's lookup and speculative programs ----


def llama_speculative(
    binary: Path, model: str, text: str, n: int, drafts: int, threads: int, draft: str | None = None
) -> dict:
    """llama-lookup (or with a draft, llama-speculative -md DRAFT) on the prompt text: its decode
    tokens/s and acceptance, as it prints them."""
    command = [str(binary), "-m", model, "-p", text, "-n", str(n), "--spec-draft-n-max", str(drafts), "-t", str(threads),
               "-tb", str(threads), "--temp", "0", "--ignore-eos", "-c", "4096"]  # fmt: skip
    if draft is not None:
        command += ["-md", draft]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    speed = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", log)
    if done.returncode != 0 or speed is None:
        return {"error": f"exit code {done.returncode}: {log.strip().splitlines()[-1:]}"}
    encoded = re.search(r"encoded\s+(\d+) tokens", log)
    accepted = re.search(r"n_accept\s+=\s+(\d+)", log)
    drafted = re.search(r"n_drafted\s+=\s+(\d+)", log)
    return {
        "tokens_per_s": float(speed.group(3)),
        "decoded": int(speed.group(1)),
        "prompt_tokens": int(encoded.group(1)) if encoded else None,
        "drafted": int(drafted.group(1)) if drafted else None,
        "accepted": int(accepted.group(1)) if accepted else None,
    }


def peer_binary(folder: str, draft: bool) -> Path:
    """DIR/bin/llama-lookup (llama-speculative with a draft), or DIR/ itself, checked."""
    from flashformer.bench.llama_cpp_binaries import executable

    name = "llama-speculative" if draft else "llama-lookup"
    folder_path = Path(folder).expanduser()
    inside = folder_path / "bin" / name
    return executable(inside if inside.exists() else folder_path / name, "--llama-cpp-dir")


# ---- served ----


def serve_run(model: str, config: dict, threads: int) -> dict:
    """`flashformer serve` on the model without and with --speculative-config (ngram, or the
    draft model; on at every batch size: where it stops paying is what this measures), the copying
    workloads asked by each of config["serve_clients"] clients in flight (greedy, max_tokens
    new_tokens, 3 requests a client and at least 6). Each contender runs in config["processes"] fresh servers, in
    turns; each server answers one short request of another prompt first (its first request pays
    for allocations that later ones reuse), then the passes. Returns clients -> {"plain",
    "speculative"}: each the pass of most output tokens/s (serve_load.drive's summary) with
    "runs_tokens_per_s", every server's."""
    import asyncio
    import sys

    import flashformer
    from flashformer.bench.serve_load import drive
    from flashformer.bench.serve_peers import free_port, start

    tokenizer = flashformer.load_tokenizer(model)
    chat = getattr(tokenizer, "chat_template", None) is not None
    copying = [(message if chat else base) for copies, message, base in WORKLOADS.values() if copies]
    warm_up = [((WORKLOADS["poem"][1] if chat else WORKLOADS["poem"][2]), 8)]
    method = {"method": config.get("method") or "ngram"}
    if config.get("draft"):
        method = {
            "method": "draft_model",
            "model": config["draft"],
            "quantization": config.get("draft_quantize"),
        }
    speculative = json.dumps(
        {**method, "num_speculative_tokens": config["prompt_lookup"], "disable_by_batch_size": 64}
    )
    passes: dict[int, dict[str, list[dict]]] = {}
    for _ in range(config["processes"]):
        for label, extra in (("plain", []), ("speculative", ["--speculative-config", speculative])):
            port = free_port()
            command = [sys.executable, "-m", "flashformer.cli", "serve", model, "--port", str(port), "--api-key",
                       "bench", "--threads", str(threads), "--max-batch", "16", *extra]  # fmt: skip
            command += quantize_flags(config["quantize"])
            url = f"http://127.0.0.1:{port}"
            process = start(command, url + "/health")
            try:
                from openai import OpenAI

                served = OpenAI(base_url=url + "/v1", api_key="bench").models.list().data[0].id
                asyncio.run(drive(url + "/v1", served, warm_up, 1, "bench", completions=not chat))
                for clients in config["serve_clients"]:
                    requests = max(3 * clients, 6)  # each copying workload alike often, and enough of them
                    jobs = [(copying[i % len(copying)], config["new_tokens"]) for i in range(requests)]
                    result = asyncio.run(
                        drive(url + "/v1", served, jobs, clients, "bench", completions=not chat)
                    )
                    passes.setdefault(clients, {}).setdefault(label, []).append(result)
            finally:
                process.terminate()
                process.wait(timeout=60)
    found: dict[int, dict] = {}
    for clients, by_label in passes.items():
        for label, results in by_label.items():
            best = max(results, key=lambda r: r["output_tokens_per_s"] or 0.0)
            runs = [r["output_tokens_per_s"] for r in results]
            found.setdefault(clients, {})[label] = {**best, "runs_tokens_per_s": runs}
    return found


# ---- the benchmark ----


def run(model: str, config: dict, out_dir: Path, threads: int | None, timeout_s: float) -> dict:
    """config: new_tokens, rounds, processes, quantize, prompt_lookup, draft and draft_quantize (or
    None: prompt lookup), llama_cpp_dir (or None), serve_clients."""
    import flashformer
    from flashformer.files import write_json
    from flashformer.kernels.machine import machine_info

    draft = str(Path(config["draft"]).resolve()) if config.get("draft") else None
    binary = peer_binary(config["llama_cpp_dir"], draft is not None) if config.get("llama_cpp_dir") else None
    point = {
        "model": str(Path(model).resolve()),
        "new_tokens": config["new_tokens"],
        "rounds": config["rounds"],
        "threads": threads,
        "quantize": config["quantize"],
        "prompt_lookup": config["prompt_lookup"],
        "draft": draft,
        "draft_quantize": config.get("draft_quantize"),
        "method": config.get("method"),
    }
    bench_threads = threads or torch.get_num_threads()
    tokenizer = flashformer.load_tokenizer(point["model"])
    texts = {name: prompt_text(tokenizer, message, base) for name, (_, message, base) in WORKLOADS.items()}
    processes, peers = [], []
    for _ in range(config["processes"]):
        started = time.perf_counter()
        processes.append(run_worker("flashformer.bench.speculative", point, timeout_s, memory=False))
        processes[-1]["seconds"] = time.perf_counter() - started
        if binary is not None:
            peers.append(
                {
                    name: llama_speculative(
                        binary,
                        point["model"],
                        text,
                        point["new_tokens"],
                        point["prompt_lookup"],
                        bench_threads,
                        draft,
                    )
                    for name, text in texts.items()
                }
            )
    served = serve_run(point["model"], config, bench_threads) if config.get("serve_clients") else {}
    payload = {
        "benchmark": "speculative",
        "machine": machine_info(),
        "config": {**config, "threads": bench_threads},
        "point": point,
        "processes": processes,
        "peer_runs": peers,
        "summary": summarize(processes, peers),
        "served": {
            str(clients): {**runs, "speculative / plain": _served_ratio(runs)}
            for clients, runs in served.items()
        },
    }
    stem = f"speculative-{Path(model).stem.split('.')[0].lower()}" + ("-draft" if draft else "")
    stem += f"-{config['method']}" if config.get("method") not in (None, "ngram", "draft_model") else ""
    write_json(out_dir / f"{stem}.json", payload)
    plot(payload, out_dir / f"{stem}.png")
    return payload


def summarize(processes: list[dict], peers: list[dict]) -> dict:
    """Per workload: the best and the range of each contender over the processes, and the ratios
    of the bests (speculative / plain, speculative / peer: llama.cpp's program)."""
    good = [p for p in processes if "error" not in p]
    found = {}
    for name, (copies, _, _) in WORKLOADS.items():
        rows = [p["workloads"][name] for p in good]
        if not rows:
            continue
        entry = {"copies": copies, "same_tokens": all(r["same_tokens"] for r in rows)}
        for key in ("plain_tokens_per_s", "speculative_tokens_per_s"):
            values = [r[key] for r in rows]
            entry[key] = {"best": max(values), "min": min(values)}
        entry["speculative / plain"] = (
            entry["speculative_tokens_per_s"]["best"] / entry["plain_tokens_per_s"]["best"]
        )
        entry["accepted / drafted"] = [r["accepted"] / max(1, r["drafted"]) for r in rows]
        theirs = [p[name]["tokens_per_s"] for p in peers if "error" not in p.get(name, {"error": 1})]
        if theirs:
            entry["peer_tokens_per_s"] = {"best": max(theirs), "min": min(theirs)}
            entry["speculative / peer"] = entry["speculative_tokens_per_s"]["best"] / max(theirs)
        found[name] = entry
    return found


def _served_ratio(runs: dict) -> float | None:
    plain, spec = runs.get("plain", {}), runs.get("speculative", {})
    if not plain.get("output_tokens_per_s") or "output_tokens_per_s" not in spec:
        return None
    return spec["output_tokens_per_s"] / plain["output_tokens_per_s"]


def served_table(payload: dict) -> str:
    lines = [
        "| clients | plain tok/s | speculative tok/s | ratio | ITL p50 plain / speculative (ms) |",
        "|---|---|---|---|---|",
    ]
    for clients, runs in payload.get("served", {}).items():
        plain, spec = runs["plain"], runs["speculative"]
        ratio = runs["speculative / plain"]
        lines.append(
            f"| {clients} | {_served_rate(plain)} | {_served_rate(spec)} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} | "
            f"{1e3 * (plain['itl_p50_s'] or 0):.1f} / {1e3 * (spec['itl_p50_s'] or 0):.1f} |"
        )
    return "\n".join(lines)


def _served_rate(run: dict) -> str:
    """A contender's output tokens/s: the best pass, with the range over its servers when it ran in
    several (runs before 6 December 2026 ran one)."""
    runs = run.get("runs_tokens_per_s")
    best = run["output_tokens_per_s"]
    return f"{best:.1f} ({min(runs):.1f}-{best:.1f})" if runs and len(runs) > 1 else f"{best:.1f}"


def method(payload: dict) -> tuple[str, str]:
    """(our speculation, llama.cpp's program) of a run: prompt lookup or a draft model."""
    draft = payload["point"].get("draft")
    if draft:
        return f"draft {Path(draft).name}", "llama-speculative"
    lookup = payload["point"].get("method") or "ngram"
    return ("prompt lookup" if lookup == "ngram" else f"{lookup} lookup"), "llama-lookup"


def table(payload: dict) -> str:
    ours, theirs = method(payload)
    lines = [
        f"| workload | copies | plain tok/s | {ours} tok/s | ratio | {theirs} tok/s | ours / theirs | same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [_row(name, e) for name, e in payload["summary"].items()]
    return "\n".join(lines)


def _row(name: str, e: dict) -> str:
    peer = e.get("peer_tokens_per_s")
    theirs = f"{_span(peer)} | {e['speculative / peer']:.2f}x" if peer else "- | -"
    return (
        f"| {name} | {'yes' if e['copies'] else 'no'} | {_span(e['plain_tokens_per_s'])} | "
        f"{_span(e['speculative_tokens_per_s'])} | {e['speculative / plain']:.2f}x | {theirs} | "
        f"{'yes' if e['same_tokens'] else 'NO'} |"
    )


def _span(values: dict) -> str:
    return f"{values['best']:.1f} ({values['min']:.1f}-{values['best']:.1f})"


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = payload["summary"]
    names = list(summary)
    ours, theirs = method(payload)
    series = {
        "plain": [summary[n]["plain_tokens_per_s"]["best"] for n in names],
        ours: [summary[n]["speculative_tokens_per_s"]["best"] for n in names],
    }
    if all("peer_tokens_per_s" in summary[n] for n in names):
        series[theirs] = [summary[n]["peer_tokens_per_s"]["best"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    grouped_bars(ax, names, series)
    ax.set_ylabel("decode tokens/s (best process)")
    ax.set_title(
        f"{Path(payload['point']['model']).name}: {ours}, up to {payload['point']['prompt_lookup']} drafts"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 3 and sys.argv[1] == "--worker":  # run_worker's call
        print(json.dumps(timing_worker(json.loads(sys.argv[2]))))
