"""flashformer.text.tool_prompt: a conversation with tools, calls and results renders as
transformers' apply_chat_template renders it, for templates in the styles of Qwen2.5 (Hermes
tags) and Llama 3.1 (JSON with "parameters") written here; SmolLM2's template, which has no
tools, gets the generic format."""

from __future__ import annotations

import json

import pytest
from helpers.gguf import smollm2_tokenizer

from flashformer.text.tool_calls import format_of_template, parse_tool_calls
from flashformer.text.tool_prompt import (
    generic_tool_messages,
    template_knows_tools,
    with_call_arguments_as_objects,
)

QWEN25_STYLE = """{%- if tools %}
{{- '<|im_start|>system\\n' + (messages[0].content if messages[0].role == 'system' else 'You are helpful.') }}
{{- '\\n\\n# Tools\\n\\nFunctions you may call, within <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}
{%- endfor %}
{{- '\\n</tools>\\n\\nFor each call, answer with a JSON object within <tool_call></tool_call> tags:\\n' }}
{{- '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls %}
{%- set call = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' + (call.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

LLAMA31_STYLE = """{{- bos_token }}
{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}{%- set messages = messages[1:] %}
{%- else %}{%- set system = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- system + '<|eot_id|>' }}
{%- for message in messages %}
{%- if loop.first and tools is not none and message.role == 'user' %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven these functions, answer with a call as JSON '
    '{"name": function name, "parameters": dictionary of arguments}.\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) + '\\n\\n' }}{%- endfor %}
{{- message.content + '<|eot_id|>' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- set call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + call.name + '", "parameters": ' }}
{{- call.arguments | tojson + '}<|eot_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city now — in °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]

# OpenAI's shapes: arguments as JSON text, results in role "tool"
ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    {"role": "user", "content": "And should I take a coat?"},
]


@pytest.fixture(scope="module")
def ours():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def theirs(ours, tmp_path_factory):
    """transformers' tokenizer of the same files (saved as an HF folder: quicker to read than the GGUF)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    ours.save(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.parametrize("template", [QWEN25_STYLE, LLAMA31_STYLE], ids=["qwen2.5", "llama3.1"])
def test_tools_and_history_render_as_transformers(ours, theirs, template):
    assert template_knows_tools(template)
    messages = with_call_arguments_as_objects(ROUND_TRIP)
    assert ROUND_TRIP[2]["tool_calls"][0]["function"]["arguments"].startswith("{")  # not changed in place
    kwargs = {"chat_template": template, "tools": TOOLS, "add_generation_prompt": True}
    text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text == theirs.apply_chat_template(messages, tokenize=False, **kwargs)
    # the call in the history is written once, as an object (OpenAI's text would be quoted again)
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in text or (
        '"parameters": {"city": "Paris", "unit": "celsius"}' in text
    )
    assert '{"temperature": 21, "sky": "clear"}' in text and '\\"city\\"' not in text
    assert '"name": "get_time"' in text


def test_the_model_answers_in_the_format_its_template_teaches():
    assert format_of_template(QWEN25_STYLE) == "hermes"
    assert format_of_template(LLAMA31_STYLE) == "llama3_json"


def test_smollm2_template_gets_the_generic_format(ours, theirs):
    template = ours.chat_template
    assert not template_knows_tools(template)
    messages = generic_tool_messages(ROUND_TRIP, TOOLS)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "user"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\nYou can call these functions.")
    lines = [json.loads(line) for line in system.splitlines() if line.startswith('{"name": "')]
    assert lines == [
        {"name": "get_weather", "description": TOOLS[0]["function"]["description"],
         "parameters": TOOLS[0]["function"]["parameters"]},
        {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    ]  # fmt: skip
    # the history's call in the form the model is asked to write, which the parser reads back
    call = messages[2]["content"]
    assert call == '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    content, calls = parse_tool_calls(call, "generic")
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]
    assert messages[3]["content"] == 'Result of get_weather (call_1):\n{"temperature": 21, "sky": "clear"}'
    text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call these functions.")


def test_generic_format_without_a_system_message_and_several_results():
    history = ROUND_TRIP[1:3] + [
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "tool", "tool_call_id": "call_2", "name": "get_time", "content": "12:00"},
    ]
    messages = generic_tool_messages(history, TOOLS)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("You can call these functions.")
    assert (
        messages[3]["content"]
        == "Result of get_weather (call_1):\n21 C\n\nResult of get_time (call_2):\n12:00"
    )
    assert all(set(m) == {"role", "content"} for m in messages)
    # no tools (tool_choice "none"): the history alone
    assert generic_tool_messages(history, [])[0] == history[0]
