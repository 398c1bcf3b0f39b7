"""A SmolLM3 served (flashformer serve with --reasoning-parser qwen3, the real openai client): a
tiny random SmolLM3 beside SmolLM2's tokenizer and a template of SmolLM3's shape
(helpers/dense_2026.py), whose {% generation %} blocks once made the server take it for
a template without tools. With tools the prompt is the template's own rendering of them (as
transformers renders it); `required` gives calls that validate against their schemas, streamed
as whole; /no_think's answer has no reasoning."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import perturbed
from helpers.dense_2026 import CITY, SMOLLM3_SHAPED, TOOLS
from test_serve import openai_client, serving

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    from flashformer.checkpoints.gguf.packaged_models import smollm2_path
    from flashformer.checkpoints.gguf.tokenizer import read_tokenizer

    folder = tmp_path_factory.mktemp("smollm3-served")
    tokenizer = read_tokenizer(smollm2_path())
    torch.manual_seed(0)
    config = SmolLM3Config(
        vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=0,
    )  # fmt: skip
    perturbed(SmolLM3ForCausalLM(config), scale=0.6).save_pretrained(folder)
    tokenizer.chat_template = SMOLLM3_SHAPED
    tokenizer.save(folder)
    return folder


@pytest.fixture(scope="module")
def client(folder):
    with serving(folder, "--max-batch", "4", "--kv-blocks", "64", "--reasoning-parser", "qwen3") as url:
        yield openai_client(url)


def test_tools_render_through_its_own_template(client, folder):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(folder)
    reply = client.chat.completions.create(model=folder.name, messages=QUESTION, tools=TOOLS, max_tokens=2)
    expected = theirs.apply_chat_template(
        QUESTION, tools=TOOLS, add_generation_prompt=True, return_dict=False
    )
    assert reply.usage.prompt_tokens == len(expected)
    assert "<tools>" in theirs.decode(expected)


def test_required_calls_validate_streamed_as_whole(client, folder):
    import jsonschema

    kwargs = dict(model=folder.name, messages=QUESTION, tools=[CITY], tool_choice="required", max_tokens=120,
                  temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    calls = [(call.function.name, call.function.arguments) for call in whole.message.tool_calls]
    for name, arguments in calls:
        assert name == "weather"
        jsonschema.validate(json.loads(arguments), CITY["function"]["parameters"])
    streamed: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for piece in chunk.choices[0].delta.tool_calls or []:
            call = streamed.setdefault(piece.index, ["", ""])
            call[0] += piece.function.name or ""
            call[1] += piece.function.arguments or ""
    assert [tuple(streamed[i]) for i in sorted(streamed)] == calls


def test_no_think_answers_without_reasoning(client, folder):
    messages = [{"role": "system", "content": "Be brief. /no_think"}, *QUESTION]
    reply = client.chat.completions.create(model=folder.name, messages=messages, max_tokens=8, temperature=0)
    message = reply.choices[0].message
    assert getattr(message, "reasoning_content", None) is None and message.content
