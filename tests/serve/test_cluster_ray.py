"""`flashformer serve --replicas 2 --threads 1` on a local Ray cluster (serve/cluster/), driven
over HTTP as users drive it: the answers are one engine's, a conversation's second turn finds
its first turn's prefix in its replica's cache, /health and /metrics report both replicas, and
(slow, the real SmolLM2) a second turn's TTFT is a fraction of the first's and a replica killed
mid-stream ends its stream with an error while the service goes on and Ray restarts it."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

import pytest

pytest.importorskip("ray.serve", reason="the [cluster] extra (ray[serve]) is not installed")

from helpers import tiny_chat_folder  # noqa: E402
from helpers.engine import run_requests  # noqa: E402

import flashformer  # noqa: E402
from flashformer.serve.engine import Engine  # noqa: E402
from flashformer.serve.request import SamplingParams  # noqa: E402

MODEL = "tiny"


def http(method: str, url: str, body: dict | None = None, timeout: float = 120) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def stream(url: str, body: dict, on_chunk=None) -> tuple[list[dict], float | None]:
    """The SSE payloads of a streamed request (until [DONE]) and the seconds to its first text."""
    data = json.dumps({**body, "stream": True}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    started, first, payloads = time.perf_counter(), None, []
    with urllib.request.urlopen(request, timeout=600) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            payloads.append(payload)
            choices = payload.get("choices") or [{}]
            if first is None and (choices[0].get("delta") or {}).get("content"):
                first = time.perf_counter() - started
            if on_chunk is not None:
                on_chunk(len(payloads))
    return payloads, first


@contextmanager
def replicas_serving(model, *extra: str, start_timeout: float = 300):
    """`flashformer serve MODEL --replicas 2 --threads 1 ...` in a session of its own, for the
    length of a with-block; its URL. Stopped with SIGTERM (the server takes its local Ray cluster
    down with it), then its whole process group if anything is left."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "flashformer.cli", "serve", str(model), "--port", str(port),
               "--replicas", "2", "--threads", "1", *extra]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited: {process.stdout.read()}")
            try:
                if http("GET", url + "/health", timeout=10)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer /health within {start_timeout} s")
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(process.pid, signal.SIGKILL)  # Ray's processes, should any remain
        except ProcessLookupError:
            pass


# ---- fast: a tiny random-weight model (SmolLM2's tokenizer and template) ----


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_chat_folder(tmp_path_factory.mktemp("tiny-chat"), max_positions=256)


@pytest.fixture(scope="module")
def cluster(tiny):
    # --prefill-chunk 16: a float model's prefix reuse stops at multiples of the chunk (scheduler.py)
    with replicas_serving(tiny, "--served-model-name", MODEL, "--max-batch", "8", "--kv-blocks", "96",
                          "--prefill-chunk", "16") as url:  # fmt: skip
        yield url


def test_greedy_answers_equal_one_engines_and_streaming_equals_whole(cluster, tiny):
    prompts = [list(range(500 + 37 * i, 540 + 41 * i)) for i in range(4)]
    answers = [None] * len(prompts)

    def ask(i: int) -> None:  # all four at once, over both replicas
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 12, "temperature": 0}
        status, text = http("POST", cluster + "/v1/completions", body)
        assert status == 200, text
        answers[i] = json.loads(text)["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    model, tokenizer = flashformer.load(tiny)
    engine = Engine(model, tokenizer, max_batch=8, num_blocks=96, prefill_chunk=16)
    expected = run_requests(engine, [(p, SamplingParams(max_tokens=12, temperature=0)) for p in prompts])
    assert answers == [e["text"] for e in expected]

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 10,
            "temperature": 0}  # fmt: skip
    status, text = http("POST", cluster + "/v1/chat/completions", chat)
    whole = json.loads(text)["choices"][0]["message"]["content"]
    payloads, _ = stream(cluster + "/v1/chat/completions", chat)
    pieces = "".join((p["choices"][0]["delta"].get("content") or "") for p in payloads if p.get("choices"))
    assert status == 200 and pieces == whole and whole


def test_every_second_turn_finds_its_first_turn_in_its_replicas_cache(cluster):
    """Six two-turn conversations: each second turn reuses at least every full block of its first
    turn's prompt (cached_tokens), which only the replica that served the first turn holds;
    sent at random, about half would find nothing (all six: 1 chance in 64)."""
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()
    found = []
    for c in range(6):
        opening = " ".join(words[(c + i) % len(words)] for i in range(45 + 3 * c))
        messages = [{"role": "user", "content": f"Conversation {c}: {opening}"}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
        first = json.loads(http("POST", cluster + "/v1/chat/completions", body)[1])
        messages += [first["choices"][0]["message"], {"role": "user", "content": "And then?"}]
        second = json.loads(http("POST", cluster + "/v1/chat/completions", {**body, "messages": messages})[1])
        found.append(
            (first["usage"]["prompt_tokens"], second["usage"]["prompt_tokens_details"]["cached_tokens"])
        )
    assert all(cached >= 16 * (prompt // 16) for prompt, cached in found), found

    status, text = http("GET", cluster + "/metrics")
    hits = {
        m[0]: int(float(m[1]))
        for m in re.findall(r'flashformer_prefix_cache_hits_total\{replica="([^"]+)"\} (\S+)', text)
    }
    assert status == 200 and len(hits) == 2, text
    assert sum(hits.values()) >= sum(cached for _, cached in found)
    assert "flashformer_replicas 2" in text


def test_health_reports_every_replica(cluster):
    status, text = http("GET", cluster + "/health")
    health = json.loads(text)
    assert status == 200 and health["status"] == "ok", text
    assert len({r["replica"] for r in health["replicas"]}) == 2 and all(
        r["pid"] > 0 for r in health["replicas"]
    )
    assert health["replica_states"] == {"RUNNING": 2}


# ---- slow: the real SmolLM2 ----


@pytest.fixture(scope="module")
def smollm2_cluster():
    from flashformer.checkpoints.gguf.packaged_models import smollm2_path

    with replicas_serving(smollm2_path(), "--quantize", "gguf", "--served-model-name", "smollm2") as url:
        yield url


@pytest.mark.slow
def test_a_second_turns_time_to_first_token_is_a_fraction_of_the_firsts(smollm2_cluster):
    """Six conversations opening with a long text (about 900 tokens): each second turn, sent to
    the replica holding the first turn's prompt, computes only what was added, so its TTFT is at
    most 0.3x the first turn's (routed at random, about half would compute everything again)."""
    from flashformer.bench.serve_load import corpus

    words = corpus()
    ratios = []
    for c in range(6):
        document = " ".join(words[400 * c : 400 * c + 650])
        messages = [{"role": "user", "content": f"Read this text.\n\n{document}\n\nWhat is it about?"}]
        body = {"model": "smollm2", "messages": messages, "max_tokens": 24, "temperature": 0}
        payloads, first_ttft = stream(smollm2_cluster + "/v1/chat/completions", body)
        answer = "".join(
            (p["choices"][0]["delta"].get("content") or "") for p in payloads if p.get("choices")
        )
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Say more."}]
        _, second_ttft = stream(smollm2_cluster + "/v1/chat/completions", {**body, "messages": messages})
        ratios.append(second_ttft / first_ttft)
    assert all(ratio <= 0.3 for ratio in ratios), ratios


@pytest.mark.slow
def test_a_replica_killed_mid_stream_ends_its_stream_with_an_error_and_is_replaced(smollm2_cluster):
    url = smollm2_cluster
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
            "max_tokens": 400, "temperature": 0, "ignore_eos": True}  # fmt: skip
    killed = []

    def kill_its_replica(chunks: int) -> None:
        if chunks == 5 and not killed:
            replicas = json.loads(http("GET", url + "/health")[1])["replicas"]
            busy = [r for r in replicas if r["sequences_running"]]
            assert len(busy) == 1, replicas
            os.kill(busy[0]["pid"], signal.SIGKILL)
            killed.append((busy[0]["replica"], time.monotonic()))

    payloads, _ = stream(url + "/v1/chat/completions", body, on_chunk=kill_its_replica)
    assert killed, "the stream ended before the replica could be killed"
    assert "error" in payloads[-1] and "replica" in payloads[-1]["error"]["message"], payloads[-1]
    assert len(payloads) < 400  # it ended at the error, not after the whole answer

    status, text = http("POST", url + "/v1/chat/completions", {**body, "max_tokens": 8}, timeout=30)
    assert status == 200 and json.loads(text)["choices"][0]["message"]["content"], text

    dead, when = killed[0]
    while True:  # Ray replaces it: two replicas again, the dead one not among them
        health = json.loads(http("GET", url + "/health")[1])
        names = {r["replica"] for r in health["replicas"]}
        if len(names) == 2 and dead not in names:
            break
        assert time.monotonic() - when < 30, health
        time.sleep(0.5)
