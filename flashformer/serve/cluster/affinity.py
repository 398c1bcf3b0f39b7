"""Which engine replica a request should go to: the one most likely to hold the longest cached
prefix of its prompt, unless that one is much busier than another; then the less busy of two
(power of two choices on queue depth). Plain Python, no Ray: router.py hands Ray's replicas
and queue lengths to it.

A prompt's key is the prefix cache's own: the chain hashes of its first full blocks
(paged_cache.block_hash, the replicas' block size), so equal keys mean equal token prefixes,
exactly as inside a replica's BlockPool. The index remembers, for every block hash it has seen,
the replica a prompt holding that block was last sent to; the longest known hash of a new
prompt names the replica whose prefix cache most likely holds the longest part of it. Turn 2 of
a conversation re-sends turn 1's prompt (and answer), so its longest known prefix is turn 1's,
on turn 1's replica.

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
    """block chain hash -> the replica a prompt holding that block was last sent to, least
    recently used first; at most `capacity` hashes (the oldest are forgotten)."""

    def __init__(self, capacity: int = 1 << 17):
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1; got {capacity}")
        self.capacity = capacity
        self._owner: OrderedDict[bytes, Hashable] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owner)

    def longest(self, key: Sequence[bytes], live: set) -> tuple[Hashable | None, int]:
        """(the replica, among `live`, holding the longest known prefix of `key`; how many blocks
        long), or (None, 0). The hashes chain, so the longest known one wins whatever the
        shorter ones say (a conversation that moved to another replica is found there)."""
        for count in range(len(key), 0, -1):
            owner = self._owner.get(key[count - 1])
            if owner is not None and owner in live:
                return owner, count
        return None, 0

    def record(self, key: Sequence[bytes], replica: Hashable) -> None:
        """The request with `key` went to `replica`: each of its blocks is now (most likely) there."""
        for block in key:
            self._owner[block] = replica
            self._owner.move_to_end(block)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """A replica died: its cache went with it (a restarted one starts empty)."""
        for block in [b for b, owner in self._owner.items() if owner == replica]:
            del self._owner[block]


def choose(
    index: PrefixIndex,
    key: Sequence[bytes],
    queues: dict[Hashable, int | None],
    imbalance: int,
    rng: random.Random | None = None,
) -> tuple[list[list[Hashable]], str]:
    """Ranks of replicas to try, best first, and why ("affinity" or "balance").

    queues: every live replica's queue depth (requests in flight there; None: not known yet).
    The replica holding the longest known prefix comes first unless its queue is more than
    `imbalance` requests longer than the shortest; then (or with no known prefix) two replicas
    drawn at random, of which the caller takes the less busy (power of two choices). After an
    affinity rank, the two drawn from the others follow, for when that replica refuses (full)."""
    rng = rng or random
    live = set(queues)
    owner, _ = index.longest(key, live)
    known = [depth for depth in queues.values() if depth is not None]
    least = min(known, default=0)
    if owner is not None and (queues[owner] or 0) - least <= imbalance:
        others = [replica for replica in queues if replica != owner]
        return [[owner], _two(others, rng)] if others else [[owner]], "affinity"
    return [_two(list(queues), rng)], "balance"


def _two(replicas: list, rng) -> list:
    """Two replicas drawn at random, in random order (ties go to the first), or all when fewer."""
    return rng.sample(replicas, min(2, len(replicas)))
