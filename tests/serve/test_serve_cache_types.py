"""The server's KV pool in q8_0 / q4_0 blocks (--cache-type-k, --cache-type-v): the native decoder
writes and reads them in the packed step; a request's greedy tokens are the same alone, batched,
from a prefix found in the cache, and as generate() gives them over a static cache of the same
types. The eager modules cannot read blocks, and say so."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import run_requests

import flashformer
from flashformer.checkpoints.gguf.packaged_models import smollm2_path
from flashformer.serve.engine import Engine
from flashformer.serve.request import SamplingParams

TYPES = dict(cache_type_k="q8_0", cache_type_v="q4_0")


@pytest.fixture(scope="module")
def quantized():
    return flashformer.load(smollm2_path(), quantize="gguf")


def prompts_of(tokenizer) -> list[list[int]]:
    messages = ["What is the capital of France?", "Name three colours.", "Count from one to five."]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True)
        for m in messages
    ]


def run(engine: Engine, prompts, max_tokens: int = 24) -> list[list[int]]:
    settings = SamplingParams(max_tokens=max_tokens, temperature=0)
    return [found["tokens"] for found in run_requests(engine, [(p, settings) for p in prompts])]


def test_block_pools_keep_a_request_s_tokens_alone_batched_and_from_the_prefix_cache(quantized):
    model, tokenizer = quantized
    prompts = prompts_of(tokenizer)
    engine = Engine(model, tokenizer, max_batch=4, num_blocks=64, **TYPES)
    assert engine.runner.caches[0].k.dtype == torch.uint8
    batched = run(engine, prompts)
    for prompt, tokens in zip(prompts, batched):
        assert run(Engine(model, tokenizer, max_batch=4, num_blocks=64, **TYPES), [prompt]) == [tokens]
        static = model.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=[], **TYPES
        )
        assert static[0, len(prompt) :].tolist()[: len(tokens)] == tokens
    hits = engine.stats["prefix_cache_hits"]
    assert run(engine, prompts[:1]) == batched[:1]  # its prompt's blocks found in the pool
    assert engine.stats["prefix_cache_hits"] > hits


def test_block_pools_take_their_bytes(quantized):
    model, tokenizer = quantized
    sizes = {
        types: Engine(
            model, tokenizer, num_blocks=32, cache_type_k=types[0], cache_type_v=types[1]
        ).runner.kv_bytes
        for types in [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "q4_0")]
    }
    assert sizes[("q8_0", "q8_0")] == sizes[("f16", "f16")] * 34 / 64
    assert sizes[("q8_0", "q4_0")] == sizes[("f16", "f16")] * (34 + 18) / 128


def test_the_eager_modules_refuse_block_pools_by_name(quantized):
    model, tokenizer = quantized
    with pytest.raises(
        ValueError, match=r"cache types q8_0 / q4_0: q8_0 and q4_0 blocks are read by the native decoder only"
    ):
        Engine(model, tokenizer, num_blocks=32, native=False, **TYPES)
