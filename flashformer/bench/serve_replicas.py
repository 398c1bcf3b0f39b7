"""bench serve --replicas N: flashformer's engines as N replicas on Ray Serve (serve/cluster/)
against the one server, on the same machine with the same threads in all (--threads split
between the replicas), the same workloads and clients.

Measured besides the workloads' timings: the prefix cache's hit rate over each workload (the
/metrics counters before and after it, every replica's added up: prompt tokens reused / tokens
looked up), and with --kill-replica a fault drill: the mixed workload's questions with
--clients in flight, one replica's process killed (SIGKILL) a few seconds in; every request
either answers, ends with an error, or is counted hung past HUNG_S; then how long until a
request answers again and until Ray has the replicas back.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
import urllib.request

HUNG_S = 120.0  # a request with no answer nor error after this long is hung


def replicas_command(ours: list[str], replicas: int, threads: int) -> list[str]:
    """`flashformer serve ... --replicas N`, each replica with its share of the threads."""
    command = list(ours)
    if "--threads" in command:  # the single server's threads, split between the replicas
        at = command.index("--threads")
        del command[at : at + 2]
    return command + ["--replicas", str(replicas), "--threads", str(max(1, threads // replicas))]


def cache_counters(url: str) -> tuple[float, float] | None:
    """(prefix-cache hits, queries) in tokens so far, every replica's added up; None for a server
    without flashformer's /metrics."""
    try:
        with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=30) as reply:
            return counters_of(reply.read().decode())
    except OSError:
        return None


def counters_of(text: str) -> tuple[float, float] | None:
    """(hits, queries) of a /metrics text: one server's samples, or the sum of every replica's."""
    totals = []
    for name in ("prefix_cache_hits_total", "prefix_cache_queries_total"):
        values = re.findall(rf"^flashformer_{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
        if not values:
            return None
        totals.append(sum(float(v) for v in values))
    return totals[0], totals[1]


def hit_rate(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Prompt tokens reused / looked up between two cache_counters readings."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def health(url: str) -> dict:
    try:
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=10) as reply:
            return json.loads(reply.read())
    except (OSError, ValueError) as error:
        return {"error": repr(error)}


async def kill_drill(url: str, model: str, jobs, clients: int, replicas: int, after_s: float = 5.0) -> dict:
    """The jobs with `clients` in flight; after_s seconds in, the busiest replica's process is
    killed. Counts of answered, errored and hung requests; seconds from the kill to the first
    request started after it that answers, and to /health listing `replicas` replicas again
    (the killed one not among them)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url, api_key="bench", max_retries=0, timeout=HUNG_S)
    queue, counts, killed = list(jobs), {"answered": 0, "errored": 0, "hung": 0}, {}

    async def one(question: str, limit: int) -> None:
        started = time.monotonic()
        try:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": question}], max_tokens=limit,
                temperature=0, stream=True,
            )  # fmt: skip
            async for _ in stream:
                pass
            counts["answered"] += 1
            if "at" in killed and started > killed["at"] and "first_answer_s" not in killed:
                killed["first_answer_s"] = time.monotonic() - killed["at"]
        except Exception as error:  # the openai client raises on an SSE error event and on timeouts
            timed_out = "timed out" in repr(error).lower() or time.monotonic() - started >= HUNG_S
            counts["hung" if timed_out else "errored"] += 1

    async def worker() -> None:
        while queue:
            question, limit = queue.pop(0)
            await one(question, limit)

    async def kill() -> None:
        await asyncio.sleep(after_s)
        replicas_now = (await asyncio.to_thread(health, url)).get("replicas", [])
        victim = max(replicas_now, key=lambda r: r.get("sequences_running") or 0)
        os.kill(victim["pid"], signal.SIGKILL)
        killed.update(at=time.monotonic(), replica=victim["replica"])
        while True:
            now = await asyncio.to_thread(health, url)
            names = {r["replica"] for r in now.get("replicas", [])}
            if len(names) == replicas and victim["replica"] not in names:
                killed["replicas_back_s"] = time.monotonic() - killed["at"]
                return
            if time.monotonic() - killed["at"] > 300:
                return
            await asyncio.sleep(0.5)

    started = time.monotonic()
    await asyncio.gather(kill(), *[worker() for _ in range(clients)])
    await client.close()
    return {
        **counts,
        "requests": len(jobs),
        "clients": clients,
        "killed_after_s": after_s,
        "wall_s": time.monotonic() - started,
        "first_answer_after_kill_s": killed.get("first_answer_s"),
        "replicas_back_s": killed.get("replicas_back_s"),
    }


def replica_targets(single: dict, replicated: dict) -> dict:
    """The issue's ratios: the replicas against the one server on each workload they both ran,
    and the kill drill's counts."""
    found = {}
    for key, label in (("shared_prefix", "shared prefix"), ("multi_turn", "multi-turn")):
        ours, theirs = single.get(key), replicated.get(key)
        if not ours or not theirs:
            continue
        ours, theirs = ours.get("loaded", ours), theirs.get("loaded", theirs)
        found[f"{label}: output tokens/s, replicas / one server (>= 0.9)"] = (
            theirs["output_tokens_per_s"] / ours["output_tokens_per_s"]
        )
        if ours["ttft_p50_s"] and theirs["ttft_p50_s"]:
            found[f"{label}: TTFT p50, replicas / one server (<= 1.2)"] = (
                theirs["ttft_p50_s"] / ours["ttft_p50_s"]
            )
        if ours.get("prefix_hit_rate") is not None and theirs.get("prefix_hit_rate") is not None:
            found[f"{label}: prefix-cache hit rate, replicas - one server, points (>= -5)"] = 100 * (
                theirs["prefix_hit_rate"] - ours["prefix_hit_rate"]
            )
    drill = replicated.get("kill_drill")
    if drill:
        found["killed replica: hung requests (0)"] = drill["hung"]
        if drill["replicas_back_s"] is not None:
            found["killed replica: seconds until the replicas are back (<= 30)"] = drill["replicas_back_s"]
    return found
