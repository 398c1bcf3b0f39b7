"""What a JSON schema costs the server's decoding: decode tokens/s of N sequences in flight,
free against constrained, in the engine itself (no HTTP), and the compile + first mask time of
the structured-output suite's median schema.

    python scripts/structured_overhead.py MODEL [--quantize gguf] [--clients 1 16] [--repeats 3]

Every point runs in a fresh process, free and constrained in turns. Both run exactly
--max-tokens tokens per sequence: free sequences have no stop token, constrained ones follow a
schema whose required string is longer than that (so the grammar cannot end first), so the
batch holds the same rows for the same steps and only the masks differ. Only decode steps are
timed (from the step after every sequence has its first token). Prints one JSON line per run
and a summary with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# a schema whose required string is longer than any run: the grammar cannot end first (also
# `bench serve --json-schema scripts/schemas/long-summary.json`)
LONG = json.loads((ROOT / "scripts" / "schemas" / "long-summary.json").read_text(encoding="utf-8"))


def one_run(model_path: str, quantize: str | None, clients: int, max_tokens: int, constrained: bool) -> dict:
    import torch

    import flashformer
    from flashformer.generate.constraints import Constraint
    from flashformer.serve.engine import Engine
    from flashformer.serve.request import Request, SamplingParams

    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    model, tokenizer = flashformer.load(model_path, quantize=quantize)
    constraint = Constraint.json_schema(LONG, tokenizer, model.config.vocab_size) if constrained else None
    engine = Engine(model, tokenizer, max_batch=max(clients, 1), num_blocks=64 * clients + 64)
    requests = []
    for i in range(clients):
        messages = [{"role": "user", "content": f"Describe item number {i} of a museum catalogue as JSON."}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, constraint=constraint)
        request = Request(prompt, params, 1, lambda event: None)
        engine.submit(request)
        requests.append(request)
    while engine._inbox.qsize():
        engine.waiting.extend(engine._inbox.get().sequences)
    sequences = [r.sequences[0] for r in requests]
    while not all(s.generated for s in sequences):
        engine.step()
    counted, started = sum(len(s.generated) for s in sequences), time.perf_counter()
    while not all(r.finished for r in requests):
        engine.step()
    wall = time.perf_counter() - started
    tokens = sum(len(s.generated) for s in sequences) - counted
    reasons = sorted({s.finish_reason for s in sequences})
    return {"clients": clients, "constrained": constrained, "decode_tokens": tokens, "decode_s": wall,
            "tokens_per_s": tokens / wall, "finish_reasons": reasons}  # fmt: skip


def compile_time(model_path: str) -> dict:
    """Compile + first mask of the suite's median-size schema (tests/helpers/schemas.py), with
    the vocabulary already described (the server does that at start), best of 5 fresh specs."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.schemas import schema_suite

    import flashformer
    from flashformer.generate.constraints import Constraint, ConstraintSpec, GrammarVocabulary

    _, tokenizer = flashformer.load(model_path)
    suite = schema_suite(100)
    median = sorted(suite, key=lambda s: len(json.dumps(s)))[50]
    vocabulary = GrammarVocabulary.of(tokenizer, None)
    times = []
    for i in range(5):  # a new description each time, so nothing is cached
        spec = ConstraintSpec.of("json_schema", {**median, "description": f"run {i}"})
        started = time.perf_counter()
        Constraint(spec, vocabulary)  # compiles and computes the first mask
        times.append(time.perf_counter() - started)
    return {"compile_and_first_mask_ms": [round(1e3 * t, 3) for t in times], "schema": median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--quantize")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: clients,constrained
    args = parser.parse_args()
    if args.one:
        clients, constrained = args.one.split(",")
        result = one_run(args.model, args.quantize, int(clients), args.max_tokens, constrained == "1")
        print(json.dumps(result))
        return
    print(json.dumps(compile_time(args.model)), flush=True)
    summary = {}
    for clients in args.clients:
        for _repeat in range(args.repeats):
            for constrained in (0, 1):  # contenders in turns
                command = [sys.executable, __file__, args.model, "--max-tokens", str(args.max_tokens),
                           "--one", f"{clients},{constrained}"] + (["--quantize", args.quantize] if args.quantize else [])  # fmt: skip
                out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
                result = json.loads(out.strip().splitlines()[-1])
                result["load_average"] = [round(x, 2) for x in os.getloadavg()]
                print(json.dumps(result), flush=True)
                summary.setdefault((clients, constrained), []).append(result["tokens_per_s"])
    for clients in args.clients:
        free, held = summary[(clients, 0)], summary[(clients, 1)]
        print(
            f"{clients} clients: free best {max(free):.1f} tok/s (range {min(free):.1f}-{max(free):.1f}), "
            f"JSON schema best {max(held):.1f} (range {min(held):.1f}-{max(held):.1f}), "
            f"ratio of bests {max(held) / max(free):.3f}; load {os.getloadavg()[0]:.1f}"
        )


if __name__ == "__main__":
    main()
