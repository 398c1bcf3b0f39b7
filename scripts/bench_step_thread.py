"""What the thread that runs the serving engine's step costs it (serve/loop.py, cli/serve.py).

    PYTHONPATH=. python scripts/bench_step_thread.py FILE [--rounds 2] [--threads 2]

Builds the engine as `flashformer serve FILE --quantize gguf --kv-blocks 1024` does (the native
decoder, on this, the main thread), then runs one greedy 128-token request by stepping the
engine by hand, timing each step, in three ways taken in turns:
- on the main thread, which loaded the model (what `flashformer serve` does);
- on a thread of its own (what it did before: ModelLoop.start);
- on the main thread while another live thread holds an OpenMP pool (it ran one parallel
  region and waits), which is what the thread of its own amounts to.
Prints each way's median and best step (the first 2 steps left out) and the tokens' equality.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from flashformer.checkpoints.loading import load
from flashformer.serve.engine import Engine
from flashformer.serve.request import Request, SamplingParams


def one_request(engine: Engine, ids: list[int]) -> tuple[list[float], str]:
    """Step the engine by hand through one greedy request: (ms of each step, its text)."""
    events = []
    engine.submit(Request(ids, SamplingParams(max_tokens=128, temperature=0), 1, events.append))
    engine._accept(engine._inbox.get_nowait())
    steps = []
    while engine._has_work():
        started = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - started) * 1e3)
    return steps[2:], "".join(e.text for e in events if e.kind == "delta")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, quantize="gguf")
    engine = Engine(model, tokenizer, max_batch=16, num_blocks=1024)
    ids = tokenizer.encode("Write a long story about a lighthouse keeper.")

    def on_own_thread() -> tuple[list[float], str]:
        result = []
        worker = threading.Thread(target=lambda: result.append(one_request(engine, ids)))
        worker.start()
        worker.join()
        return result[0]

    def beside_a_pool() -> tuple[list[float], str]:
        release, ready = threading.Event(), threading.Event()

        def hold_a_pool() -> None:
            (torch.randn(4_000_000) * 2).sum()  # a parallel region: this thread's pool of workers
            ready.set()
            release.wait()

        holder = threading.Thread(target=hold_a_pool)
        holder.start()
        ready.wait()
        try:
            return one_request(engine, ids)
        finally:
            release.set()
            holder.join()

    ways = {
        "main thread (the one that warmed the model)": lambda: one_request(engine, ids),
        "a thread of its own": on_own_thread,
        "main thread, another live thread holding a pool": beside_a_pool,
    }
    steps = {name: [] for name in ways}
    texts = {}
    for _ in range(args.rounds):
        for name, way in ways.items():
            ms, texts[name] = way()
            steps[name] += ms
    print("| where the step runs | median ms | best ms |\n|---|---|---|")
    for name, values in steps.items():
        print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} |")
    print(f"same text every way: {len(set(texts.values())) == 1}")


if __name__ == "__main__":
    main()
