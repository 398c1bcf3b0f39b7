"""The window group (serve.paged_cache, serve.scheduler.prepare_windows): a model whose
sliding-window layers sit beside full ones keeps those layers' keys in a pool of their own, and a
sequence holds there only the blocks its next queries can see. Its greedy tokens are those of
greedy decoding by full forward passes without any cache (an independent reference), through the
native decoder and the eager modules, batched, after preemptions, with the prefix cache reusing
a window; and no sequence ever holds more window blocks than the bound the pool is sized by."""

from __future__ import annotations

import pytest
import torch
from helpers.engine import run_requests
from helpers.sliding import WINDOW, sliding_model

from flashformer.checkpoints.gguf.packaged_models import smollm2_path
from flashformer.checkpoints.gguf.tokenizer import read_tokenizer
from flashformer.serve.engine import Engine
from flashformer.serve.paged_cache import NO_BLOCK, layer_windows, window_blocks_held, window_of
from flashformer.serve.request import SamplingParams

BLOCK, CHUNK = 4, 8


@pytest.fixture(scope="module")
def model():
    return sliding_model()


@pytest.fixture(scope="module")
def tokenizer():
    return read_tokenizer(smollm2_path())  # ids below the model's 300 decode to some text


def greedy_by_full_forwards(model, prompt: list[int], count: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(count):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def prompts() -> list[list[int]]:
    rows = torch.randint(1, 300, (3, 40), generator=torch.Generator().manual_seed(5)).tolist()
    return [rows[0][:37], rows[1][:21], rows[2][:9]]


def watch_windows(engine: Engine) -> list[int]:
    """The most window blocks any running sequence held, step by step (the engine's step wrapped)."""
    seen = []
    step = engine.step

    def counted():
        step()
        seen.extend(sum(b != NO_BLOCK for b in s.window_blocks) for s in engine.running)

    engine.step = counted
    return seen


def test_the_model_splits_into_a_full_and_a_window_group(model):
    assert layer_windows(model) == [WINDOW - 1, WINDOW - 1, None]
    assert window_of(model) == WINDOW - 1


@pytest.mark.parametrize("native", [True, False], ids=["native", "eager"])
def test_window_group_greedy_tokens_equal_full_forwards(model, tokenizer, native):
    expected = [greedy_by_full_forwards(model, p, 12) for p in prompts()]
    engine = Engine(
        model, tokenizer, max_batch=4, num_blocks=64, block_size=BLOCK, prefill_chunk=CHUNK, native=native
    )
    held = window_blocks_held(WINDOW - 1, CHUNK, BLOCK)
    assert engine.window_pool.num_blocks == engine.pool.reserved + 4 * held
    seen = watch_windows(engine)
    params = SamplingParams(max_tokens=12, temperature=0)
    found = run_requests(engine, [(p, params) for p in prompts()])
    assert [f["tokens"] for f in found] == expected
    assert 0 < max(seen) <= held  # sequences of 37 + 12 tokens held a few blocks of 4
    assert engine.window_pool.in_use == 0 and engine.pool.in_use == 0
    # the same prompts again: the full blocks and the windows before them are found cached
    again = run_requests(engine, [(p, params) for p in prompts()])
    assert [f["tokens"] for f in again] == expected
    assert engine.scheduler.cache_hits > 0


def test_preempted_sequences_rebuild_their_windows(model, tokenizer):
    expected = [greedy_by_full_forwards(model, p, 16) for p in prompts()]
    engine = Engine(model, tokenizer, max_batch=3, num_blocks=24, block_size=BLOCK, prefill_chunk=CHUNK)
    params = SamplingParams(max_tokens=16, temperature=0)
    found = run_requests(engine, [(p, params) for p in prompts()])
    assert engine.scheduler.preemptions > 0
    assert [f["tokens"] for f in found] == expected


def test_a_model_of_full_layers_only_has_no_window_group(model, tokenizer):
    full = sliding_model(layer_types=("full_attention",) * 3, sliding_window=None)
    assert window_of(full) is None
    assert Engine(full, tokenizer, max_batch=2, num_blocks=16, block_size=BLOCK).window_pool is None


def test_speculation_rewinds_inside_the_window_group(model, tokenizer):
    from flashformer.generate import speculative
    from flashformer.serve.speculation import SpeculativeConfig

    loop = [11, 12, 13, 14, 15, 16, 17] * 5  # a prompt the lookup drafts from
    expected = greedy_by_full_forwards(model, loop, 20)
    speculative._ROW_COSTS[model] = {"PromptLookup": 0.2, "DraftModel": 0.5}
    config = SpeculativeConfig(num_speculative_tokens=5)
    engine = Engine(
        model,
        tokenizer,
        max_batch=2,
        num_blocks=64,
        block_size=BLOCK,
        prefill_chunk=CHUNK,
        speculative=config,
    )
    assert engine.window_pool.num_blocks == engine.pool.reserved + 2 * window_blocks_held(
        WINDOW - 1, CHUNK, BLOCK
    )
    found = run_requests(engine, [(loop, SamplingParams(max_tokens=20, temperature=0))])
    assert found[0]["tokens"] == expected
    assert engine.counts["speculative_drafted_tokens"] > 0
