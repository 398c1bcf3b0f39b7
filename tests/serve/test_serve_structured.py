"""Structured outputs through the server, with the real `openai` client: response_format
(json_object, json_schema, pydantic models through parse()), vLLM's structured_outputs and
guided_* fields, refusals by name, and batch invariance with constrained and free requests
mixed. Every finished answer is checked by an independent reference: `jsonschema`, Python's
`re`, pydantic, the option list. The model is the servers tests' tiny random LLaMA: whatever
it prefers, the grammar must hold it; the slow suite runs SmolLM2 itself."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import jsonschema
import pytest
from helpers.engine import run_requests
from helpers.schemas import schema_suite
from pydantic import BaseModel, Field
from test_serve import KEY, http, openai_client, serving, tiny_chat_model  # noqa: F401 (a fixture)

import flashformer
from flashformer.generate.constraints import Constraint
from flashformer.serve.engine import Engine
from flashformer.serve.request import SamplingParams


@pytest.fixture(scope="module")
def server(tiny_chat_model):  # noqa: F811
    with serving(tiny_chat_model, "--api-key", KEY, "--max-batch", "16", "--kv-blocks", "256") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def ask(client, content: str = "Answer as JSON.", **kwargs):
    name = client.models.list().data[0].id
    return client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": content}], **kwargs
    )


def check_answers(replies, schema: dict, max_tokens: int) -> int:
    """Every "stop" answer validates; a "length" one was cut at max_tokens. How many stopped."""
    stopped = 0
    for reply in replies:
        choice = reply.choices[0]
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
            stopped += 1
        else:
            assert choice.finish_reason == "length" and reply.usage.completion_tokens == max_tokens, reply
    return stopped


# ---- OpenAI's response_format ----


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "owl"]
    age: int = Field(ge=0, le=30)


class Owner(BaseModel):
    name: str = Field(max_length=10)
    pets: list[Pet] = Field(min_length=1, max_length=2)
    verified: bool


@pytest.mark.parametrize("temperature", [0, 1])
def test_parse_with_a_pydantic_model_returns_valid_objects(client, temperature):
    name = client.models.list().data[0].id
    completion = client.beta.chat.completions.parse(
        model=name,
        messages=[{"role": "user", "content": "Describe a pet owner."}],
        response_format=Owner,
        max_tokens=200,
        temperature=temperature,
        seed=1,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop", message.content
    assert isinstance(message.parsed, Owner)
    assert Owner.model_validate_json(message.content) == message.parsed


def test_json_object_and_streamed_json_schema(client):
    reply = ask(client, response_format={"type": "json_object"}, max_tokens=60, temperature=0)
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    schema = Pet.model_json_schema()
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "pet", "schema": schema, "strict": True},
    }
    plain = ask(client, response_format=response_format, max_tokens=80, temperature=0)
    stream = ask(client, response_format=response_format, max_tokens=80, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == plain.choices[0].message.content
    check_answers([plain], schema, 80)


SUITE = schema_suite(100)


@pytest.mark.parametrize("temperature", [0, 1])
def test_a_handful_of_generated_schemas_validate(server, client, temperature):
    name = client.models.list().data[0].id
    schemas = SUITE[:6]
    replies = asyncio.run(ask_all(server, name, schemas, temperature, max_tokens=160))
    stopped = sum(check_answers([r], s, 160) for r, s in zip(replies, schemas))
    assert stopped >= len(schemas) // 2  # bounded schemas: most answers end on their own


async def ask_all(
    url: str, name: str, schemas: list[dict], temperature: float, max_tokens: int, clients=16, show=False
):
    """One chat request per schema, `clients` at a time (the real AsyncOpenAI client); show: the
    schema is written in the prompt too (for a real model; the tiny one's context is short)."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=600)
    gate = asyncio.Semaphore(clients)

    async def one(i: int, schema: dict):
        async with gate:
            return await client.chat.completions.create(
                model=name,
                messages=[
                    {
                        "role": "user",
                        "content": "Answer in JSON" + (f": {json.dumps(schema)}" if show else "."),
                    }
                ],
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}},
                max_tokens=max_tokens,
                temperature=temperature,
                seed=i,
            )

    return await asyncio.gather(*(one(i, s) for i, s in enumerate(schemas)))


# ---- vLLM's fields ----


def test_vllm_fields(client):
    regex = r"[a-c]{2}-[0-9]{3}"
    for extra in ({"structured_outputs": {"regex": regex}}, {"guided_regex": regex}):
        text = ask(client, max_tokens=20, temperature=0, extra_body=extra).choices[0].message.content
        assert re.fullmatch(regex, text), (extra, text)
    options = ["positive", "negative"]
    for extra in ({"structured_outputs": {"choice": options}}, {"guided_choice": options}):
        reply = ask(client, max_tokens=20, temperature=1, extra_body=extra)
        assert reply.choices[0].message.content in options and reply.choices[0].finish_reason == "stop"
    grammar = 'root ::= "n=" [1-9] [0-9]? ";"'
    text = ask(client, max_tokens=20, extra_body={"guided_grammar": grammar}).choices[0].message.content
    assert re.fullmatch(r"n=[1-9][0-9]?;", text), text
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    name = client.models.list().data[0].id
    completion = client.completions.create(
        model=name, prompt="JSON:", max_tokens=30, temperature=0, extra_body={"guided_json": schema}
    )
    assert completion.choices[0].finish_reason == "stop"
    assert json.loads(completion.choices[0].text) in ({"ok": True}, {"ok": False})


REFUSED = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"uniqueItems": True}},
            }
        },
        "uniqueItems",
    ),
    ({"guided_json": {"type": "object", "not": {"required": ["a"]}}}, "'not'"),
    ({"guided_regex": "[0-9]+", "guided_choice": ["a"]}, "one structured output at a time"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag is not supported"),
    ({"response_format": {"type": "grammar"}}, "response_format.type 'grammar'"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "must be an object with a schema",
    ),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
]


@pytest.mark.parametrize("fields, message", REFUSED, ids=[m for _, m in REFUSED])
def test_what_cannot_be_enforced_is_refused_by_name(server, tiny_chat_model, fields, message):  # noqa: F811
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    body = {"model": tiny_chat_model.name, "messages": [{"role": "user", "content": "x"}], **fields}
    code, text = http("POST", server + "/v1/chat/completions", json.dumps(body).encode(), headers)
    assert code == 400, text
    assert message in json.loads(text)["error"]["message"]


# ---- batch invariance: constrained and free requests mixed ----


def run_mixed(
    engine: Engine, work: list[tuple[list[int], Constraint | None]], max_tokens: int
) -> list[list[int]]:
    jobs = [
        (prompt, SamplingParams(max_tokens=max_tokens, temperature=0, constraint=constraint))
        for prompt, constraint in work
    ]
    return [found["tokens"] for found in run_requests(engine, jobs)]


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_constrained_and_free_requests_mixed_each_equal_their_solo_answer(tiny_chat_model, quantize):  # noqa: F811
    model, tokenizer = flashformer.load(tiny_chat_model, quantize=quantize)
    vocab = model.config.vocab_size
    constraints = [
        Constraint.json_schema(SUITE[0], tokenizer, vocab),
        None,
        Constraint.regex(r"[0-9]{2,5}", tokenizer, vocab),
        Constraint.choice(["left", "right"], tokenizer, vocab),
        None,
    ]
    questions = ["Hello!", "Name three colors.", "What is 2 + 2?", "Which way?", "Why?"]
    work = [(tokenizer.encode(q), c) for q, c in zip(questions, constraints)]
    alone = [run_mixed(Engine(model, tokenizer, max_batch=8, num_blocks=64), [w], 16)[0] for w in work]
    small = Engine(model, tokenizer, max_batch=8, num_blocks=9, block_size=8)  # too few: preemptions
    assert run_mixed(small, work, 16) == alone
    assert small.stats["preemptions"] > 0
    assert re.fullmatch(r"[0-9]{2,5}", tokenizer.decode(alone[2]))
    assert tokenizer.decode(alone[3]) in ("left", "right")


# ---- the whole suite on SmolLM2 ----


@pytest.mark.slow  # 200 answers of SmolLM2 (Q4_1, the file's own blocks) on 2 cores
def test_the_suite_of_a_hundred_schemas_on_smollm2():
    from flashformer.checkpoints.gguf.packaged_models import smollm2_path

    with serving(smollm2_path(), "--quantize", "gguf", "--api-key", KEY, "--max-batch", "16") as url:
        name = json.loads(http("GET", url + "/v1/models", None, {"Authorization": f"Bearer {KEY}"})[1])[
            "data"
        ][0]["id"]
        for temperature in (0, 1):
            replies = asyncio.run(ask_all(url, name, SUITE, temperature, max_tokens=256, show=True))
            stopped = sum(check_answers([r], s, 256) for r, s in zip(replies, SUITE))
            assert stopped >= 90, f"only {stopped} of 100 answers ended at temperature {temperature}"
