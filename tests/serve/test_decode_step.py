"""The engine's compiled decode step (serve/decode_step.py): torch.compile with fixed shapes,
padded to buckets for a quantized model and to max_batch for a float one. A request's tokens
are generate()'s (an independent path: the static cache, eager), the same alone, among
others (padding rows and other buckets change nobody's bits) and through preemptions, and
prefix caching stays exact. The graphs are compiled once for each pool shape (engines of the
same shape share them), so each test pays mostly for its steps; an engine of another shape
(`small`) compiles its own, and the warmed engines' steps, which skip the guards that cannot
tell graphs apart, still find their own graphs beside it."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_chat_folder
from test_prefix_cache import GREEDY, prompts, run, same
from test_serve import QUESTIONS, run_engine

import flashformer
from flashformer.serve.decode_step import buckets_for
from flashformer.serve.engine import Engine

# every engine of the module: 2 rows (buckets 1 and 2 for the quantized model), so that the
# module compiles three small graphs in all
ROWS = {"max_batch": 2, "block_size": 8, "prefill_chunk": 32, "prefill_budget": 32}


def test_buckets_are_max_batch_for_float_and_powers_of_four_for_rows_alone():
    assert buckets_for(16, rows_alone=False) == (16,)
    assert buckets_for(16, rows_alone=True) == (1, 4, 16)
    assert buckets_for(12, rows_alone=True) == (1, 4, 12)
    assert buckets_for(2, rows_alone=True) == (1, 2)
    assert buckets_for(1, rows_alone=True) == (1,)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_chat_folder(tmp_path_factory.mktemp("tiny-compiled"), max_positions=512)


@pytest.fixture(
    scope="module",
    params=["int4", pytest.param(None, marks=pytest.mark.slow)],  # float32: its own graph, ~1 min more
    ids=["int4", "float32"],
)
def compiled(request, folder):
    """(model, tokenizer, an engine whose graphs were compiled by warm_up)."""
    model, tokenizer = flashformer.load(folder, quantize=request.param)
    engine = Engine(model, tokenizer, num_blocks=96, compile=True, **ROWS)
    assert engine.warm_up() > 0 and engine.stats["compile_seconds"] == engine.compile_seconds
    step = engine.runner.decode_step
    assert step.buckets == ((1, 2) if request.param else (2,))
    # every bucket's graph called without dynamo from now on (generate.direct_step)
    assert set(step.direct) == set(step.buckets) and all(step.direct.values())
    return model, tokenizer, engine


def generated(model, ids: list[int], count: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False, eos_token_id=[])
    return out[0, len(ids) :].tolist()


def test_tokens_are_generates_alone_among_others_and_preempted(compiled):
    model, tokenizer, engine = compiled
    batch = [tokenizer.encode(q * (1 + i % 3)) for i, q in enumerate(QUESTIONS)]
    alone = [run_engine(engine, [p], 24)[0] for p in batch]
    assert alone == [generated(model, p, 24) for p in batch]
    assert run_engine(engine, batch, 24) == alone  # 2 at a time, every bucket
    small = Engine(model, tokenizer, num_blocks=9, compile=True, **ROWS)  # 8 blocks: too few for 2
    assert run_engine(small, batch, 24) == alone
    assert small.stats["preemptions"] > 0 and small.pool.in_use == 0
    assert run_engine(engine, batch, 24) == alone  # the warmed engine, past small's graphs


def test_reused_prefixes_give_the_same_tokens_and_logits(compiled):
    """The prefix cache with compiled decode steps: the same tokens and log-probabilities as
    each prompt computed whole; a quantized model registers only its prompts' blocks (a
    compiled decode token has other bits than an eager prompt token)."""
    model, tokenizer, _ = compiled
    batch = prompts(4)
    reference = [
        run(Engine(model, tokenizer, num_blocks=96, prefix_cache=False, compile=True, **ROWS), [p], GREEDY)[0]
        for p in batch
    ]
    engine = Engine(model, tokenizer, num_blocks=96, compile=True, **ROWS)
    first = run(engine, batch[:1], GREEDY)
    together = run(engine, batch[1:], GREEDY)
    assert all(r[2]["prompt_tokens_details"]["cached_tokens"] == 96 for r in together)
    assert same(first + together, reference)
    turn = batch[0] + first[0][0] + [3000, 3001]  # the answer in the next prompt: not reused
    again = run(engine, [turn], GREEDY)[0]
    assert again[2]["prompt_tokens_details"]["cached_tokens"] == 96
    whole = Engine(model, tokenizer, num_blocks=96, prefix_cache=False, compile=True, **ROWS)
    assert same([again], run(whole, [turn], GREEDY))
