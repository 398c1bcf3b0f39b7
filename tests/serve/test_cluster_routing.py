"""serve/cluster's routing policy (affinity.py) without Ray: the prefix key is the prefix
cache's block hashes, the index finds the longest known prefix, and choose() keeps a
conversation on its replica unless that one is much busier than another."""

from __future__ import annotations

import random
import subprocess
import sys

from flashformer.serve.cluster.affinity import PrefixIndex, choose, prefix_key


def test_the_key_names_the_blocks_an_engine_registers_in_its_prefix_cache(tmp_path):
    """A prompt served by an Engine leaves its full blocks in the pool's prefix cache under the
    chain hashes the router keys on: the key finds them there."""
    from helpers import tiny_chat_folder
    from helpers.engine import run_requests

    import flashformer
    from flashformer.serve.engine import Engine
    from flashformer.serve.request import SamplingParams

    model, tokenizer = flashformer.load(tiny_chat_folder(tmp_path / "tiny", max_positions=128))
    engine = Engine(model, tokenizer, max_batch=2, num_blocks=32, block_size=16, prefill_chunk=16)
    prompt = list(range(300, 350))  # 3 full blocks of 16, and 2 tokens more
    run_requests(engine, [(prompt, SamplingParams(max_tokens=2, temperature=0))])
    key = prefix_key(prompt, block_size=16)
    assert len(key) == 3
    assert len(engine.pool.lookup(list(key))) == 3
    # equal beginnings share the key's first hashes; a token changed changes its block and the rest
    changed = prompt[:20] + [7] + prompt[21:]
    other = prefix_key(changed, block_size=16)
    assert other[0] == key[0] and all(a != b for a, b in zip(other[1:], key[1:]))
    assert len(engine.pool.lookup(list(other))) == 1
    assert len(prefix_key(prompt, block_size=16, blocks=2)) == 2
    assert prefix_key(prompt[:15], block_size=16) == ()


def test_the_index_finds_the_replicas_holding_the_longest_known_prefix():
    index = PrefixIndex()
    first = prefix_key(list(range(64)), 16)  # 4 blocks
    index.record(first[:2], "a")
    index.record(first, "b")  # a longer prompt beginning the same way went to b
    assert index.longest(first, {"a", "b"}) == ({"b"}, 4)
    assert index.longest(first[:2], {"a", "b"}) == ({"a", "b"}, 2)  # both hold the first two blocks
    assert index.longest(first, {"a"}) == ({"a"}, 2)  # b is gone: a holds the longest prefix left
    index.forget("b")
    assert index.longest(first, {"a", "b"}) == ({"a"}, 2) and len(index) == 2
    unknown = prefix_key(list(range(1000, 1064)), 16)
    assert index.longest(unknown, {"a", "b"}) == (set(), 0)


def test_the_index_forgets_the_least_recently_used_hashes_past_its_capacity():
    index = PrefixIndex(capacity=6)
    old, new = prefix_key(list(range(64)), 16), prefix_key(list(range(500, 564)), 16)
    index.record(old, "a")
    index.record(new, "b")  # 8 hashes: old's first two are forgotten
    assert len(index) == 6
    assert index.longest(old[:2], {"a", "b"}) == (set(), 0)
    assert index.longest(old, {"a", "b"}) == ({"a"}, 4)
    assert index.longest(new, {"a", "b"}) == ({"b"}, 4)


def test_choose_prefers_the_replicas_holding_the_prefix_until_they_are_much_busier():
    index = PrefixIndex()
    key = prefix_key(list(range(320)), 16)
    index.record(key, "a")
    ranks, why = choose(index, key, {"a": 5, "b": 1, "c": 0}, imbalance=8)
    assert why == "affinity" and ranks[0] == ["a"] and len(ranks[1]) == 2 and "a" not in ranks[1]
    ranks, why = choose(index, key, {"a": 9, "b": 1, "c": 0}, imbalance=8)  # 9 more than c's 0
    assert why == "balance" and len(ranks) == 1 and len(ranks[0]) == 2
    ranks, why = choose(index, key, {"a": None, "b": 3}, imbalance=2)  # a's depth not known yet
    assert why == "affinity" and ranks[0] == ["a"]
    ranks, why = choose(index, (), {"a": 0, "b": 0}, imbalance=8)  # nothing to go by: two at random
    assert why == "balance" and sorted(ranks[0]) == ["a", "b"]
    index.record(key[:4], "c")  # a shared beginning on a and c: both come first, the caller takes the idler
    ranks, why = choose(index, key[:4], {"a": 9, "b": 1, "c": 0}, imbalance=8)
    assert why == "affinity" and sorted(ranks[0]) == ["a", "c"] and ranks[1] == ["b"]


def test_new_conversations_spread_and_every_second_turn_goes_to_its_first_turns_replica():
    """Six conversations over two replicas, as router.py drives choose(): each first turn goes to
    the less busy of the two drawn (ties at random), each second turn (the first turn's prompt
    and answer, then a question) to the replica holding the first turn's prompt."""
    rng = random.Random(0)
    index, queues, placed = PrefixIndex(), {"a": 0, "b": 0}, {}
    firsts = [[1000 * c + t for t in range(200)] for c in range(6)]
    for c, prompt in enumerate(firsts):
        ranks, why = choose(index, prefix_key(prompt, 16), queues, imbalance=8, rng=rng)
        chosen = min(ranks[0], key=lambda r: queues[r])  # Ray's pick within a rank
        index.record(prefix_key(prompt, 16), chosen)
        placed[c] = chosen
        queues[chosen] += 1  # each first turn still in flight: the replicas share the load
    assert sorted(placed.values()) == ["a"] * 3 + ["b"] * 3
    for c, prompt in enumerate(firsts):
        second = prompt + [7] * 40 + [8] * 9  # its answer and the next question
        ranks, why = choose(index, prefix_key(second, 16), queues, imbalance=8, rng=rng)
        assert why == "affinity" and ranks[0] == [placed[c]]


def test_requests_sharing_a_system_prompt_spread_once_each_replica_holds_it():
    """Twelve requests after one long system prompt, each still in flight: after the first one on
    each replica, both hold the prompt, and the rest go to the less busy of them."""
    rng = random.Random(1)
    index, queues, counts = PrefixIndex(), {"a": 0, "b": 0}, {"a": 0, "b": 0}
    system = list(range(2000, 2256))
    for q in range(12):
        key = prefix_key(system + [5000 + q] * 20, 16)
        ranks, why = choose(index, key, queues, imbalance=2, rng=rng)
        chosen = min(ranks[0], key=lambda r: queues[r])
        index.record(key, chosen)
        queues[chosen] += 1
        counts[chosen] += 1
    assert counts == {"a": 6, "b": 6}
    assert index.longest(prefix_key(system, 16), {"a", "b"})[0] == {"a", "b"}


def test_a_server_without_replicas_never_imports_ray(tmp_path):
    """The plain `flashformer serve` path, run up to its HTTP server (stubbed to return at
    once): Ray stays out of the process."""
    from helpers import tiny_chat_folder

    folder = tiny_chat_folder(tmp_path / "tiny", max_positions=64)
    script = (
        "import sys, uvicorn\n"
        "uvicorn.Server.run = lambda self: None\n"
        "from flashformer.cli import main\n"
        f"sys.argv = ['flashformer', 'serve', {str(folder)!r}, '--port', '1']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "import flashformer.serve.engine\n"
        "print('ray' in sys.modules, 'flashformer.serve.cluster.launch' in sys.modules)\n"
    )
    found = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr
    assert found.stdout.split()[-2:] == ["False", "False"], found.stdout + found.stderr
