"""`flashformer serve` with the real `openai` client: the server runs as a
subprocess on a free loopback port with a small model (a tiny LLaMA with
random weights and SmolLM2's tokenizer and chat template), and its answers
are compared with model.generate and with each other. The engine's
scheduling (preemption, invariance) is also tested in-process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from helpers import tiny_chat_folder
from helpers.engine import run_requests

import flashformer
from flashformer.serve.engine import Busy, Engine
from flashformer.serve.request import Request, SamplingParams

KEY = "test-key"
QUESTIONS = [
    "Hello!",
    "Tell me a long story about the sea, the wind and a lighthouse.",
    "What is 2 + 2?",
    "Name three colors.",
]


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """A Hugging Face folder: a 2-layer LLaMA (GQA 4/2) with weights large enough that its
    next-token distributions are peaked (greedy choices are far from ties), and SmolLM2's
    tokenizer and chat template."""
    return tiny_chat_folder(tmp_path_factory.mktemp("tiny-chat"), max_positions=256)


def http(method: str, url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, str]:
    """(status, body text) of a plain HTTP call (the stdlib's: what the client hides is tested here)."""
    request = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(folder, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "flashformer.cli", "serve", str(folder), "--port", str(port), *extra]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120  # nothing is compiled: it listens once the model is loaded
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: {process.stdout.read()}")
        try:
            if http("GET", url + "/health")[0] == 200:
                return process, url
        except OSError:
            time.sleep(0.3)
    process.kill()
    raise RuntimeError("the server did not answer /health within 600 s")


@contextlib.contextmanager
def serving(folder, *extra: str):
    """start_server for the length of a with-block (a module fixture's yield): its URL."""
    process, url = start_server(folder, *extra)
    try:
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def openai_client(url: str, api_key: str = KEY):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0)


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with serving(tiny_chat_model, "--api-key", KEY, "--max-batch", "16", "--kv-blocks", "96") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def local(tiny_chat_model):
    return flashformer.load(tiny_chat_model)


def chat(client, question: str, **kwargs):
    return client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": question}], **kwargs
    )


def generate_locally(local, question: str, max_new_tokens: int) -> str:
    model, tokenizer = local
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=max_new_tokens, eos_token_id=tokenizer.stop_token_ids
    )
    return tokenizer.decode(out[0, len(ids) :].tolist())


# ---- the API with the client ----


def test_models_and_health(client, server, tiny_chat_model):
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_chat_model.name]
    assert http("GET", server + "/health") == (200, json.dumps({"status": "ok"}, separators=(",", ":")))
    assert 0 < metrics(server)["flashformer_start_seconds"] < 60  # from the process's start to serving


def test_chat_streamed_and_not_equal_generate(client, local):
    for question in QUESTIONS[:2]:
        whole = chat(client, question, max_tokens=24, temperature=0)
        pieces = chat(client, question, max_tokens=24, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
        text = whole.choices[0].message.content
        assert text == streamed == generate_locally(local, question, 24)
        assert len(text) > 10


def test_usage_and_max_tokens(client, local):
    _, tokenizer = local
    reply = chat(client, QUESTIONS[2], max_tokens=7, temperature=0)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[2]}], add_generation_prompt=True
    )
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 7
    assert reply.usage.total_tokens == len(prompt) + 7


def test_stop_strings_end_the_text_and_are_not_returned(client):
    full = chat(client, QUESTIONS[1], max_tokens=30, temperature=0).choices[0].message.content
    stop = full[12:15]
    cut = full.index(stop)
    for stream in (False, True):
        reply = chat(
            client, QUESTIONS[1], max_tokens=30, temperature=0, stop=[stop, "\x00never"], stream=stream
        )
        if stream:
            chunks = list(reply)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            text, reason = reply.choices[0].message.content, reply.choices[0].finish_reason
        assert text == full[:cut] and reason == "stop"


def test_seeded_n_choices_are_reproducible(client):
    first = chat(client, QUESTIONS[0], max_tokens=12, temperature=1.0, n=2, seed=11)
    again = chat(client, QUESTIONS[0], max_tokens=12, temperature=1.0, n=2, seed=11)
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert texts[0] != texts[1]
    assert first.usage.completion_tokens == 24


def test_streamed_usage_and_logprobs(client):
    chunks = list(
        chat(
            client,
            QUESTIONS[3],
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=3,
        )
    )
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []
    entries = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == 5
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
        assert entry.logprob <= 0


def test_completions_with_text_and_token_ids(client, local):
    model, tokenizer = local
    name = client.models.list().data[0].id
    text = client.completions.create(model=name, prompt="def add(a, b):", max_tokens=10, temperature=0)
    ids = tokenizer.encode("def add(a, b):")
    by_ids = client.completions.create(model=name, prompt=ids, max_tokens=10, temperature=0, logprobs=2)
    assert text.choices[0].text == by_ids.choices[0].text
    out = model.generate(torch.tensor([ids]), max_new_tokens=10, eos_token_id=tokenizer.stop_token_ids)
    assert text.choices[0].text == tokenizer.decode(out[0, len(ids) :].tolist())
    assert len(by_ids.choices[0].logprobs.token_logprobs) == 10


def test_sixteen_concurrent_requests_each_equal_its_solo_answer(client, server):
    from openai import AsyncOpenAI

    requests = [(QUESTIONS[i % 4] + " " * (i % 3), 6 + 3 * (i % 5)) for i in range(16)]
    solo = [chat(client, q, max_tokens=n, temperature=0).choices[0].message.content for q, n in requests]

    async def together():
        async_client = AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
        name = (await async_client.models.list()).data[0].id
        replies = await asyncio.gather(
            *[
                async_client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": q}], max_tokens=n, temperature=0
                )
                for q, n in requests
            ]
        )
        await async_client.close()
        return [r.choices[0].message.content for r in replies]

    before = metrics(server)
    assert asyncio.run(together()) == solo
    after = metrics(server)
    generated = after["flashformer_generated_tokens_total"] - before["flashformer_generated_tokens_total"]
    steps = after["flashformer_steps_total"] - before["flashformer_steps_total"]
    assert generated == sum(n for _, n in requests)
    assert steps < generated / 3, "the requests were not decoded together"
    assert all(len(text) > 3 for text in solo)


def metrics(server) -> dict:
    lines = http("GET", server + "/metrics")[1].splitlines()
    return {line.split()[0]: float(line.split()[1]) for line in lines if not line.startswith("#")}


def test_a_client_that_disconnects_is_cancelled_and_its_blocks_freed(client, server):
    stream = chat(client, QUESTIONS[1], max_tokens=200, temperature=0, stream=True)
    for _, _ in zip(range(3), stream):
        pass
    stream.close()
    deadline = time.monotonic() + 10
    while metrics(server)["flashformer_kv_blocks_in_use"] > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metrics(server)["flashformer_kv_blocks_in_use"] == 0
    assert chat(client, QUESTIONS[0], max_tokens=3, temperature=0).choices[0].message.content


def test_a_repeated_prompt_reuses_its_cached_prefix_and_the_flag_turns_it_off(
    client, server, tiny_chat_model
):
    """The second time, the prompt's full blocks (9 of 16 tokens: the native decoder computes
    every row alone, so blocks are reused whole) come from the prefix cache, reported in usage
    and /metrics; the answer is the same, and the same as a server's with --no-prefix-cache,
    which reuses nothing."""
    question = QUESTIONS[1] * 8  # about 160 tokens with the chat template
    before = metrics(server)
    first, second = (chat(client, question, max_tokens=8, temperature=0) for _ in range(2))
    after = metrics(server)
    assert first.usage.prompt_tokens > 128
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens // 16 * 16
    assert after["flashformer_prefix_cache_hits_total"] - before["flashformer_prefix_cache_hits_total"] >= 128
    assert after["flashformer_kv_blocks_cached"] >= 8 and 0 < after["flashformer_prefix_cache_hit_rate"] <= 1
    assert first.choices[0].message.content == second.choices[0].message.content
    from openai import OpenAI

    with serving(tiny_chat_model, "--no-prefix-cache", "--kv-blocks", "32") as url:
        uncached = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        replies = [chat(uncached, question, max_tokens=8, temperature=0) for _ in range(2)]
        assert [r.usage.prompt_tokens_details.cached_tokens for r in replies] == [0, 0]
        assert [r.choices[0].message.content for r in replies] == [first.choices[0].message.content] * 2
        assert metrics(url)["flashformer_kv_blocks_cached"] == 0


BAD = [
    ("malformed JSON", b"{not json", 400, "not valid JSON"),
    (
        "unknown model",
        {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
        404,
        "does not exist",
    ),
    ("max_tokens 0", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ("too long", {"messages": [{"role": "user", "content": "word " * 400}]}, 400, "maximum context length"),
    ("no messages", {"messages": []}, 400, "messages"),
    ("temperature", {"messages": [{"role": "user", "content": "x"}], "temperature": 5}, 400, "temperature"),
    ("top_k", {"messages": [{"role": "user", "content": "x"}], "top_k": -5}, 400, "top_k"),
    (
        "best_of",
        {"messages": [{"role": "user", "content": "x"}], "best_of": 3},
        400,
        "best_of is not supported",
    ),
    (
        "unenforceable schema keyword",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}},
        },
        400,
        "the JSON schema keyword 'not' cannot be enforced",
    ),
    ("unknown field", {"messages": [{"role": "user", "content": "x"}], "beam_width": 4}, 400, "beam_width"),
]


@pytest.mark.parametrize("name, body, status, message", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors(server, tiny_chat_model, name, body, status, message):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    if isinstance(body, dict):
        body = json.dumps({"model": tiny_chat_model.name, **body}).encode()
    code, text = http("POST", server + "/v1/chat/completions", body, headers)
    assert code == status
    error = json.loads(text)["error"]
    assert message in error["message"] and error["type"]


def test_fields_that_ask_for_nothing_are_accepted_and_change_nothing(client):
    """Who asks (user, metadata) and the no-op values of unimplemented fields (top_k -1, an empty
    logit_bias, a text response_format) are no reason to refuse: the same greedy answer."""
    plain = chat(client, QUESTIONS[0], max_tokens=16, temperature=0).choices[0].message.content
    extras = {"top_k": -1, "min_p": 0, "repetition_penalty": 1.0, "metadata": {"run": "test"}}
    same = chat(
        client,
        QUESTIONS[0],
        max_tokens=16,
        temperature=0,
        user="someone",
        logit_bias={},
        response_format={"type": "text"},
        extra_body=extras,
    )
    assert same.choices[0].message.content == plain and plain


def test_a_text_model_refuses_embeddings_by_name(client, tiny_chat_model):
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="generates text; /v1/embeddings needs an encoder"):
        client.embeddings.create(model=tiny_chat_model.name, input="hello")


def test_a_wrong_api_key_is_401(server, tiny_chat_model):
    from openai import AuthenticationError, OpenAI

    with pytest.raises(AuthenticationError):
        OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    assert http("GET", server + "/v1/models")[0] == 401
    assert http("GET", server + "/health")[0] == 200  # health needs no key


def test_the_server_still_answers_after_everything(client):
    assert chat(client, QUESTIONS[2], max_tokens=4, temperature=0).choices[0].finish_reason == "length"


# ---- the engine in-process: preemption, back-pressure, invariance ----


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Submit every prompt at once, step the engine until all are done, return their tokens."""
    jobs = [(prompt, SamplingParams(max_tokens=max_tokens, temperature=0)) for prompt in prompts]
    return [found["tokens"] for found in run_requests(engine, jobs)]


def test_preempted_sequences_continue_with_the_same_tokens(local):
    model, tokenizer = local
    prompts = [tokenizer.encode(q * 3) for q in QUESTIONS]
    alone = [run_engine(Engine(model, tokenizer, max_batch=4, num_blocks=64), [p], 40)[0] for p in prompts]
    small = Engine(model, tokenizer, max_batch=4, num_blocks=12, block_size=8)  # too few blocks for all four
    together = run_engine(small, prompts, 40)
    assert small.stats["preemptions"] > 0
    assert together == alone
    assert small.pool.in_use == 0


def test_a_full_queue_refuses_with_busy(local):
    model, tokenizer = local
    engine = Engine(model, tokenizer, max_batch=1, num_blocks=16, max_waiting=2)
    params = SamplingParams(max_tokens=2, temperature=0)
    engine.submit(Request([1, 2, 3], params, 2, lambda e: None))
    with pytest.raises(Busy, match="waiting"):
        engine.submit(Request([1, 2, 3], params, 1, lambda e: None))


def test_a_prompt_beyond_the_context_is_refused(local):
    model, tokenizer = local
    engine = Engine(model, tokenizer, max_batch=2, num_blocks=16, context=32)
    with pytest.raises(ValueError, match="context is 32 tokens"):
        engine.submit(Request(list(range(40)), SamplingParams(max_tokens=2), 1, lambda e: None))


def test_a_sequence_that_fills_the_pool_alone_ends_with_all_its_text(local):
    """Alone, it cannot be preempted for room: it ends with "length", and its client still gets
    every token's text (the detokenizer's held-back tail too) and the token count."""
    model, tokenizer = local
    engine = Engine(model, tokenizer, max_batch=1, num_blocks=5, block_size=4)  # 4 blocks: 16 tokens
    events = []
    prompt = tokenizer.encode("Emoji 🎉 and 中文")
    request = Request(prompt, SamplingParams(max_tokens=100, temperature=0), 1, events.append)
    engine.submit(request)
    while engine._inbox.qsize():
        engine.waiting.extend(engine._inbox.get().sequences)
    while not request.finished:
        engine.step()
    generated = request.sequences[0].generated
    # the pool holds 16 tokens' keys; the 17th was sampled, and had no room for its own
    assert len(prompt) + len(generated) == 17
    assert [e.finish_reason for e in events if e.kind == "finish"] == ["length"]
    assert "".join(e.text for e in events if e.kind == "delta") == tokenizer.decode(generated)
    assert events[-1].kind == "done" and events[-1].usage["completion_tokens"] == len(generated)
    assert engine.pool.in_use == 0


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmRSS")


def test_a_storm_of_requests_disconnects_and_bad_requests(tiny_chat_model):
    """Valid requests complete with their solo answers however many clients go away or send
    garbage beside them (sharing cached prefixes with them); the KV pool is back to cached blocks
    nobody holds; a second storm does not grow the server's memory."""
    from openai import AsyncOpenAI

    process, url = start_server(
        tiny_chat_model,
        "--max-batch",
        "8",
        "--kv-blocks",
        "64",
        "--max-waiting",
        "512",
        "--prefill-chunk",
        "16",
    )
    name = tiny_chat_model.name
    valid = [(QUESTIONS[i % 4], 4 + i % 7) for i in range(12)]

    async def storm(round_seed: int) -> list[str]:
        client = AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        rng = __import__("random").Random(round_seed)

        async def valid_request(question, n):
            reply = await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": question}], max_tokens=n, temperature=0
            )
            return reply.choices[0].message.content

        async def disconnecting():
            stream = await client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": QUESTIONS[1]}], max_tokens=100, stream=True
            )
            async for _ in stream:
                if rng.random() < 0.3:
                    break
            await stream.close()

        async def bad():
            try:
                await client.chat.completions.create(
                    model="nope", messages=[{"role": "user", "content": "x"}]
                )
            except Exception as error:  # the client raises the 404 as an exception
                return type(error).__name__
            return "accepted"

        tasks = (
            [valid_request(q, n) for q, n in valid]
            + [disconnecting() for _ in range(12)]
            + [bad() for _ in range(6)]
        )
        rng.shuffle(tasks)
        results = await asyncio.gather(*tasks)
        await client.close()
        return results

    try:
        expected = [chat_answer(url, name, q, n) for q, n in valid]
        first = asyncio.run(storm(1))
        memory = rss_bytes(process.pid)
        second = asyncio.run(storm(2))
        for results in (first, second):
            answers = [r for r in results if isinstance(r, str) and r not in ("NotFoundError", "accepted")]
            assert sorted(answers) == sorted(expected)
            assert results.count("NotFoundError") == 6
        deadline = time.monotonic() + 10
        while metrics(url)["flashformer_kv_blocks_in_use"] > 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        # back to cached blocks that nobody holds: the repeated questions' prefixes
        assert metrics(url)["flashformer_kv_blocks_in_use"] == 0
        assert metrics(url)["flashformer_kv_blocks_cached"] > 0
        assert metrics(url)["flashformer_sequences_waiting"] == 0
        assert rss_bytes(process.pid) < memory * 1.1, "the server's memory grew over the second storm"
    finally:
        process.terminate()
        process.wait(timeout=30)


def chat_answer(url: str, name: str, question: str, max_tokens: int) -> str:
    from openai import OpenAI

    reply = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0).chat.completions.create(
        model=name, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0
    )
    return reply.choices[0].message.content


@pytest.mark.parametrize("native", [True, False], ids=["native", "eager"])
def test_a_quantized_model_decodes_only_its_rows_and_stays_invariant(tiny_chat_model, native):
    """With rows computed alone (the native decoder; eagerly, every matmul a quantized kernel), a
    step is one packed forward of decode tokens and prompt chunks, and a request's tokens are
    still the same alone, among others, with other chunk sizes and through preemptions."""
    model, tokenizer = flashformer.load(tiny_chat_model, quantize="int4")
    prompts = [tokenizer.encode(q * (1 + i % 3)) for i, q in enumerate(QUESTIONS * 2)]
    engine = Engine(model, tokenizer, max_batch=8, num_blocks=96, native=native)
    assert not engine.pad_decode and (engine.runner.native is not None) == native
    alone = [
        run_engine(Engine(model, tokenizer, max_batch=8, num_blocks=96, native=native), [p], 24)[0]
        for p in prompts
    ]
    assert run_engine(engine, prompts, 24) == alone
    assert engine.stats["steps"] < sum(len(a) for a in alone)  # decode tokens of several sequences per step
    other_chunks = Engine(
        model, tokenizer, max_batch=8, num_blocks=96, prefill_chunk=8, prefill_budget=16, native=native
    )
    assert run_engine(other_chunks, prompts, 24) == alone
    small = Engine(
        model, tokenizer, max_batch=8, num_blocks=14, block_size=8, native=native
    )  # too few blocks
    assert run_engine(small, prompts, 24) == alone
    assert small.stats["preemptions"] > 0 and small.pool.in_use == 0
    float_model, _ = flashformer.load(tiny_chat_model)
    assert not Engine(float_model, tokenizer, max_batch=8, num_blocks=96).pad_decode  # native
    assert Engine(float_model, tokenizer, max_batch=8, num_blocks=96, native=False).pad_decode


@pytest.mark.parametrize("native", [True, False], ids=["native", "eager"])
def test_plain_greedy_rows_are_chosen_together_and_every_other_setting_still_applies(tiny_chat_model, native):
    """A step's rows whose next token is the plain argmax (greedy, no processor that changes a
    score: engine._plain) are chosen in one call for all of them; beside them, rows with a
    logit_bias, min_tokens, logprobs or sampling go through their own settings. Each request
    gets generate()'s tokens for its settings, and the same tokens alone or among the others."""
    model, tokenizer = flashformer.load(tiny_chat_model, quantize="int4")
    prompts = [tokenizer.encode(q) for q in QUESTIONS]
    eos = tokenizer.stop_token_ids
    first = model.generate(torch.tensor([prompts[1]]), max_new_tokens=1, eos_token_id=eos)[0, -1].item()
    settings = [
        dict(temperature=0),
        dict(temperature=0, logit_bias=((first, -100.0),)),  # bans the plain answer's first token
        dict(temperature=0, min_tokens=12),
        dict(temperature=0, logprobs=2),
        dict(temperature=0.8, seed=5),
        dict(temperature=0),
    ]
    jobs = [
        (prompts[i % len(prompts)], SamplingParams(max_tokens=12, stop_token_ids=tuple(eos), **given))
        for i, given in enumerate(settings)
    ]
    jobs[1] = (prompts[1], jobs[1][1])

    def engine() -> Engine:
        return Engine(model, tokenizer, max_batch=8, num_blocks=96, native=native)

    together = run_requests(engine(), jobs)
    alone = [run_requests(engine(), [job])[0] for job in jobs]
    assert [(f["tokens"], f["logprobs"]) for f in together] == [(f["tokens"], f["logprobs"]) for f in alone]
    for (prompt, params), found in zip(jobs, together):
        if params.temperature:
            continue
        reference = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            eos_token_id=eos,
            logit_bias=dict(params.logit_bias) or None,
            min_new_tokens=params.min_tokens,
        )[0, len(prompt) :].tolist()
        assert found["tokens"] == reference and len(found["tokens"]) >= params.min_tokens
    assert together[1]["tokens"][0] != first  # the bias was applied
    assert [entry[0] for entry in together[3]["logprobs"]] == together[3]["tokens"]
    assert all(len(top) == 2 for _, _, top in together[3]["logprobs"])
