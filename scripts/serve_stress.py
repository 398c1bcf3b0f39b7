"""A storm against `flashformer serve`: valid, disconnecting and bad requests mixed, then checks.

    python scripts/serve_stress.py MODEL [--requests 200] [--quantize gguf]

Starts the server on a free port, computes each valid request's answer alone first, then sends
all requests at once in a seeded random order: valid ones (greedy, short), ones that read a few
chunks of a stream and hang up, and bad ones (unknown model, max_tokens 0, malformed JSON). Checks
that every valid request got its solo answer, every bad one its error, that the KV pool is empty
afterwards, and how the server's resident memory changed over a second storm. Prints JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import urllib.request

from flashformer.bench.serve import free_port, start

QUESTIONS = [
    "What is the capital of France?", "Name a color.", "What is 2 + 3?", "Say hello.",
    "Write a haiku about rain.", "What is Python?", "Give me a number.", "What day comes after Monday?",
    "Name an animal.", "What is the opposite of hot?",
]  # fmt: skip


def metrics(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def storm(url: str, name: str, jobs: list[tuple[str, object]], seed: int) -> list:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
    rng = random.Random(seed)

    async def run(kind, arg):
        if kind == "valid":
            question, n = arg
            reply = await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": question}], max_tokens=n, temperature=0
            )
            return ("valid", arg, reply.choices[0].message.content)
        if kind == "disconnect":
            stream = await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": arg}], max_tokens=64, stream=True
            )
            async for _ in stream:
                if rng.random() < 0.3:
                    break
            await stream.close()
            return ("disconnect", arg, None)
        try:
            if arg == "model":
                await client.chat.completions.create(
                    model="nope", messages=[{"role": "user", "content": "x"}]
                )
            else:
                await client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "x"}], max_tokens=0
                )
        except Exception as error:
            return ("bad", arg, type(error).__name__)
        return ("bad", arg, "accepted")

    order = list(jobs)
    rng.shuffle(order)
    results = await asyncio.gather(*[run(kind, arg) for kind, arg in order])
    await client.close()
    return results


def solo_answer(url: str, name: str, question: str, n: int) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0)
    reply = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": question}], max_tokens=n, temperature=0
    )
    return reply.choices[0].message.content


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--quantize")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="storms in a row against one server")
    args = parser.parse_args()
    port = free_port()
    command = [sys.executable, "-m", "flashformer.cli", "serve", args.model, "--port", str(port),
               "--api-key", "bench", "--max-batch", str(args.max_batch), "--max-waiting", "1024"]  # fmt: skip
    command += ["--quantize", args.quantize] if args.quantize else []
    url = f"http://127.0.0.1:{port}"
    process = start(command, url + "/v1")
    try:
        from openai import OpenAI

        name = OpenAI(base_url=url + "/v1", api_key="bench").models.list().data[0].id
        valid_count = args.requests * 7 // 10
        disconnects = args.requests * 2 // 10
        bads = args.requests - valid_count - disconnects
        valid = [(QUESTIONS[i % len(QUESTIONS)], 4 + i % 13) for i in range(valid_count)]
        solo = {job: solo_answer(url, name, *job) for job in set(valid)}
        jobs = [("valid", job) for job in valid]
        jobs += [("disconnect", QUESTIONS[i % len(QUESTIONS)]) for i in range(disconnects)]
        jobs += [("bad", "model" if i % 2 else "max_tokens") for i in range(bads)]
        report = {"requests": len(jobs), "valid": valid_count, "disconnecting": disconnects, "bad": bads}
        for round_seed in range(1, args.rounds + 1):
            before = rss_kib(process.pid)
            started = time.perf_counter()
            results = asyncio.run(storm(url, name, jobs, round_seed))
            seconds = time.perf_counter() - started
            deadline = time.monotonic() + 30
            while metrics(url)["flashformer_kv_blocks_in_use"] > 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            state = metrics(url)
            wrong = [arg for kind, arg, out in results if kind == "valid" and out != solo[arg]]
            errors = sorted({out for kind, _, out in results if kind == "bad"})
            report[f"round {round_seed}"] = {
                "seconds": seconds,
                "valid answers equal to solo": valid_count - len(wrong),
                "bad request outcomes": errors,
                "kv_blocks_in_use after": state["flashformer_kv_blocks_in_use"],
                "sequences_waiting after": state["flashformer_sequences_waiting"],
                "rss_kib before": before,
                "rss_kib after": rss_kib(process.pid),
            }
            print(json.dumps(report[f"round {round_seed}"]), flush=True)
        first = valid[0]
        report["a solo request after the storms gets its answer"] = (
            solo_answer(url, name, *first) == solo[first]
        )
        print(json.dumps(report, indent=2))
    finally:
        process.terminate()
        process.wait(timeout=60)


if __name__ == "__main__":
    main()
