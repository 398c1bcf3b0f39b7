"""Automatic prefix caching (serve.paged_cache.BlockPool, serve.scheduler): the pool's reference
counts and least-recently-released eviction worked out by hand, and the engine's exactness: a
request's tokens and log-probabilities (the logits they come from) are bit for bit the same with
the cache off, on, after eviction, alone and among 15 others, for a float32 model and a quantized
one, greedy and seeded. The reference is the engine with the cache off (the whole prompt
computed), itself checked against model.generate in test_serve.py."""

from __future__ import annotations

import pytest
from helpers import tiny_chat_folder

import flashformer
from flashformer.serve.engine import Engine
from flashformer.serve.paged_cache import BlockPool, block_hash, extend_hashes
from flashformer.serve.request import Event, Request, SamplingParams

# ---- the pool ----


def test_shared_blocks_are_counted_and_free_cached_ones_stay_findable_until_needed():
    pool = BlockPool(num_blocks=7, block_size=2)  # blocks 1..6
    a = pool.allocate(3)
    assert a == [1, 2, 3] and pool.in_use == 3
    hashes = extend_hashes([], [5, 6, 7, 8, 9, 10], 2, 3)
    for block, digest in zip(a, hashes):
        pool.register(block, digest)
    assert pool.lookup(hashes) == a and pool.cached == 3
    pool.share(a[:2])  # a second sequence holds the first two
    pool.release(a)
    assert pool.in_use == 2 and pool.cached_free == 1  # block 3 is free but still cached
    pool.release(a[:2])
    assert pool.in_use == 0 and pool.free == 6 and pool.lookup(hashes) == a
    # never-cached blocks go first; then the least recently released cached one: 3 (a's tail,
    # released first), then 2, then 1
    assert pool.allocate(3) == [4, 5, 6] and pool.cached == 3
    assert pool.allocate(1) == [3] and pool.lookup(hashes) == [1, 2]
    pool.share([1])  # held again: no longer evictable
    assert pool.allocate(1) == [2] and pool.lookup(hashes) == [1]
    assert pool.allocate(1) is None and pool.free == 0


def test_a_prefix_computed_twice_keeps_the_first_block_and_the_second_is_reused_empty():
    pool = BlockPool(num_blocks=4, block_size=2)
    digest = block_hash(None, [1, 2])
    first, second = pool.allocate(1), pool.allocate(1)
    pool.register(first[0], digest)
    pool.register(second[0], digest)
    assert pool.lookup([digest]) == first and pool.cached == 1
    pool.release(second)
    assert pool.cached_free == 0 and pool.allocate(2) == [2, 3]  # the duplicate came back empty


def test_chain_hashes_name_the_whole_prefix():
    one = extend_hashes([], [1, 2, 3, 4, 5, 6, 7], 2, 3)
    assert len(one) == 3 and len(set(one)) == 3
    assert extend_hashes([], [1, 2, 3, 4, 9, 9], 2, 3)[:2] == one[:2]
    changed = extend_hashes([], [0, 2, 3, 4, 5, 6], 2, 3)  # the first token differs: every hash does
    assert all(x != y for x, y in zip(one, changed))
    assert block_hash(None, [3, 4]) != one[1]  # the same tokens after another prefix


# ---- the engine: exactness ----


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A 2-layer LLaMA (GQA 4/2) with peaked next-token distributions, SmolLM2's tokenizer, a
    512-token context."""
    return tiny_chat_folder(tmp_path_factory.mktemp("tiny-prefix"), max_positions=512)


SYSTEM = list(range(1000, 1100))  # a 100-token "system prompt" every request begins with


def prompts(count: int) -> list[list[int]]:
    """The system prompt, then a question of 3..17 tokens of its own."""
    return [SYSTEM + [2000 + 37 * i + j for j in range(3 + (5 * i) % 15)] for i in range(count)]


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[tuple]:
    """Submit every prompt at once and step until all are done: per prompt (tokens, their
    log-probabilities and top alternatives, usage)."""
    events: list[list[Event]] = [[] for _ in prompts]
    requests = []
    for i, prompt in enumerate(prompts):
        request = Request(prompt, params, 1, events[i].append)
        engine.submit(request)
        requests.append(request)
    while engine._inbox.qsize():
        engine.waiting.extend(engine._inbox.get().sequences)
    while not all(r.finished for r in requests):
        engine.step()
    out = []
    for request, got in zip(requests, events):
        logprobs = [(e.token, e.logprob, e.top) for event in got for e in event.logprobs]
        out.append((request.sequences[0].generated, logprobs, got[-1].usage))
    return out


def alone(model, tokenizer, prompt_list, params, **kwargs) -> list[tuple]:
    """Each prompt by itself in a fresh engine with the cache off: the reference."""
    return [run(Engine(model, tokenizer, prefix_cache=False, **kwargs), [p], params)[0] for p in prompt_list]


def same(results: list[tuple], reference: list[tuple]) -> bool:
    return [r[:2] for r in results] == [r[:2] for r in reference]


GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=5, logprobs=2)
SMALL = {"max_batch": 16, "block_size": 8, "prefill_chunk": 32, "prefill_budget": 32}


@pytest.mark.parametrize(
    "quantize, native, params",
    [
        (None, True, GREEDY),
        (None, False, GREEDY),
        ("int8", True, GREEDY),
        ("int8", False, SEEDED),
        pytest.param("int8", True, SEEDED, marks=pytest.mark.slow),
        pytest.param(None, False, SEEDED, marks=pytest.mark.slow),
    ],
    ids=[
        "float32-greedy",
        "float32-eager-greedy",
        "int8-greedy",
        "int8-eager-seeded",
        "int8-seeded",
        "float32-eager-seeded",
    ],
)
def test_reused_prefixes_give_the_same_tokens_and_logits(tiny_folder, quantize, native, params):
    """Alone, after a request that cached the system prompt, among 15 others, and (greedy)
    after the cache was evicted: the same tokens and log-probabilities as the whole prompt
    computed. Natively, and through the modules (eager: a float model's padded steps)."""
    model, tokenizer = flashformer.load(tiny_folder, quantize=quantize)
    batch = prompts(16)
    small_engine = dict(SMALL, native=native)
    reference = alone(model, tokenizer, batch, params, num_blocks=64, **small_engine)
    engine = Engine(model, tokenizer, num_blocks=64, **small_engine)
    assert engine.pad_decode == (quantize is None and not native)
    first = run(engine, batch[:1], params)  # caches the system prompt
    assert first[0][2]["prompt_tokens_details"]["cached_tokens"] == 0
    second = run(engine, batch[1:2], params)
    # the system prompt's 12 full blocks (96 tokens: a multiple of the chunk too)
    assert second[0][2]["prompt_tokens_details"]["cached_tokens"] == 96
    together = run(engine, batch, params)  # 16 at once, all on the cached prefix
    assert all(r[2]["prompt_tokens_details"]["cached_tokens"] >= 96 for r in together)
    assert same(first + second, reference[:2]) and same(together, reference)
    assert engine.pool.in_use == 0 and engine.pool.cached > 0
    if params is SEEDED:
        return
    # a pool of 20 blocks (2 more are scratch): prompts of 14 blocks and more, preempted
    small = Engine(model, tokenizer, num_blocks=20 + 2, **small_engine)
    assert same(run(small, batch, params), reference)
    assert small.stats["preemptions"] > 0
    other = run(small, [list(range(5000, 5148))], params)[0]  # 148 + 8 tokens: all 20 blocks
    assert other[2]["prompt_tokens_details"]["cached_tokens"] == 0
    evicted = run(small, batch[:4], params)
    assert evicted[0][2]["prompt_tokens_details"]["cached_tokens"] == 0
    assert same(evicted, reference[:4])
    assert small.pool.in_use == 0 and small.pool.free == small.pool.capacity


def test_a_chat_turn_reuses_the_history_and_its_generated_tokens(tiny_folder):
    """Turn 2 (turn 1's prompt, its answer, a new question) finds turn 1's prompt and answer
    cached: with rows computed alone (natively, or int8 kernels) the generated tokens' blocks
    too, with float matmuls run eagerly only the prompt's full chunks. Its tokens are the same
    as with the cache off."""
    for quantize, native, cached in ((None, True, 96), (None, False, 64), ("int8", False, 96)):
        model, tokenizer = flashformer.load(tiny_folder, quantize=quantize)
        engine = Engine(model, tokenizer, num_blocks=64, native=native, **SMALL)
        turn_1 = SYSTEM[:90]
        answer = run(engine, [turn_1], GREEDY)[0][0]
        # 90 + 8 + 10 tokens; cached: eager float32 turn 1's two full chunks, rows alone its 12
        # computed blocks (its last token was sampled, never computed)
        turn_2 = turn_1 + answer + [3000 + j for j in range(10)]
        result = run(engine, [turn_2], GREEDY)[0]
        assert result[2]["prompt_tokens_details"]["cached_tokens"] == cached
        assert same(
            [result], alone(model, tokenizer, [turn_2], GREEDY, num_blocks=64, native=native, **SMALL)
        )


def test_at_least_the_newest_token_is_computed(tiny_folder):
    """A prompt seen before in full (a multiple of the block size) reuses all but its last
    block: its newest token is computed so that it has logits."""
    model, tokenizer = flashformer.load(tiny_folder, quantize="int8")
    engine = Engine(model, tokenizer, num_blocks=64, **SMALL)
    prompt = SYSTEM[:64]
    first, again = run(engine, [prompt], GREEDY)[0], run(engine, [prompt], GREEDY)[0]
    assert again[2]["prompt_tokens_details"]["cached_tokens"] == 56
    assert same([again], [first])
    assert engine.stats["prefix_cache_hits"] == 56 and engine.stats["prefix_cache_queries"] == 128


def test_the_cache_off_reuses_nothing(tiny_folder):
    model, tokenizer = flashformer.load(tiny_folder, quantize="int8")
    engine = Engine(model, tokenizer, num_blocks=64, prefix_cache=False, **SMALL)
    run(engine, prompts(2), GREEDY)
    results = run(engine, prompts(2), GREEDY)
    assert [r[2]["prompt_tokens_details"]["cached_tokens"] for r in results] == [0, 0]
    assert engine.pool.cached == 0 and engine.metrics()["prefix_cache_hit_rate"] == 0


def test_a_cancelled_request_leaves_its_shared_blocks_to_the_others(tiny_folder):
    model, tokenizer = flashformer.load(tiny_folder, quantize="int8")
    batch = prompts(3)
    reference = alone(model, tokenizer, batch[1:], GREEDY, num_blocks=64, **SMALL)
    engine = Engine(model, tokenizer, num_blocks=64, **SMALL)

    def submit(prompt: list[int], events: list) -> Request:
        request = Request(prompt, GREEDY, 1, events.append)
        engine.submit(request)
        engine.waiting.extend(engine._inbox.get().sequences)
        return request

    first = submit(batch[0], [])
    while first.sequences[0].in_prefill:
        engine.step()
    events: list[Event] = []
    second = submit(batch[1], events)
    engine.step()
    assert second.sequences[0].cached_tokens == 96  # it holds first's 12 system prompt blocks
    first.cancel()
    while not second.finished:
        engine.step()
    logprobs = [(e.token, e.logprob, e.top) for event in events for e in event.logprobs]
    assert first.sequences[0].finish_reason == "cancelled"
    assert [(second.sequences[0].generated, logprobs)] == [r[:2] for r in reference[:1]]
    third = run(engine, batch[2:], GREEDY)
    assert third[0][2]["prompt_tokens_details"]["cached_tokens"] == 96 and same(third, reference[1:])
    assert engine.pool.in_use == 0 and engine.pool.cached > 0


@pytest.mark.slow
def test_smollm2_from_its_gguf_file_reuses_prefixes_exactly():
    """The real model's own quantized blocks (`quantize="gguf"`): a shared 64-token prefix and a
    chat's second turn give the same tokens and log-probabilities as with the cache off."""
    from flashformer.checkpoints.gguf.packaged_models import smollm2_path

    model, tokenizer = flashformer.load(smollm2_path(), quantize="gguf")
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2)
    shared = tokenizer.encode("You are a careful assistant who answers in one sentence. " * 6)[:64]
    batch = [
        shared + tokenizer.encode(q) for q in ("What is the sea?", "Name a color.", "Why is 2 + 2 four?")
    ]
    engine = Engine(model, tokenizer, max_batch=4, num_blocks=64)
    assert not engine.pad_decode
    first = run(engine, batch[:1], params)
    together = run(engine, batch, params)
    turn_2 = batch[0] + first[0][0] + tokenizer.encode(" And why?")
    again = run(engine, [turn_2], params)
    assert [r[2]["prompt_tokens_details"]["cached_tokens"] for r in together] == [64, 64, 64]
    assert again[0][2]["prompt_tokens_details"]["cached_tokens"] >= 64
    reference = alone(model, tokenizer, batch + [turn_2], params, max_batch=4, num_blocks=64)
    assert same(together + again, reference)


def test_long_rope_blocks_are_keyed_by_the_side_their_keys_were_written_on():
    """LongRoPE (original context 16, chunks of 12): a forward ending past 16 writes long, so a
    prompt of 30 turns long from its second chunk (12) and one of 10 from position 16 on; blocks
    of the same tokens written on different sides are different keys, the same side the same."""
    from types import SimpleNamespace

    from flashformer.serve.scheduler import Scheduler

    pool = BlockPool(num_blocks=8, block_size=4)
    scheduler = Scheduler(
        pool, max_batch=2, prefill_chunk=12, prefill_budget=64, rows_alone=True, long_rope_after=16
    )
    long, short = (
        SimpleNamespace(prompt_len=30, long_from=None),
        SimpleNamespace(prompt_len=10, long_from=None),
    )
    assert scheduler.expected_long_from(long) == 12 and scheduler.expected_long_from(short) == 16
    scheduler.before_forward([(long, 0, 12), (short, 0, 10)])
    assert long.long_from is None and short.long_from is None
    scheduler.before_forward([(long, 12, 24), (short, 15, 16)])
    assert long.long_from == 12 and short.long_from is None
    scheduler.before_forward([(short, 16, 17)])
    assert short.long_from == 16
    hashes = extend_hashes([], list(range(20)), 4, 5)
    as_long, as_short = scheduler._keys(hashes, 12), scheduler._keys(hashes, 16)
    assert as_long[:3] == as_short[:3] and as_long[3] != as_short[3] and as_long[4] == as_short[4]
    assert scheduler._keys(hashes, None)[:4] == as_short[:4]  # none long yet: as the short side's
    plain = Scheduler(pool, max_batch=2, prefill_chunk=12, prefill_budget=64, rows_alone=True)
    assert plain._keys(hashes, None) == hashes and plain.expected_long_from(long) is None
