"""SmolLM3's chat, end to end in the text room: a template of SmolLM3's shape (its reasoning mode
from enable_thinking or a /think, /no_think flag in the system message, the flag taken out of the
instructions, an empty <think></think> closing the reasoning in /no_think mode, tools listed in
<tools> with calls asked for in <tool_call> tags, tool results as user turns, {% generation %}
around the assistant's turns) renders as transformers renders it; the server's helpers read it as
SmolLM3 needs (it knows tools, teaches the hermes format, and its /no_think prompt starts the
answer); and an answer's reasoning and <tool_call> blocks come apart into reasoning, content and
tool_calls. The template (helpers/dense_2026.py) is written after SmolLM3's, not copied."""

from __future__ import annotations

import json

import pytest
from helpers.dense_2026 import SMOLLM3_SHAPED, TOOLS

from flashformer.text.chat_template import render_chat_template
from flashformer.text.reasoning import reasoning_start, split_reasoning
from flashformer.text.tool_calls import format_of_template, parse_tool_calls
from flashformer.text.tool_prompt import template_knows_tools, with_call_arguments_as_objects

CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me look."},
    {"role": "tool", "content": '{"celsius": 21}'},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.fixture(scope="module")
def theirs():
    """transformers' renderer: a tokenizer's apply_chat_template (its vocabulary plays no part)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=SMOLLM3_SHAPED)


@pytest.mark.parametrize(
    "system, variables",
    [
        (None, {}),
        (None, {"enable_thinking": False}),
        ("Answer briefly. /no_think", {}),
        ("/think Answer briefly.", {"enable_thinking": False}),
    ],
)
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_renders_as_transformers(theirs, system, variables, tools):
    messages = ([{"role": "system", "content": system}] if system else []) + CHAT
    expected = theirs.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **variables
    )
    assert render_chat_template(SMOLLM3_SHAPED, messages, True, tools=tools, **variables) == expected


def test_the_server_reads_it_as_smollm3_needs():
    """It knows tools (its {% generation %} tags parse), teaches hermes, and the prompt's end says
    where the answer starts: /no_think closed the reasoning, /think lets the model open it."""
    assert template_knows_tools(SMOLLM3_SHAPED)
    assert format_of_template(SMOLLM3_SHAPED) == "hermes"
    no_think = render_chat_template(SMOLLM3_SHAPED, CHAT, True, enable_thinking=False)
    think = render_chat_template(SMOLLM3_SHAPED, [{"role": "system", "content": "/think"}, *CHAT], True)
    assert reasoning_start("qwen3", no_think[-200:]) == "answer"
    assert reasoning_start("qwen3", think[-200:]) == "before"


def test_an_answer_comes_apart_into_reasoning_content_and_tool_calls():
    answer = (
        "<think>\nThe user wants a forecast.\n</think>\nChecking.\n<tool_call>\n"
        '{"name": "weather", "arguments": {"city": "Paris", "day": "tomorrow"}}\n</tool_call>'
    )
    reasoning, rest = split_reasoning(answer, "qwen3", "before")
    content, calls = parse_tool_calls(rest, "hermes")
    assert reasoning == "The user wants a forecast."
    assert content == "Checking."
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [
        ("weather", {"city": "Paris", "day": "tomorrow"})
    ]
    # and back into the history: the calls' arguments as objects for the template
    history = with_call_arguments_as_objects(
        [{"role": "assistant", "content": content, "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "weather", "arguments": calls[0].arguments}}
        ]}]
    )  # fmt: skip
    assert history[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "day": "tomorrow"}
