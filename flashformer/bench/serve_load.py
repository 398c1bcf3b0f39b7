"""bench serve's load: the requests every server gets and the clients that send them.

The mixed workload's questions (5..150 words of Python's own docstrings, drawn with a
fixed seed), the shared-prefix and multi-turn workloads' messages, and the streamed
clients (the `openai` async client) that keep N requests in flight and time each token:
time to first token, the gaps between tokens, output tokens/s over the run.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import random
import time

WORKLOADS = ("mixed", "shared-prefix", "multi-turn")


def names(text: str) -> list[str]:
    """--workloads as a list, each one of WORKLOADS."""
    found = [name for name in text.split(",") if name]
    unknown = [name for name in found if name not in WORKLOADS]
    if unknown or not found:
        raise ValueError(f"--workloads takes some of {', '.join(WORKLOADS)}; got {text!r}")
    return found


def corpus() -> list[str]:
    """The words questions and documents are cut from: Python's own docstrings."""
    import collections
    import json as json_module

    return " ".join(
        inspect.getdoc(obj) or ""
        for module in (collections, json_module, asyncio, argparse)
        for obj in vars(module).values()
        if callable(obj)
    ).split()


def workload(count: int, max_tokens: int, seed: int) -> list[tuple[str, int]]:
    """(question, max_tokens) per request: the same for every server."""
    words = corpus()
    rng = random.Random(seed)
    jobs = []
    for _ in range(count):
        length = rng.randint(5, 150)
        start = rng.randrange(0, max(1, len(words) - length))
        question = "Summarize: " + " ".join(words[start : start + length])
        jobs.append((question, rng.randint(16, max_tokens)))
    return jobs


def text_of(tokenizer, tokens: int, start: int) -> str:
    """Corpus words from `start` on, as few as make at least `tokens` tokens."""
    words = corpus()
    count = tokens // 2
    while len(tokenizer.encode(" ".join(words[start : start + count]))) < tokens:
        count += 8
    return " ".join(words[start : start + count])


def shared_prefix_jobs(tokenizer, args) -> list[tuple[list[dict], int]]:
    """Today's questions, each after the same system prompt of args.system_tokens tokens."""
    system = "You answer questions about this text. " + text_of(tokenizer, args.system_tokens, 7)
    return [(ask(q, system), n) for q, n in workload(args.requests, args.max_tokens, args.seed)]


def chats(tokenizer, args) -> list[list[str]]:
    """Per chat, its users' messages: a document of args.history_tokens tokens and a question,
    then args.turns - 1 short follow-up questions (5..20 words: what the next turn adds)."""
    words, rng = corpus(), random.Random(args.seed + 1)
    found = []
    for _ in range(args.chats):
        document = text_of(tokenizer, args.history_tokens, rng.randrange(0, len(words) // 2))
        follow = []
        for _ in range(args.turns - 1):
            start, length = rng.randrange(0, len(words) - 20), rng.randint(5, 20)
            follow.append("And what does this mean: " + " ".join(words[start : start + length]))
        found.append([f"Read this text.\n\n{document}\n\nWhat is it about?"] + follow)
    return found


async def drive_chats(url: str, model: str, conversations: list[list[str]], limit: int, api_key: str) -> dict:
    """Every chat in flight at once, each turn re-sending the history (answers included): the
    timings over all turns, and the TTFT p50 of each turn."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=3600)
    ttfts, by_turn, gaps = [], [[] for _ in conversations[0]], []
    tokens = errors = 0

    async def chat(messages: list[str]):
        nonlocal tokens, errors
        history = []
        for turn, message in enumerate(messages):
            history.append({"role": "user", "content": message})
            started, last, answer = time.perf_counter(), None, []
            try:
                stream = await client.chat.completions.create(
                    model=model, messages=history, max_tokens=limit, temperature=0, stream=True,
                    stream_options={"include_usage": True},
                )  # fmt: skip
                async for chunk in stream:
                    now = time.perf_counter()
                    if chunk.choices and chunk.choices[0].delta.content:
                        if last is None:
                            ttfts.append(now - started)
                            by_turn[turn].append(now - started)
                        else:
                            gaps.append(now - last)
                        last = now
                        answer.append(chunk.choices[0].delta.content)
                    if chunk.usage is not None:
                        tokens += chunk.usage.completion_tokens
            except Exception:
                errors += 1
                return
            history.append({"role": "assistant", "content": "".join(answer)})

    started = time.perf_counter()
    await asyncio.gather(*[chat(messages) for messages in conversations])
    await client.close()
    result = summary(sum(map(len, conversations)), len(conversations), errors, tokens,
                     time.perf_counter() - started, ttfts, gaps)  # fmt: skip
    return {**result, "ttft_p50_by_turn_s": [percentile(times, 50) for times in by_turn]}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def ask(question: str, system: str | None = None) -> list[dict]:
    """A chat's messages: the question, after a system prompt when given."""
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}
    ]


def as_prompt(question: str | list[dict]) -> str:
    """A job's text for /v1/completions (a model without a chat template): a question as it is,
    a chat's messages one after another, a blank line between."""
    return question if isinstance(question, str) else "\n\n".join(m["content"] for m in question)


async def drive(
    url: str,
    model: str,
    jobs: list[tuple[str, int]],
    clients: int,
    api_key: str,
    extra: dict | None = None,
    completions: bool = False,
) -> dict:
    """Run the jobs (a question, or a chat's messages, and max_tokens) with `clients` in flight;
    timings per request. extra: more fields of every request (--json-schema's response_format).
    completions: over /v1/completions, each job's text as the prompt (a base model's server)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=3600)
    queue = list(enumerate(jobs))
    ttfts, gaps, spans, tokens, errors = [], [], [], 0, 0
    started_at = time.perf_counter()

    async def one(question, limit: int):
        nonlocal tokens, errors
        started = time.perf_counter()
        first = last = None
        chunks, counted = 0, None
        fields = dict(model=model, max_tokens=limit, temperature=0, stream=True,
                      stream_options={"include_usage": True}, **(extra or {}))  # fmt: skip
        try:
            if completions:
                stream = await client.completions.create(prompt=as_prompt(question), **fields)
            else:
                messages = ask(question) if isinstance(question, str) else question
                stream = await client.chat.completions.create(messages=messages, **fields)
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and (
                    chunk.choices[0].text if completions else chunk.choices[0].delta.content
                ):
                    if last is None:
                        ttfts.append(now - started)
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                    chunks += 1
                if chunk.usage is not None:
                    counted = chunk.usage.completion_tokens
            # a server without stream usage (llama-cpp-python's): a token per chunk
            made = chunks if counted is None else counted
            tokens += made
            spans.append((made, first, last))
        except Exception:
            errors += 1

    async def worker():
        while queue:
            _, (question, limit) = queue.pop(0)
            await one(question, limit)

    await asyncio.gather(*[worker() for _ in range(clients)])
    await client.close()
    wall = time.perf_counter() - started_at
    return summary(len(jobs), clients, errors, tokens, wall, ttfts, gaps, spans)


def summary(requests, clients, errors, tokens, wall, ttfts, gaps, spans=()) -> dict:
    """A run's figures. spans: per request (its tokens, the times its first and last text
    arrived), from which the decode rate: the tokens after each request's first over the time
    they took (the time to the first token left out, as a decode benchmark leaves the prompt
    out)."""
    decoded = [(made - 1, end - begin) for made, begin, end in spans if made > 1 and end is not None]
    decode_s = sum(seconds for _, seconds in decoded)
    return {
        "requests": requests,
        "clients": clients,
        "errors": errors,
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "decode_tokens_per_s": sum(made for made, _ in decoded) / decode_s if decode_s > 0 else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
    }
