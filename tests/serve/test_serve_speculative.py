"""Speculative decoding in the server (serve/speculation.py, the engine's packed step): greedy
requests get the tokens, text and log-probabilities they get without it, alone or batched, through
preemptions and stop strings; drafts are counted; sampled and opted-out requests never draft;
a draft model drafts too; the configuration's errors name the field."""

from __future__ import annotations

import pytest
from helpers.engine import run_requests

import flashformer
from flashformer.checkpoints.gguf.packaged_models import smollm2_path
from flashformer.generate import speculative
from flashformer.serve.engine import Engine
from flashformer.serve.request import Request, SamplingParams
from flashformer.serve.speculation import SpeculativeConfig

NGRAM = SpeculativeConfig(num_speculative_tokens=6)


@pytest.fixture(scope="module")
def quantized():
    """SmolLM2 on its own Q4_1 blocks: a real model, whose answers copy from their prompts. The
    costs the draft length weighs are fixed (as timed on this CPU), so the counts asserted below do
    not depend on the machine's load."""
    model, tokenizer = flashformer.load(smollm2_path(), quantize="gguf")
    speculative._ROW_COSTS[model] = {"PromptLookup": 0.2, "DraftModel": 0.5}
    return model, tokenizer


def prompts_of(tokenizer) -> list[list[int]]:
    """Chat prompts whose answers copy (the lookup's drafts get kept), and one that does not."""
    messages = [
        "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank.",
        "Copy this list: apple, pear, plum, cherry, apple, pear, plum, cherry.",
        "Hello!",
    ]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True)
        for m in messages
    ]


def run(engine: Engine, prompts, max_tokens: int = 40, **params) -> list[dict]:
    """Every prompt submitted at once; each request's tokens, text, log-probabilities and finish."""
    settings = SamplingParams(**dict(dict(max_tokens=max_tokens, temperature=0), **params))
    return run_requests(engine, [(prompt, settings) for prompt in prompts])


def test_greedy_requests_keep_their_tokens_alone_and_batched(quantized):
    model, tokenizer = quantized
    native = True
    prompts = prompts_of(tokenizer)
    plain = [
        run(Engine(model, tokenizer, max_batch=8, num_blocks=96, native=native), [p])[0] for p in prompts
    ]
    engine = Engine(model, tokenizer, max_batch=8, num_blocks=96, native=native, speculative=NGRAM)
    assert run(engine, prompts) == plain
    assert engine.stats["speculative_accepted_tokens"] > 0  # drafts were verified and kept
    for prompt, expected in zip(prompts, plain):
        alone = Engine(model, tokenizer, max_batch=8, num_blocks=96, native=native, speculative=NGRAM)
        assert run(alone, [prompt]) == [expected]
        if prompt is prompts[0]:  # the copying answer: several tokens a step
            assert alone.stats["steps"] < 0.8 * len(expected["tokens"])
    small = Engine(
        model, tokenizer, max_batch=8, num_blocks=14, block_size=8, native=native, speculative=NGRAM
    )
    assert run(small, prompts) == plain  # through preemptions and a pool with no room for drafts
    assert small.stats["preemptions"] > 0 and small.pool.in_use == 0


def test_every_model_free_proposer_of_the_table_keeps_greedy_tokens(quantized):
    """The server's proposer is the table's row for the configured method (here the longest-match
    lookup, "suffix"): the tokens are plain greedy's, batched, with drafts kept."""
    model, tokenizer = quantized
    speculative._ROW_COSTS[model]["SuffixLookup"] = 0.2
    prompts = prompts_of(tokenizer)
    plain = run(Engine(model, tokenizer, max_batch=8, num_blocks=96), prompts)
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=6)
    engine = Engine(model, tokenizer, max_batch=8, num_blocks=96, speculative=config)
    assert run(engine, prompts) == plain
    assert engine.stats["speculative_accepted_tokens"] > 0


def test_a_verify_sends_its_kept_tokens_as_one_delta(quantized):
    """As a plain step sends one: a client (an SSE chunk each) is not told several times a step."""
    model, tokenizer = quantized
    prompt = prompts_of(tokenizer)[0]
    expected = run(Engine(model, tokenizer, max_batch=4, num_blocks=32), [prompt])[0]
    engine = Engine(model, tokenizer, max_batch=4, num_blocks=32, speculative=NGRAM)
    deltas = []
    request = Request(prompt, SamplingParams(max_tokens=40, temperature=0), 1, deltas.append)
    engine.submit(request)
    engine.waiting.extend(engine._inbox.get().sequences)
    while not request.finished:
        engine.step()
    texts = [e.text for e in deltas if e.kind == "delta"]
    assert "".join(texts) == expected["text"]
    assert len(texts) <= engine.stats["steps"] < 0.8 * len(expected["tokens"])


def test_the_eager_packed_step_verifies_alike(quantized):
    """A quantized model's modules, run eagerly, compute rows alone too (every product a
    quantized kernel): the same tokens with drafts kept."""
    model, tokenizer = quantized
    prompt = prompts_of(tokenizer)[:1]
    plain = run(Engine(model, tokenizer, max_batch=4, num_blocks=32, native=False), prompt, max_tokens=20)
    engine = Engine(model, tokenizer, max_batch=4, num_blocks=32, native=False, speculative=NGRAM)
    assert run(engine, prompt, max_tokens=20) == plain
    assert engine.stats["speculative_accepted_tokens"] > 0


def test_logprobs_stop_strings_and_penalties_as_without_drafts(quantized):
    model, tokenizer = quantized
    prompts = prompts_of(tokenizer)
    params = dict(logprobs=2, repetition_penalty=1.2, min_tokens=3)
    text = run(Engine(model, tokenizer, max_batch=8, num_blocks=96), prompts[:1], **params)[0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 4]  # met halfway: the answer ends there
    params["stop"] = (stop,)
    plain = run(Engine(model, tokenizer, max_batch=8, num_blocks=96), prompts, **params)
    engine = Engine(model, tokenizer, max_batch=8, num_blocks=96, speculative=NGRAM)
    assert run(engine, prompts, **params) == plain
    assert plain[0]["finish"] == "stop" and stop not in plain[0]["text"]
    assert engine.stats["speculative_drafted_tokens"] > 0


def test_sampled_opted_out_and_large_batches_do_not_draft(quantized):
    model, tokenizer = quantized
    prompts = prompts_of(tokenizer)
    engine = Engine(model, tokenizer, max_batch=8, num_blocks=96, speculative=NGRAM)
    run(engine, prompts, speculative=False)
    run(engine, prompts, temperature=0.8, seed=1)
    assert engine.stats["speculative_drafted_tokens"] == 0
    small_batches = SpeculativeConfig(num_speculative_tokens=6, disable_by_batch_size=2)
    crowded = Engine(model, tokenizer, max_batch=8, num_blocks=96, speculative=small_batches)
    assert run(crowded, prompts * 2) == run(Engine(model, tokenizer, max_batch=8, num_blocks=96), prompts * 2)
    assert crowded.metrics()["speculative_drafted_tokens"] >= 0  # /metrics carries the counts
    sampled_plain = run(
        Engine(model, tokenizer, max_batch=8, num_blocks=96), prompts, temperature=0.8, seed=3
    )
    assert run(engine, prompts, temperature=0.8, seed=3) == sampled_plain  # batch invariant draws


def test_a_draft_model_drafts_in_the_packed_step(quantized):
    """method draft_model: each greedy sequence keeps a session of the draft (here the same
    weights quantized to int8 per row instead of Q4_1: close, not equal); the tokens are the
    served model's own, alone and batched."""
    model, tokenizer = quantized
    draft, _ = flashformer.load(smollm2_path(), quantize="int8")
    config = SpeculativeConfig(method="draft_model", model=str(smollm2_path()), num_speculative_tokens=4)
    prompts = prompts_of(tokenizer)
    plain = run(Engine(model, tokenizer, max_batch=8, num_blocks=96), prompts, max_tokens=24)
    engine = Engine(model, tokenizer, max_batch=8, num_blocks=96, speculative=config, draft_model=draft)
    assert run(engine, prompts, max_tokens=24) == plain
    assert engine.stats["speculative_accepted_tokens"] > 0
    alone = Engine(model, tokenizer, max_batch=8, num_blocks=96, speculative=config, draft_model=draft)
    assert run(alone, prompts[1:2], max_tokens=24) == plain[1:2]
    with pytest.raises(ValueError, match="needs one"):
        Engine(model, tokenizer, speculative=config)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "not JSON"),
        ("[1]", "a JSON object"),
        ('{"method": "eagle"}', "method must be one of"),
        ('{"method": "draft_model"}', 'needs "model"'),
        ('{"method": "ngram", "model": "x.gguf"}', "go with method 'draft_model'"),
        ('{"method": "draft_model", "model": "x.gguf", "quantization": "q3"}', "quantization must be one of"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an int >= 1"),
        ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"ngram_size": 3}', "unknown field 'ngram_size'"),
    ],
)
def test_bad_configs_name_the_field(text, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json(text)
    assert (
        SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3}').num_speculative_tokens
        == 3
    )
