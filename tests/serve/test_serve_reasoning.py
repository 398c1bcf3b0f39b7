"""--reasoning-parser through the three APIs, on a qwen3 GGUF file made here whose template
thinks as Qwen3's does and whose weights are scripted (helpers/thinking.py): greedy, it writes
"<think>hm</think>ok", and "ok" after enable_thinking=false's empty think block. The expected
parts are the script's, written out; constrained answers are checked with `jsonschema`, and the
reasoning must stay the script's own (free text, no grammar) while the answer is held."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from helpers.thinking import ANSWER, REASONING, thinking_qwen3_gguf
from test_serve import KEY, openai_client, serving

NAME = "thinking-qwen3"
HELLO = [{"role": "user", "content": "Hello there"}]
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = thinking_qwen3_gguf(tmp_path_factory.mktemp("thinking"))
    with serving(path, "--quantize", "gguf", "--api-key", KEY, "--reasoning-parser", "qwen3",
                 "--max-batch", "4", "--kv-blocks", "128", "--no-webui") as url:  # fmt: skip
        yield url


@pytest.fixture(scope="module")
def gpt(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


def chat(gpt, **kwargs):
    return gpt.chat.completions.create(
        model=NAME, messages=HELLO, temperature=0, **{"max_tokens": 20, **kwargs}
    )


def test_chat_splits_reasoning_content_whole_and_streamed(gpt):
    message = chat(gpt).choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, ANSWER)
    reasoning, content = "", ""
    for chunk in chat(gpt, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == (REASONING, ANSWER)


def test_enable_thinking_off_reaches_the_template(gpt):
    message = chat(gpt, extra_body=OFF).choices[0].message
    assert (message.reasoning_content, message.content) == (None, ANSWER)


def test_a_schema_holds_the_answer_not_the_reasoning(gpt):
    """Under the grammar from the first token the script's <think> could not be written; here
    the reasoning is the script's and the answer validates."""
    schema = {"type": "object", "properties": {"word": {"enum": ["yes", "no"]}}, "required": ["word"],
              "additionalProperties": False}  # fmt: skip
    format = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    for extra in ({}, OFF):
        reply = chat(gpt, response_format=format, max_tokens=40, extra_body=extra).choices[0]
        assert reply.finish_reason == "stop"
        assert reply.message.reasoning_content == (REASONING if not extra else None)
        jsonschema.validate(json.loads(reply.message.content), schema)


def test_a_forced_call_follows_the_reasoning(gpt):
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}  # fmt: skip
    reply = chat(
        gpt, tools=[tool], tool_choice={"type": "function", "function": {"name": "pick"}}, max_tokens=60
    )
    message = reply.choices[0].message
    assert message.reasoning_content == REASONING and reply.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_messages_answer_thinking_blocks(claude):
    kwargs = dict(model=NAME, max_tokens=20, messages=HELLO, extra_body={"temperature": 0})
    message = claude.messages.create(**kwargs)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", REASONING), ("text", ANSWER)]  # fmt: skip
    with claude.messages.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert [b.model_dump(exclude={"signature"}) for b in streamed.content] == [
        b.model_dump(exclude={"signature"}) for b in message.content]  # fmt: skip
    assert events.count("content_block_start") == 2
    off = claude.messages.create(thinking={"type": "disabled"}, **kwargs)
    assert [b.type for b in off.content] == ["text"] and off.content[0].text == ANSWER


def test_a_thinking_budget_ends_the_reasoning(claude):
    message = claude.messages.create(model=NAME, max_tokens=20, messages=HELLO, extra_body={"temperature": 0},
                                     thinking={"type": "enabled", "budget_tokens": 1})  # fmt: skip
    blocks = {b.type: (getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content}
    assert blocks == {"thinking": REASONING[:1], "text": ANSWER}


def test_responses_answer_a_reasoning_item(gpt):
    response = gpt.responses.create(model=NAME, input="Hello there", max_output_tokens=20, temperature=0)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == REASONING and response.output_text == ANSWER
    events = list(gpt.responses.create(model=NAME, input="Hello there", max_output_tokens=20, temperature=0,
                                       stream=True))  # fmt: skip
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, said) == (REASONING, ANSWER)
