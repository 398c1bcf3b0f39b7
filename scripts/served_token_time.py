"""Where a served token's time goes, in one process: the library's batch-1 decode (generate())
against the serving Engine's steps (no HTTP), in turns, each token split into the native
decoder's call and the rest (docs/benchmarks.md, "Where a served token's time goes").

    PYTHONPATH=. python scripts/served_token_time.py MODEL [--rounds 3] [--tokens 128] [--threads 2]

The same prompt (a question in the chat template, or as text for a base model), greedy, no stop
token, each way `--rounds` times in turns after one warm-up each. Per way and round: the wall time
per token of the tokens after the first, the median native call of a decode step, and the time
per token outside the native calls (the Python between two steps: sampling, detokenizing, the
step's bookkeeping). Prints the median and the range over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashformer
from flashformer.kernels.native_decoder import NativeDecoder
from flashformer.serve.engine import Engine
from flashformer.serve.request import Request, SamplingParams

QUESTION = "Summarize: the quick brown fox jumps over the lazy dog, three times over."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = flashformer.load(args.model, quantize="gguf")
    if tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTION}], add_generation_prompt=True
        )
    else:
        prompt = tokenizer.encode(QUESTION)
    calls: list[float] = []
    native_forward = NativeDecoder.forward

    def timed_forward(self, batch, cache):
        started = time.perf_counter()
        logits = native_forward(self, batch, cache)
        calls.append(time.perf_counter() - started)
        return logits

    NativeDecoder.forward = timed_forward
    engine = Engine(model, tokenizer, max_batch=16, num_blocks=1024)

    def library() -> float:
        started = time.perf_counter()
        model.generate(torch.tensor([prompt]), max_new_tokens=args.tokens, eos_token_id=[])
        return time.perf_counter() - started

    def served() -> float:
        request = Request(
            prompt, SamplingParams(max_tokens=args.tokens, temperature=0.0), 1, lambda event: None
        )
        engine.submit(request)
        started = time.perf_counter()
        while engine._inbox.qsize():  # as the engine's loop takes it in
            engine._accept(engine._inbox.get_nowait())
        while not request.finished:
            engine.step()
        return time.perf_counter() - started

    ways = {"generate()": library, "the engine": served}
    found = {name: [] for name in ways}
    for way in ways.values():  # warm-up
        way()
    for _ in range(args.rounds):
        for name, way in ways.items():
            calls.clear()
            wall = way()
            steps = calls[1:]  # the first call is the prompt's
            found[name].append(
                (wall / args.tokens, statistics.median(steps), (wall - sum(calls)) / args.tokens)
            )
    print(f"{args.model}: {args.tokens} tokens, {args.threads} threads, {args.rounds} rounds in turns")
    print("| way | per token, ms | native call of a step, ms | outside the native calls, ms a token |")
    print("|---|---|---|---|")
    for name, rows in found.items():
        cells = [_median_range([row[i] for row in rows]) for i in range(3)]
        print(f"| {name} | " + " | ".join(cells) + " |")


def _median_range(values: list[float]) -> str:
    ms = sorted(1e3 * value for value in values)
    return f"{statistics.median(ms):.2f} ({ms[0]:.2f}-{ms[-1]:.2f})"


if __name__ == "__main__":
    main()
