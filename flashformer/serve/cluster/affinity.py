"""Which engine replica a request should go to: the one most likely to hold the longest cached
prefix of its prompt, unless that one is much busier than another; then the less busy of two
(power of two choices on queue depth). Plain Python, no Ray: router.py hands Ray's replicas
and queue lengths to it.

A prompt's key is the prefix cache's own: the chain hashes of its first full blocks
(paged_cache.block_hash, the replicas' block size), so equal keys mean equal token prefixes,
exactly as inside a replica's BlockPool. The index remembers, for every block hash it has seen,
the replicas prompts holding that block were sent to; the longest known hash of a new prompt
names the replicas whose prefix caches most likely hold the longest part of it, and the least
busy of them is taken. Turn 2 of a conversation re-sends turn 1's prompt (and answer), so its
longest known prefix is turn 1's, on turn 1's replica; a system prompt every request shares is
soon on every replica, and such requests spread by load alone.

It is a prediction, never a promise: a replica may have evicted the blocks since (its LRU), and
the index forgets the oldest hashes past `capacity`. Nothing breaks when it is wrong; the
request is computed from the start, as on a fresh server.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from flashformer.serve.paged_cache import extend_hashes

# Blocks of a prompt that make its key: 256 blocks of 16 tokens reach 4,096 tokens, past which
# two conversations that differ nowhere earlier are rare, and hashing stays a few microseconds.
KEY_BLOCKS = 256


def prefix_key(prompt_ids: list[int], block_size: int, blocks: int = KEY_BLOCKS) -> tuple[bytes, ...]:
    """The chain hashes of the first min(blocks, len // block_size) full blocks of a prompt."""
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1; got {block_size}")
    count = min(blocks, len(prompt_ids) // block_size)
    return tuple(extend_hashes([], prompt_ids, block_size, count))


class PrefixIndex:
    """block chain hash -> the replicas prompts holding that block were sent to, least recently
    used hash first; at most `capacity` hashes (the oldest are forgotten). Several replicas hold a
    prefix many prompts share (a system prompt: each replica computes it once, then reuses it);
    one holds a conversation's."""

    def __init__(self, capacity: int = 1 << 17):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1; got {capacity}")
        self.capacity = capacity
        self._holders: OrderedDict[bytes, set] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def longest(self, key: Sequence[bytes], live: set) -> tuple[set, int]:
        """(the replicas among `live` holding the longest known prefix of `key`; how many blocks
        long), or (set(), 0). The hashes chain: a hash names the whole prefix up to its block."""
        for count in range(len(key), 0, -1):
            holders = self._holders.get(key[count - 1])
            if holders and (found := holders & live):
                return found, count
        return set(), 0

    def record(self, key: Sequence[bytes], replica: Hashable) -> None:
        """The request with `key` went to `replica`: each of its blocks is now (most likely) there."""
        for block in key:
            self._holders.setdefault(block, set()).add(replica)
            self._holders.move_to_end(block)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """A replica died: its cache went with it (a restarted one starts empty)."""
        for block, holders in list(self._holders.items()):
            holders.discard(replica)
            if not holders:
                del self._holders[block]


def choose(
    index: PrefixIndex,
    key: Sequence[bytes],
    queues: dict[Hashable, int | None],
    imbalance: int,
    rng: random.Random | None = None,
) -> tuple[list[list[Hashable]], str]:
    """Ranks of replicas to try, best first (the caller takes the least busy replica of the first
    rank that has room), and why ("affinity" or "balance").

    queues: every live replica's queue depth (requests in flight there; None: not known yet).
    The replicas holding the longest known prefix come first unless the least busy of them has
    more than `imbalance` requests more than the least busy replica of all; then (or with no
    known prefix) two replicas drawn at random (power of two choices). After an affinity rank,
    two drawn from the others follow, for when the holders refuse (full)."""
    rng = rng or random
    holders, _ = index.longest(key, set(queues))
    least = min((depth for depth in queues.values() if depth is not None), default=0)
    if holders and min(queues[h] or 0 for h in holders) - least <= imbalance:
        others = [replica for replica in queues if replica not in holders]
        first = rng.sample(sorted(holders, key=str), len(holders))  # ties at random
        return ([first, _two(others, rng)] if others else [first]), "affinity"
    return [_two(list(queues), rng)], "balance"


def _two(replicas: list, rng) -> list:
    """Two replicas drawn at random, in random order (ties go to the first), or all when fewer."""
    return rng.sample(replicas, min(2, len(replicas)))
