"""A mixture-of-experts model served: a qwen3moe GGUF file (Q8_0 experts run on their own
blocks; the native decoder declines the model, so the server runs its modules eagerly). Greedy
completions through the openai client equal the library's generate() on the same file, token
for token: each prompt alone, and nine requests at once (decoded together, their rows grouped
by expert together)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers.gguf import qwen3moe_metadata, qwen3moe_tensors, tiny_qwen3_moe, write_gguf
from test_serve import openai_client, serving

import flashformer
from flashformer.model.experts import MixtureOfExperts

PROMPTS = ("the cat sat on", "hello world", "a b c d e f")
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    model = tiny_qwen3_moe()
    path = tmp_path_factory.mktemp("moe") / "qwen3moe-q8_0.gguf"
    return write_gguf(path, "qwen3moe", qwen3moe_metadata(model), qwen3moe_tensors(model, ("Q8_0",) * 3))


def test_served_greedy_equals_library_greedy(moe_file):
    model, tokenizer = flashformer.load(moe_file)
    assert isinstance(model.decoder.block(0).ffn, MixtureOfExperts)
    expected = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, eos_token_id=[])
        expected.append(out[0, len(ids) :].tolist())
    with serving(moe_file, "--kv-blocks", "64") as url:
        client = openai_client(url)
        name = client.models.list().data[0].id
        for prompt, tokens in zip(PROMPTS, expected):
            reply = client.completions.create(
                model=name,
                prompt=tokenizer.encode(prompt),
                max_tokens=NEW_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert reply.usage.completion_tokens == NEW_TOKENS
            assert reply.choices[0].text == tokenizer.decode(tokens), (prompt, tokens)
        together = asyncio.run(completions_at_once(url, name, [tokenizer.encode(p) for p in PROMPTS * 3]))
    assert together == [tokenizer.decode(tokens) for tokens in expected * 3]
    assert len(set(together)) == len(PROMPTS)  # the prompts' answers differ: nothing degenerate


async def completions_at_once(url: str, name: str, prompts: list[list[int]]) -> list[str]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    replies = await asyncio.gather(
        *[
            client.completions.create(
                model=name, prompt=ids, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True}
            )
            for ids in prompts
        ]
    )
    await client.close()
    return [reply.choices[0].text for reply in replies]
