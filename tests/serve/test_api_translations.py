"""The Messages and Responses bodies as chat requests, in-process (no model): each case's chat
messages are written out by hand from Anthropic's and OpenAI's documentation of the fields."""

from __future__ import annotations

import pytest

from flashformer.serve.anthropic.protocol import MessagesRequest, chat_request
from flashformer.serve.http.protocol import APIError
from flashformer.serve.openai.responses_api import _input_messages

TOOL = {"name": "get_weather", "description": "d", "input_schema": {"type": "object", "properties": {}}}


def chat_of(**body):
    translation = chat_request(
        MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **body}), thinks=True
    )
    return translation, [m.model_dump(exclude_none=True) for m in translation.chat.messages]


def test_a_tool_conversation_becomes_chat_messages():
    translation, messages = chat_of(
        system=[{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "B"}],
        tools=[TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "look it up", "signature": "x"},
                {"type": "text", "text": "Let me see."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "21 C"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "down", "is_error": True},
                {"type": "text", "text": "Thanks"}]},
        ],
    )  # fmt: skip
    assert messages == [
        {"role": "system", "content": "A\n\nB"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me see."}], "reasoning_content": "look it up",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: down"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
    ]  # fmt: skip
    chat = translation.chat
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False and translation.one_call
    assert chat.tools[0].function.parameters == TOOL["input_schema"]


@pytest.mark.parametrize(
    "thinking, kwargs, budget",
    [
        ({"type": "disabled"}, {"enable_thinking": False}, None),
        ({"type": "adaptive"}, {"enable_thinking": True}, None),
        ({"type": "enabled", "budget_tokens": 5}, {"enable_thinking": True}, 5),
    ],
)
def test_thinking_reaches_the_template_and_the_budget(thinking, kwargs, budget):
    translation, _ = chat_of(thinking=thinking, messages=[{"role": "user", "content": "Hi"}])
    assert translation.chat.chat_template_kwargs == kwargs and translation.budget == budget


@pytest.mark.parametrize(
    "body, named",
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 8}}, "thinking.budget_tokens"),  # not below max_tokens
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "citations": [{"a": 1}]}]}]},
         "messages.0.content.0.citations"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages.0.content.0.type"),
        ({"messages": [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
                       {"role": "user", "content": "Hi"}]}, "messages.0.content.0.type"),
        ({"stop_sequences": [""]}, "stop_sequences.0"),
        ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_named(body, named):
    body = {"messages": [{"role": "user", "content": "Hi"}], **body}
    with pytest.raises(APIError) as refused:
        chat_of(**body)
    assert refused.value.status == 400 and refused.value.param == named, refused.value.message


def test_no_effect_fields_are_accepted():
    translation, messages = chat_of(metadata={"user_id": "u"}, service_tier="auto", cache_control={"type": "ephemeral"},
                                    messages=[{"role": "user", "content": "Hi"}])  # fmt: skip
    assert messages == [{"role": "user", "content": "Hi"}]


def test_response_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "call it"}],
        },
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is 21 C.", "annotations": []}]},
    ]
    assert _input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "call it", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "assistant", "content": "It is 21 C."},
    ]  # fmt: skip
