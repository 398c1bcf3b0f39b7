"""bench serve's baseline without a server: the library itself on the same file, batch 1.

What a served token costs beyond the model's step is read against this: the same model loaded
as the servers load it (--quantize, --threads), in a fresh process of its own, answers the
one-client questions of the mixed workload one after the other with `model.stream` (greedy,
the tokenizer's stop tokens, each question's max_tokens), timed as the load client times a
server: time to first token, the gaps between tokens, output tokens/s over the run, and the
decode rate (the tokens after each answer's first over the time they took). Beside them, the
decode rate as `bench generate` measures it: 128 new tokens after the first question's prompt
(no stop token) less one, timed in turns, the best of three.

    python -m flashformer.bench.serve_library MODEL --jobs JOBS.json [--quantize MODE] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flashformer.bench.common import add_quantize_argument, quantize_flags
from flashformer.bench.serve_load import as_prompt, ask, summary

DECODE_TOKENS = 128  # bench generate's --new-tokens
LIBRARY = "flashformer library (batch 1, no server)"  # its name among serve.json's servers


def measure(model: str, jobs: list[tuple[str, int]], threads: int | None, quantize: str | None,
            completions: bool) -> dict:  # fmt: skip
    """The library's run (see the module docstring) in a fresh process: {"alone": summary, "decode_tokens_per_s"}."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "jobs.json"
        path.write_text(json.dumps(jobs), encoding="utf-8")
        command = [sys.executable, "-m", "flashformer.bench.serve_library", str(model), "--jobs", str(path)]
        command += ["--threads", str(threads)] if threads else []
        command += quantize_flags(quantize)
        command += ["--completions"] if completions else []
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(
            f"the library's run failed ({done.returncode}): {' '.join(done.stderr[-500:].split())}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run(args: argparse.Namespace) -> dict:
    import torch

    from flashformer.checkpoints.loading import load

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, quantize=args.quantize)
    stops = list(getattr(tokenizer, "stop_token_ids", []) or [])

    def prompt_of(question) -> list[int]:
        if args.completions:
            return tokenizer.encode(as_prompt(question))
        messages = ask(question) if isinstance(question, str) else question
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    jobs = [(prompt_of(question), limit) for question, limit in json.loads(Path(args.jobs).read_text())]

    def answer(ids: list[int], limit: int, eos: list[int]) -> list[float]:
        """The time each new token came, from the call on (greedy, as the servers are asked)."""
        started, times = time.perf_counter(), []
        for _ in model.stream(torch.tensor([ids]), max_new_tokens=limit, eos_token_id=eos):
            times.append(time.perf_counter() - started)
        return times

    answer(jobs[0][0], 4, [])  # warm, as the servers are warmed by one request
    ttfts, gaps, spans, tokens = [], [], [], 0
    started = time.perf_counter()
    for ids, limit in jobs:
        times = answer(ids, limit, stops)
        ttfts.append(times[0])
        gaps += [b - a for a, b in zip(times, times[1:])]
        spans.append((len(times), times[0], times[-1]))
        tokens += len(times)
    alone = summary(len(jobs), 1, 0, tokens, time.perf_counter() - started, ttfts, gaps, spans)
    # bench generate's decode rate: DECODE_TOKENS tokens less one, in turns, the best of three
    first = jobs[0][0]
    best = min(answer(first, DECODE_TOKENS, [])[-1] - answer(first, 1, [])[-1] for _ in range(3))
    return {"alone": alone, "decode_tokens_per_s": (DECODE_TOKENS - 1) / best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--jobs", required=True, help="a JSON list of [question, max_tokens]")
    parser.add_argument("--threads", type=int)
    add_quantize_argument(parser, "how the model is loaded (as `serve --quantize`)")
    parser.add_argument("--completions", action="store_true", help="the question as a plain prompt")
    print(json.dumps(_run(parser.parse_args())))


if __name__ == "__main__":
    main()
