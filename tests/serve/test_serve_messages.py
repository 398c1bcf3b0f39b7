"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) with the real `anthropic`
SDK, against the real SmolLM2-135M-Instruct Q4_1 file served with --quantize gguf (one server
for the module). The references are independent of the translation: the same conversation
asked through /v1/chat/completions with the real `openai` client (greedy: the same tokens),
`jsonschema` for a forced call's input, and the raw event stream read with the standard
library (the order Anthropic's documentation gives)."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest
from test_serve import KEY, http, openai_client, serving

from flashformer.checkpoints.gguf.packaged_models import smollm2_path

NAME = "SmolLM2-135M-Instruct.Q4_1"
GREEDY = {"temperature": 0}  # the newest SDK takes sampling settings only as body fields
SYSTEM = "You are a concise assistant."
QUESTION = "What is the capital of France? Answer in one sentence."
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city now",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}


@pytest.fixture(scope="module")
def server():
    with serving(smollm2_path(), "--quantize", "gguf", "--api-key", KEY, "--max-batch", "4",
                 "--kv-blocks", "256", "--no-webui") as url:  # fmt: skip
        yield url


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def gpt(server):
    return openai_client(server)


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_greedy_message_equals_the_chat_answer(claude, gpt):
    """The same system prompt and question, greedy: the same text, token counts and ending."""
    message = claude.messages.create(
        model=NAME, max_tokens=40, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}],
        extra_body=GREEDY,
    )  # fmt: skip
    chat = gpt.chat.completions.create(
        model=NAME, max_tokens=40, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
    )  # fmt: skip
    assert text_of(message) == chat.choices[0].message.content and text_of(message)
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    expected = {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert message.stop_reason == expected and message.id.startswith("msg_") and message.model == NAME


def test_system_blocks_and_text_blocks_read_as_the_string_forms(claude):
    """System text blocks (cache_control included) and a user's text block give the prompt and
    the answer of the plain strings."""
    plain = claude.messages.create(model=NAME, max_tokens=12, system=SYSTEM,
                                   messages=[{"role": "user", "content": QUESTION}], extra_body=GREEDY)  # fmt: skip
    blocks = claude.messages.create(
        model=NAME, max_tokens=12,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION, "cache_control": {"type": "ephemeral"}}]}],
        extra_body=GREEDY,
    )  # fmt: skip
    assert text_of(blocks) == text_of(plain)
    total = lambda m: m.usage.input_tokens + m.usage.cache_read_input_tokens  # noqa: E731
    assert total(blocks) == total(plain)


def test_streamed_equals_whole(claude):
    kwargs = dict(model=NAME, max_tokens=30, messages=[{"role": "user", "content": "Name three colors."}],
                  extra_body=GREEDY)  # fmt: skip
    whole = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        pieces = [text for text in stream.text_stream]
        streamed = stream.get_final_message()
    assert "".join(pieces) == text_of(whole) == text_of(streamed)
    assert len(pieces) > 1  # it came in pieces
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_the_event_stream_has_anthropics_order(server):
    """Read with the standard library: message_start, ping, one text block (start, deltas,
    stop), message_delta with the stop reason and usage, message_stop."""
    body = {"model": NAME, "max_tokens": 8, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello!"}]}  # fmt: skip
    code, text = http("POST", server + "/v1/messages", json.dumps(body).encode(),
                      {"x-api-key": KEY, "content-type": "application/json"})  # fmt: skip
    assert code == 200
    events = [block.split("\n") for block in text.strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in events]
    payloads = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert all(p["type"] == n for n, p in zip(names, payloads))
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert payloads[2]["content_block"] == {"type": "text", "text": ""}
    assert all(p["delta"]["type"] == "text_delta" for p in payloads[3:-3])
    assert (
        payloads[-2]["delta"]["stop_reason"] == "max_tokens" and payloads[-2]["usage"]["output_tokens"] == 8
    )


def test_count_tokens_equals_the_usage(claude):
    kwargs = dict(model=NAME, system=SYSTEM, tools=[WEATHER],
                  messages=[{"role": "user", "content": "What is the weather in Paris?"}])  # fmt: skip
    counted = claude.messages.count_tokens(**kwargs)
    message = claude.messages.create(max_tokens=4, extra_body=GREEDY, **kwargs)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert counted.input_tokens > 50  # the tools are in the prompt


def test_stop_sequences_end_the_text_and_are_named(claude):
    whole = claude.messages.create(model=NAME, max_tokens=30, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Name three colors."}])  # fmt: skip
    text = text_of(whole)
    stop = text.split()[2]  # a word the answer writes
    stopped = claude.messages.create(model=NAME, max_tokens=30, stop_sequences=[stop], extra_body=GREEDY,
                                     messages=[{"role": "user", "content": "Name three colors."}])  # fmt: skip
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert text_of(stopped) == text[: text.index(stop)]


def test_a_forced_tool_use_validates_and_its_result_goes_back(claude, gpt):
    """tool_choice {"type": "tool"}: a tool_use whose input validates against input_schema
    (streamed: the input_json_delta pieces join to it); then the tool_result round trip, whose
    answer equals the chat API's for the same history."""
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = dict(model=NAME, max_tokens=60, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
                  messages=question, extra_body=GREEDY)  # fmt: skip
    message = claude.messages.create(**forced)
    assert message.stop_reason == "tool_use"
    (call,) = [block for block in message.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with claude.messages.stream(**forced) as stream:
        streamed = stream.get_final_message()
    (streamed_call,) = [block for block in streamed.content if block.type == "tool_use"]
    assert streamed_call.input == call.input and streamed.stop_reason == "tool_use"

    history = question + [
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": '{"temperature": 21}'}]},
    ]  # fmt: skip
    answer = claude.messages.create(
        model=NAME, max_tokens=30, tools=[WEATHER], messages=history, extra_body=GREEDY
    )
    chat_history = question + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]  # fmt: skip
    tool = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                              "parameters": WEATHER["input_schema"]}}  # fmt: skip
    chat = gpt.chat.completions.create(
        model=NAME, max_tokens=30, temperature=0, tools=[tool], messages=chat_history
    )
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert text_of(answer) == (chat.choices[0].message.content or "")


def test_tool_choice_any_calls_a_tool(claude):
    message = claude.messages.create(model=NAME, max_tokens=60, tools=[WEATHER], tool_choice={"type": "any"},
                                     messages=[{"role": "user", "content": "Weather in Rome?"}], extra_body=GREEDY)  # fmt: skip
    calls = [block for block in message.content if block.type == "tool_use"]
    assert calls and message.stop_reason == "tool_use"
    for call in calls:
        jsonschema.validate(call.input, WEATHER["input_schema"])


# A request in the shape Claude Code sends (reconstructed from its documented traffic, the long
# texts shortened): system blocks with cache_control, tool definitions with JSON schemas, the
# last user block marked for caching, metadata.user_id, stream: true, its beta headers.
CLAUDE_CODE_REQUEST = {
    "model": NAME,
    "max_tokens": 32000,
    "stream": True,
    "temperature": 1,
    "metadata": {"user_id": "user_0f3a_account__session_5c2e"},
    "system": [
        {
            "type": "text",
            "text": "You are Claude Code, Anthropic's official CLI for Claude.",
            "cache_control": {"type": "ephemeral"},
        },
        {
            "type": "text",
            "text": "You are an interactive CLI tool that helps users with software engineering "
            "tasks.\n\n# Tone and style\nBe concise.",
            "cache_control": {"type": "ephemeral"},
        },
    ],  # fmt: skip
    "tools": [
        {
            "name": "Bash",
            "description": "Executes a given bash command.",
            "input_schema": {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "The command to execute"},
                    "timeout": {"type": "number"},
                    "description": {"type": "string"},
                },
                "required": ["command"],
                "additionalProperties": False,
            },
        },
        {
            "name": "Read",
            "description": "Reads a file from the local filesystem.",
            "input_schema": {
                "$schema": "http://json-schema.org/draft-07/schema#",
                "type": "object",
                "properties": {
                    "file_path": {"type": "string"},
                    "offset": {"type": "number"},
                    "limit": {"type": "number"},
                },
                "required": ["file_path"],
                "additionalProperties": False,
            },
            "cache_control": {"type": "ephemeral"},
        },
    ],  # fmt: skip
    "messages": [
        {
            "role": "user",
            "content": [
                {
                    "type": "text",
                    "text": "<system-reminder>\nAs you answer the user's questions, you can use "
                    "the following context.\n</system-reminder>",
                },
                {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ],  # fmt: skip
}
CLAUDE_CODE_HEADERS = {
    "content-type": "application/json",
    "x-api-key": KEY,
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14",
    "user-agent": "claude-cli/2.0.0 (external, cli)",
}


def test_a_claude_code_request_is_answered(server):
    """200 and Anthropic's stream; read until the first text or tool block's delta, then the
    connection is closed (its max_tokens would run to the context's end)."""
    import http.client
    from urllib.parse import urlparse

    where = urlparse(server)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=120)
    connection.request("POST", "/v1/messages", json.dumps(CLAUDE_CODE_REQUEST), CLAUDE_CODE_HEADERS)
    reply = connection.getresponse()
    assert reply.status == 200 and reply.getheader("content-type").startswith("text/event-stream")
    seen = []
    while "content_block_delta" not in seen:
        line = reply.readline().decode()
        assert line, f"the stream ended after {seen}"
        if line.startswith("event: "):
            seen.append(line.removeprefix("event: ").strip())
    connection.close()
    assert seen[:3] == ["message_start", "ping", "content_block_start"]


@pytest.mark.parametrize(
    "change, status, kind, named",
    [
        ({"model": "claude-sonnet-4-5"}, 404, "not_found_error", "claude-sonnet-4-5"),
        ({"container": "abc"}, 400, "invalid_request_error", "container"),
        ({"max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
        ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
         "invalid_request_error", "messages.0.content.0.type"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error", "reasoning-parser"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error", "tools.0"),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]}, 400,
         "invalid_request_error", "prefill"),
        ({"output_config": {"effort": "high"}}, 400, "invalid_request_error", "output_config.effort"),
    ],
)  # fmt: skip
def test_bad_requests_get_anthropic_errors(server, change, status, kind, named):
    body = {"model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], **change}
    code, text = http("POST", server + "/v1/messages", json.dumps(body).encode(),
                      {"x-api-key": KEY, "content-type": "application/json"})  # fmt: skip
    error = json.loads(text)
    assert code == status and error["type"] == "error" and error["error"]["type"] == kind, text
    assert named in error["error"]["message"]


def test_the_api_key_is_read_from_x_api_key_or_bearer(server, claude):
    wrong = anthropic.Anthropic(base_url=server, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        wrong.messages.create(model=NAME, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=server, auth_token=KEY, max_retries=0)  # Authorization: Bearer
    assert (
        bearer.messages.count_tokens(model=NAME, messages=[{"role": "user", "content": "Hi"}]).input_tokens
        > 0
    )


def test_output_config_format_constrains_the_answer(claude):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}  # fmt: skip
    message = claude.messages.create(model=NAME, max_tokens=40, messages=[{"role": "user", "content": QUESTION}],
                                     extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}},
                                                 **GREEDY})  # fmt: skip
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(text_of(message)), schema)
