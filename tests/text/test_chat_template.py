"""flashformer.text.chat_template: templates render exactly as transformers' apply_chat_template(...,
tokenize=False) renders them, for SmolLM2's template (from its GGUF file) and for templates in the
styles of Llama 3, Zephyr and a tool-calling model; failures surface as ValueError."""

from __future__ import annotations

import json

import pytest
from helpers.gguf import smollm2_tokenizer, transformers_smollm2_tokenizer
from tokenizers import Tokenizer as Backend
from transformers import AutoTokenizer

from flashformer.text.chat_template import render_chat_template
from flashformer.text.tokenizer import Tokenizer

SYSTEM_CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": "Hello. <b>Bold</b> & café ✓"},
    {"role": "user", "content": "  What is 2+2?\n"},
]
PLAIN_CHAT = SYSTEM_CHAT[1:]

LLAMA3_STYLE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# written across lines: trim_blocks / lstrip_blocks decide what of this layout reaches the prompt
ZEPHYR_STYLE = """{% for message in messages %}
    {% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
    {% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
    {% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
    {% endif %}
    {% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
    {% endif %}
{% endfor %}"""

TOOLS_STYLE = """{%- set ns = namespace(system='', turns=0) -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}
        {%- set ns.system = message.content -%}
        {%- continue -%}
    {%- endif -%}
    {%- if message.role == 'stop' -%}{%- break -%}{%- endif -%}
    {%- set ns.turns = ns.turns + 1 -%}
    [{{ ns.turns }}:{{ message.role }}] {{ message.content }}
    {%- if message.tool_calls is defined %} calls={{ message.tool_calls | tojson }}{% endif %}
    {%- if message.reasoning_content is defined %} thought={{ message.reasoning_content }}{% endif %}
{% endfor -%}
{%- if ns.system %}system={{ ns.system }}{% endif %}
{%- if tools %}
tools={{ tools | tojson(indent=2, sort_keys=true) }}
{%- endif %}
{{- dict(a=1) | tojson }}{{ extra | default('') }}
{%- if add_generation_prompt %}>>>{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Weather in a city <b>now</b> — °C",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def ours():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def theirs():
    return transformers_smollm2_tokenizer()


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("messages", [SYSTEM_CHAT, PLAIN_CHAT], ids=["system", "no-system"])
def test_smollm2_template_as_transformers(ours, theirs, messages, add_generation_prompt):
    kwargs = {"add_generation_prompt": add_generation_prompt}
    text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text == theirs.apply_chat_template(messages, tokenize=False, **kwargs)
    ids = ours.apply_chat_template(messages, **kwargs)
    assert ids == theirs.apply_chat_template(messages, return_dict=False, **kwargs)
    assert ids == ours.encode(text, add_special_tokens=False)
    if messages is PLAIN_CHAT:  # the template adds its default system prompt
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.parametrize(
    "template", [LLAMA3_STYLE, ZEPHYR_STYLE, TOOLS_STYLE], ids=["llama3", "zephyr", "tools"]
)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_other_templates_as_transformers(ours, theirs, template, add_generation_prompt):
    for messages in (SYSTEM_CHAT, PLAIN_CHAT):
        kwargs = {"chat_template": template, "add_generation_prompt": add_generation_prompt}
        assert ours.apply_chat_template(messages, tokenize=False, **kwargs) == theirs.apply_chat_template(
            messages, tokenize=False, **kwargs
        )


def test_tools_none_values_reasoning_and_extra_variables_as_transformers(ours, theirs):
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Weather in Paris?", "tool_calls": None},  # None: as if absent
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "weather", "arguments": {"city": "Paris"}}],
        },
        {"role": "assistant", "content": "Sunny.", "reasoning": "the tool said so"},
        {"role": "stop", "content": "never shown"},
        {"role": "user", "content": "after the break"},
    ]
    kwargs = {"chat_template": TOOLS_STYLE, "tools": TOOLS, "extra": "[extra]", "add_generation_prompt": True}
    text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text == theirs.apply_chat_template(messages, tokenize=False, **kwargs)
    assert "thought=the tool said so" in text and "never shown" not in text and "<b>now</b>" in text


def test_batch_of_conversations(ours, theirs):
    batch = [SYSTEM_CHAT, PLAIN_CHAT]
    assert ours.apply_chat_template(batch, tokenize=False) == theirs.apply_chat_template(
        batch, tokenize=False
    )
    assert ours.apply_chat_template(batch) == [ours.apply_chat_template(m) for m in batch]


def test_template_from_an_hf_tokenizer_config(ours, tmp_path):
    """A Zephyr-style template written into tokenizer_config.json, read by both libraries."""
    ours.save(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()  # the config's template is the one to read
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=ZEPHYR_STYLE)))
    tokenizer, theirs = Tokenizer.from_folder(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert tokenizer.chat_template == ZEPHYR_STYLE
    for add_generation_prompt in (False, True):
        expected = theirs.apply_chat_template(
            SYSTEM_CHAT, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        rendered = tokenizer.apply_chat_template(
            SYSTEM_CHAT, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert rendered == expected
    assert rendered.startswith("<|system|>\nYou are terse.<|im_end|>\n<|user|>\n") and rendered.endswith(
        "<|assistant|>\n"
    )


# ---- failures ----


def test_raise_exception_becomes_a_value_error(ours):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with the user') }}{% endif %}ok"
    assert render_chat_template(template, PLAIN_CHAT) == "ok"
    with pytest.raises(
        ValueError, match="chat template failed on these messages: Conversations must start with the user"
    ):
        ours.apply_chat_template(SYSTEM_CHAT, chat_template=template)


def test_invalid_templates_and_inputs():
    with pytest.raises(ValueError, match=r"not valid Jinja \(line 2\)"):
        render_chat_template("ok\n{% for m in messages %}", PLAIN_CHAT)
    with pytest.raises(ValueError, match="empty conversation"):
        render_chat_template("x", [])
    with pytest.raises(TypeError, match="must be dicts"):
        render_chat_template("x", ["hello"])


def test_the_sandbox_holds():
    for template in (
        "{{ messages.append({'role': 'user'}) }}",  # the immutable sandbox: no mutating the inputs
        "{% set ns = namespace(_private=1) %}",  # no underscore names on a namespace
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # no walking to Python internals
    ):
        with pytest.raises(ValueError, match="chat template failed"):
            render_chat_template(template, PLAIN_CHAT)


def test_tojson_keeps_text_as_written():
    messages = [{"role": "user", "content": "<b>é</b> & 'q'"}]
    assert render_chat_template("{{ messages[0] | tojson }}", messages) == json.dumps(
        messages[0], ensure_ascii=False
    )


def test_no_template_is_an_error(ours):
    bare = Tokenizer(Backend.from_str(ours.backend.to_str()), dict(ours.special_tokens))  # no template
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(PLAIN_CHAT)
