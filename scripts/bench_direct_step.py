"""What dynamo's guards cost a compiled decode step, and what the direct call saves
(flashformer.generate.direct_step): one process, one model, generate(compile=True) with the
direct call and without it (DirectStep.ATTEMPTS = 0) taken in turns, batch 1, greedy.

    PYTHONPATH=. python scripts/bench_direct_step.py FILE [--rounds 6] [--threads 2]

A decode step's time is (136 new tokens - 8 new tokens) / 128, so the prompt and the first
steps (which go through dynamo either way) cancel. Prints the guards of the compiled step's
graph, both variants' steps (best, median, range) and whether their tokens are the same.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashformer
from flashformer.generate import session
from flashformer.generate.direct_step import DirectStep, _entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = flashformer.load(args.model, quantize="gguf")
    ids = torch.tensor([tokenizer.encode("Once upon a time, in a lighthouse by the sea,")])

    def generate(n: int, attempts: int) -> tuple[float, list[int]]:
        DirectStep.ATTEMPTS = attempts
        started = time.perf_counter()
        out = model.generate(ids, max_new_tokens=n, eos_token_id=[], compile=True)
        return time.perf_counter() - started, out[0].tolist()

    variants = {"dynamo's guards every step": 0, "direct after 2 steps": DirectStep.ATTEMPTS}
    tokens = {name: generate(136, attempts)[1] for name, attempts in variants.items()}  # compiles
    steps = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, attempts in variants.items():
            short, _ = generate(8, attempts)
            long, _ = generate(136, attempts)
            steps[name].append((long - short) / 128 * 1e3)
    graphs = _entries(session.decode_step)
    guards = sum(len(str(entry.guard_manager).splitlines()) for entry in graphs)
    print(f"{args.model}: {len(graphs)} graphs, {guards} guard lines")
    print("| variant | ms per step, best | median | range |\n|---|---|---|---|")
    for name, values in steps.items():
        print(
            f"| {name} | {min(values):.2f} | {statistics.median(values):.2f} | {min(values):.2f}-{max(values):.2f} |"
        )
    names = list(variants)
    print(
        f"best / best: {min(steps[names[0]]) / min(steps[names[1]]):.3f}x; same tokens: "
        f"{tokens[names[0]] == tokens[names[1]]}"
    )


if __name__ == "__main__":
    main()
