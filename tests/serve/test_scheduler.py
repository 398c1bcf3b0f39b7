"""The scheduler's policy without a model: admission, the prefill plan and making room in the
pool, each checked against plans worked out by hand from the rules in serve/scheduler.py."""

from __future__ import annotations

from flashformer.serve.paged_cache import BlockPool
from flashformer.serve.request import Request, SamplingParams
from flashformer.serve.scheduler import IDLE_BUDGET_FACTOR, Scheduler


def sequence(prompt_len: int):
    """A fresh request's only sequence (engine.Sequence: no model needed)."""
    request = Request(list(range(prompt_len)), SamplingParams(max_tokens=100), 1, lambda event: None)
    return request.sequences[0]


def scheduler(num_blocks: int, block_size: int, max_batch: int = 4, chunk: int = 8, budget: int = 10):
    changes: list[int] = []
    pool = BlockPool(num_blocks, block_size)
    s = Scheduler(
        pool, max_batch=max_batch, prefill_chunk=chunk, prefill_budget=budget, on_waiting=changes.append
    )
    return s, changes


def test_admission_takes_the_queue_in_order_within_the_batch_and_the_pool():
    s, changes = scheduler(num_blocks=6, block_size=4, max_batch=2)  # 5 blocks to give out
    first, second, third = sequence(6), sequence(2), sequence(2)
    s.waiting.extend([first, second, third])
    s.admit()
    assert s.running == [first, second] and list(s.waiting) == [third]  # the batch is full
    assert (first.blocks, second.blocks) == ([1, 2], [3])  # 6 + 1 tokens: 2 blocks; 2 + 1: 1
    assert changes == [-1, -1]

    s, changes = scheduler(num_blocks=4, block_size=4)  # 3 blocks
    big, small = sequence(12), sequence(1)  # 13 tokens need 4 blocks: never now
    s.waiting.extend([big, small])
    s.admit()
    assert s.running == [] and list(s.waiting) == [big, small]  # first come, first served
    assert changes == []


def test_the_prefill_plan_cuts_prompts_at_fixed_boundaries_within_the_budget():
    s, _ = scheduler(num_blocks=64, block_size=4, chunk=8, budget=10)
    a, b, c = sequence(20), sequence(5), sequence(9)
    s.waiting.extend([a, b, c])
    s.admit()
    assert s.budget() == 10 * IDLE_BUDGET_FACTOR  # nobody decodes
    assert s.prefill_plan(s.budget()) == [(a, 0, 8), (b, 0, 5), (c, 0, 8)]
    a.computed = 3  # a chunk ends at the next multiple of 8, wherever it started
    assert s.prefill_plan(80)[0] == (a, 3, 8)
    a.computed, b.computed = 16, 5  # b decodes now: the budget is 10
    assert s.budget() == 10 and s.decoding() == [b]
    assert s.prefill_plan(s.budget()) == [(a, 16, 20), (c, 0, 8)]  # 4 + 8: the last one runs whole
    assert s.prefill_plan(4) == [(a, 16, 20)]


def test_making_room_preempts_the_newest_and_a_sequence_alone_ends_at_the_pool():
    s, changes = scheduler(num_blocks=4, block_size=4)  # 3 blocks
    old, new = sequence(3), sequence(3)
    s.waiting.extend([old, new])
    s.admit()  # 3 + 1 tokens: a block each
    for seq in (old, new):
        seq.tokens += [7, 7]  # two generated
        seq.computed = 4  # both need a second block for token 4; one is left

    ready, ended = s.make_room([new, old])  # in arrival order: old takes the last block
    assert ready == [old] and ended == []
    assert list(s.waiting) == [new] and (new.blocks, new.computed) == ([], 0) and s.preemptions == 1
    assert changes == [-1, -1, 1] and s.pool.free == 1

    old.computed = 8  # token 8 needs a third block: the one new gave back
    assert s.make_room([old]) == ([old], []) and len(old.blocks) == 3
    old.computed = 12  # a fourth: the pool has none and old is alone
    ready, ended = s.make_room([old])
    assert (ready, ended) == ([], [old]) and old.finish_reason == "length"
    assert s.running == [] and s.pool.in_use == 0


def test_admission_reuses_the_cached_prefix_by_the_rules_of_exactness():
    """A prompt of 22 tokens whose first 5 blocks of 4 are cached: with rows computed alone it
    starts at token 20 (block granularity; token 21, its newest, is computed); with float
    matmuls at 16, the last multiple of the chunk (8) inside its full chunks. It holds the
    cached blocks (shared, not copied) and new ones for the rest."""
    for rows_alone, reused in ((True, 20), (False, 16)):
        changes: list[int] = []
        pool = BlockPool(32, 4)
        s = Scheduler(pool, max_batch=4, prefill_chunk=8, prefill_budget=8, on_waiting=changes.append,
                      rows_alone=rows_alone)  # fmt: skip
        earlier = sequence(22)
        s.waiting.append(earlier)
        s.admit()
        earlier.computed = 21
        s.remember([earlier])  # rows alone: blocks 0-4 (tokens 0..19); float: 0-3 (full chunks)
        assert earlier.registered == (5 if rows_alone else 4)
        held = list(earlier.blocks)
        s.finish(earlier)
        assert pool.in_use == 0 and pool.cached == earlier.registered
        later = sequence(22)
        s.waiting.append(later)
        s.admit()
        assert later.computed == reused == later.cached_tokens
        assert later.blocks[: reused // 4] == held[: reused // 4]  # the very blocks
        assert len(later.blocks) == 6 and pool.in_use == 6  # ceil(23 / 4) blocks, none copied
        assert s.prefill_plan(64) == [(later, reused, 22)]  # to the chunk's end: the prompt's
        assert (s.cache_queries, s.cache_hits) == (44, reused)
