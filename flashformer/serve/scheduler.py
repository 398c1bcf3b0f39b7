"""The scheduling policy: which sequences run, which prompt chunks a step computes, and who
gives way when the KV pool is full. It keeps the waiting queue, the running batch and their
blocks, and decides; it never runs the model (runner.py does), so every rule here can be
called with plain sequences and a pool.

Admission: waiting sequences join the running batch in arrival order while it has fewer than
`max_batch` sequences and the pool has the blocks their tokens so far plus one need.

Chunked prefill: a prompt is computed in fixed chunks of `prefill_chunk` tokens (boundaries at
multiples of it, whoever else runs), at most `prefill_budget` prompt tokens per step while
other sequences are decoding, so a long prompt never stalls everyone's next token for long;
IDLE_BUDGET_FACTOR times that when none is.

Preemption: when a sequence needs a block and the pool has none, the newest sequence is
preempted: its blocks are freed and it waits at the front of the queue; when readmitted it
computes its prompt again and then replays the tokens it had generated, one decode step each,
so its cache is rebuilt by the very same operations as before and it continues with the same
tokens. A sequence alone in the batch that fills the whole pool ends with "length".

Prefix caching (paged_cache.BlockPool; on unless prefix_cache=False): a sequence admitted
holds the longest run of cached full blocks that begins its tokens and starts computing after
them; at least its newest token is always computed, so that it has logits. Reuse is exact
(the same bits as computing everything) because a block is registered and reused only where
its keys and values are what this sequence would compute itself:
- rows_alone (a model whose every row is computed alone, the same bits in any chunk or decode
  step: runner.pad_decode is False): every full computed block is registered, prompt or
  generated, and reused at block granularity.
- otherwise (float matmuls, whose rows may round differently with the rows of the call): a
  prompt's chunks are its shapes, so only blocks inside the prompt's full prefill chunks are
  registered, and reuse stops at a multiple of prefill_chunk (and of block_size): the chunks
  computed after it are the very chunks the sequence computes without the cache.
A preempted or finished sequence's blocks stay cached for others, a cancelled one's too.
LongRoPE (long_rope_after: the original context): a forward that ends past it turns every key it
writes by the long table, so a block's keys depend on the forwards that wrote it, not its tokens
alone. Its hash is tagged with how many of its tokens were written short (a sequence's tokens
turn long from one position on: long_from), and a sequence reuses only blocks tagged as its own
chunks and decode steps would write them (expected_long_from).

The window group (paged_cache.py; a model whose sliding-window layers have a pool of their own):
before each forward, a sequence's window blocks that its queries can no longer see are released
and the blocks of the step's new tokens taken (prepare_windows). A sequence holds at most
window_blocks_held of them, and at most max_batch sequences run, so the window pool (sized for
that, engine.py) never runs short: nothing there is preempted. A prefix is reused only where the
window pool still has the window before its end (the blocks that the next queries see).

A sequence is anything with engine.Sequence's fields: tokens, prompt_len, blocks, computed
(tokens whose keys and values are in the blocks), arrival (its place in arrival order),
finish_reason, in_prefill and request.cancelled; for the prefix cache block_hashes (its full
blocks' chain hashes, grown as needed), registered (its first blocks that are registered or
were found cached) and cached_tokens (the tokens reused at its first admission; None before);
for the window group window_blocks (its window table, NO_BLOCK where released) and
window_registered; for LongRoPE long_from.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from flashformer.serve.paged_cache import NO_BLOCK, BlockPool, extend_hashes, side_tagged

# A step's prompt tokens when no sequence is decoding (nobody's next token waits for them), as a
# multiple of prefill_budget: more prompts start at once, and a step still ends soon enough for
# the first of them to get their second token without a long wait.
IDLE_BUDGET_FACTOR = 8


class Scheduler:
    """The queue, the batch and the blocks they hold; see the module docstring.

    on_waiting(change) is told each time the waiting queue grows or shrinks (the loop's waiting
    count, which submit() reads to answer Busy). prefix_cache, rows_alone and long_rope_after:
    see the module docstring."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        max_batch: int,
        prefill_chunk: int,
        prefill_budget: int,
        on_waiting: Callable[[int], None] = lambda change: None,
        prefix_cache: bool = True,
        rows_alone: bool = False,
        window_pool: BlockPool | None = None,
        window: int | None = None,
        long_rope_after: int | None = None,
    ):
        if (window_pool is None) != (window is None):
            raise ValueError(
                f"window_pool and window: give both or neither; got {window_pool!r} and {window!r}"
            )
        self.pool, self.max_batch = pool, max_batch
        self.window_pool, self.window = window_pool, window
        self.prefill_chunk, self.prefill_budget = prefill_chunk, prefill_budget
        self.on_waiting = on_waiting
        self.prefix_cache, self.rows_alone = prefix_cache, rows_alone
        self.long_rope_after = long_rope_after
        # reuse stops at a multiple of this many tokens (see the module docstring)
        self.reuse_step = pool.block_size if rows_alone else math.lcm(pool.block_size, prefill_chunk)
        self.waiting: deque = deque()
        self.running: list = []
        self.preemptions = 0
        self.cache_queries = self.cache_hits = 0  # tokens looked up and reused at admissions

    # ---- admission ----

    def admit(self) -> None:
        """Move waiting sequences into the batch, in order, while it has room and the pool
        has their blocks; finished ones (cancelled while waiting) just leave the queue."""
        while self.waiting and len(self.running) < self.max_batch:
            sequence = self.waiting[0]
            if sequence.finish_reason is not None:
                self._leave_queue()
                continue
            reused = self._cached_prefix(sequence)
            reused, window_start, window_reused = self._cached_window(sequence, reused)
            need = self.pool.blocks_for(len(sequence.tokens) + 1) - len(reused)
            if need > self.pool.free - self.pool.free_among(reused):
                return
            self._leave_queue()
            self.pool.share(reused)
            if self.window_pool is not None:
                self.window_pool.share(window_reused)
                sequence.window_blocks = [NO_BLOCK] * window_start + window_reused
                sequence.window_registered = len(reused)
            sequence.blocks = reused + self.pool.allocate(need)
            sequence.computed = len(reused) * self.pool.block_size
            sequence.registered = len(reused)
            expected = self.expected_long_from(sequence)
            sequence.long_from = expected if expected is not None and expected < sequence.computed else None
            if sequence.cached_tokens is None:
                sequence.cached_tokens = sequence.computed
            if self.prefix_cache:
                self.cache_queries += len(sequence.tokens)
                self.cache_hits += sequence.computed
            self.running.append(sequence)

    def _cached_prefix(self, sequence) -> list[int]:
        """The cached blocks the sequence may start from (not yet held): the longest cached run
        of its full blocks, cut to leave its newest token to compute and, without rows_alone,
        to its prompt's full chunks, at a multiple of reuse_step."""
        if not self.prefix_cache:
            return []
        size = self.pool.block_size
        full = len(sequence.tokens) // size
        hashes = extend_hashes(sequence.block_hashes, sequence.tokens, size, full, sequence.cache_salt)
        found = self.pool.lookup(self._keys(hashes, self.expected_long_from(sequence)))
        limit = len(sequence.tokens) - 1
        if not self.rows_alone:
            limit = min(limit, self._full_chunks(sequence))
        tokens = min(len(found) * size, limit) // self.reuse_step * self.reuse_step
        return found[: tokens // size]

    def _cached_window(self, sequence, reused: list[int]) -> tuple[list[int], int, list[int]]:
        """The window group's side of a prefix hit: (the full group's blocks cut to the longest
        prefix whose window the window pool still caches, the index of that window's first block,
        its cached blocks). Without a window group: (reused, 0, [])."""
        if self.window_pool is None or not reused:
            return reused, 0, []
        size = self.pool.block_size
        tokens = len(reused) * size
        while tokens > 0:
            first, end = max(0, tokens - self.window) // size, tokens // size
            keys = self._keys(sequence.block_hashes[:end], self.expected_long_from(sequence))
            found = self.window_pool.lookup(keys[first:end])
            if len(found) == end - first:
                return reused[:end], first, found
            tokens -= self.reuse_step
        return [], 0, []

    def _full_chunks(self, sequence) -> int:
        """The prompt tokens in full prefill chunks (their keys and values are computed with the
        same shapes by every sequence that shares them)."""
        return sequence.prompt_len // self.prefill_chunk * self.prefill_chunk

    def _registrable(self, sequence) -> int:
        """The tokens whose blocks may be registered once computed (see the module docstring)."""
        return len(sequence.tokens) if self.rows_alone else self._full_chunks(sequence)

    def remember(self, sequences: list) -> None:
        """Register the sequences' full blocks computed since (see the module docstring); called
        after each forward, while the sequences still hold their blocks."""
        if not self.prefix_cache:
            return
        size = self.pool.block_size
        for sequence in sequences:
            computed = min(sequence.computed, self._registrable(sequence))
            count = min(computed // size, len(sequence.blocks))
            if count <= sequence.registered:
                continue
            hashes = self._keys(
                extend_hashes(sequence.block_hashes, sequence.tokens, size, count, sequence.cache_salt),
                sequence.long_from,
            )
            for i in range(sequence.registered, count):
                self.pool.register(sequence.blocks[i], hashes[i])
            sequence.registered = count
            if self.window_pool is not None:
                table = sequence.window_blocks
                for i in range(sequence.window_registered, min(count, len(table))):
                    if table[i] != NO_BLOCK:
                        self.window_pool.register(table[i], hashes[i])
                sequence.window_registered = count

    def expected_long_from(self, sequence) -> int | None:
        """LongRoPE: the first position this sequence's own forwards turn by the long table (None:
        no LongRoPE). Its prompt's chunks (fixed multiples of prefill_chunk) past the original
        context are long; a prompt within it is short, and so are its decode steps till then."""
        after = self.long_rope_after
        if after is None:
            return None
        return after // self.prefill_chunk * self.prefill_chunk if sequence.prompt_len > after else after

    def _keys(self, hashes: list[bytes], long_from: int | None) -> list[bytes]:
        """The pool's keys of blocks with these chain hashes, written short before long_from."""
        if self.long_rope_after is None:
            return hashes
        size = self.pool.block_size
        short = [
            size if long_from is None else min(max(long_from - i * size, 0), size) for i in range(len(hashes))
        ]
        return [side_tagged(digest, n) for digest, n in zip(hashes, short)]

    def before_forward(self, work: list[tuple[object, int, int]]) -> None:
        """Before a forward over work's (sequence, start, end): the window group's blocks
        (prepare_windows) and, for LongRoPE, where each sequence's keys turn long (a forward that
        ends past the original context writes its keys long)."""
        if self.long_rope_after is not None:
            for sequence, start, end in work:
                if end > self.long_rope_after and (sequence.long_from is None or start < sequence.long_from):
                    sequence.long_from = start
        self.prepare_windows(work)

    def prepare_windows(self, work: list[tuple[object, int, int]]) -> None:
        """Before a forward over work's (sequence, start, end): each sequence's window blocks left
        of what its queries from `start` on can see are released, and the blocks of positions
        start .. end - 1 taken (see the module docstring). `start` never moves back: a rewind
        after lost drafts returns to the start of the step that fed them."""
        if self.window_pool is None:
            return
        size = self.window_pool.block_size
        for sequence, start, end in work:
            table = sequence.window_blocks
            first = max(0, start - self.window) // size  # the first block a query from start sees
            gone = [block for block in table[:first] if block != NO_BLOCK]
            table[: min(first, len(table))] = [NO_BLOCK] * min(first, len(table))
            self.window_pool.release(gone)
            table += [NO_BLOCK] * (self.window_pool.blocks_for(end) - len(table))
            missing = [j for j in range(first, len(table)) if table[j] == NO_BLOCK]
            taken = self.window_pool.allocate(len(missing))
            if taken is None:  # the sizing rule of window_blocks_held was broken
                raise RuntimeError(
                    f"the window pool has {self.window_pool.free} free blocks; a sequence needs {len(missing)} "
                    f"more for tokens {start}..{end - 1} (the pool is smaller than max_batch windows)"
                )
            for j, block in zip(missing, taken):
                table[j] = block

    def _release(self, sequence) -> None:
        """Give back every block the sequence holds, in both groups."""
        self.pool.release(sequence.blocks)
        sequence.blocks = []
        if self.window_pool is not None:
            self.window_pool.release([block for block in sequence.window_blocks if block != NO_BLOCK])
            sequence.window_blocks, sequence.window_registered = [], 0

    def drop_cancelled_waiting(self) -> None:
        """Waiting sequences whose client went away leave the queue."""
        for sequence in [s for s in self.waiting if s.request.cancelled.is_set()]:
            self.waiting.remove(sequence)
            self.on_waiting(-1)
            sequence.finish_reason = sequence.finish_reason or "cancelled"

    def _leave_queue(self) -> None:
        self.waiting.popleft()
        self.on_waiting(-1)

    # ---- what a step computes ----

    def budget(self) -> int:
        """Prompt tokens this step may compute (see IDLE_BUDGET_FACTOR)."""
        decoding = any(not s.in_prefill for s in self.running)
        return self.prefill_budget * (1 if decoding else IDLE_BUDGET_FACTOR)

    def prefill_plan(self, budget: int) -> list[tuple[object, int, int]]:
        """This step's prompt chunks, (sequence, start, end), in admission order within the
        budget; chunk boundaries are fixed multiples of prefill_chunk."""
        plan = []
        for sequence in [s for s in self.running if s.in_prefill]:
            if budget <= 0:
                break
            start = sequence.computed
            end = min(start + self.prefill_chunk - start % self.prefill_chunk, sequence.prompt_len)
            plan.append((sequence, start, end))
            budget -= end - start
        return plan

    def decoding(self) -> list:
        """The running sequences past their prompt (each needs a decode step)."""
        return [s for s in self.running if not s.in_prefill and s.finish_reason is None]

    # ---- room in the pool ----

    def make_room(self, decoding: list) -> tuple[list, list]:
        """Give every decoding sequence a slot for its next token, preempting the newest
        sequences while the pool has no free block. Returns (ready: those that decode this
        step, ended: a sequence that alone filled the pool, finished with "length" and out of
        the batch; the caller tells its client)."""
        ready, ended = [], []
        for sequence in sorted(decoding, key=lambda s: s.arrival):
            if sequence.finish_reason is not None or sequence not in self.running:
                continue
            while self.pool.blocks_for(sequence.computed + 1) > len(sequence.blocks):
                block = self.pool.allocate(1)
                if block is not None:
                    sequence.blocks += block
                    continue
                victim = newest(self.running)
                if victim is sequence and len(self.running) == 1:
                    sequence.finish_reason = "length"  # alone, it fills the whole pool
                    self.finish(sequence)
                    ended.append(sequence)
                    break
                self.preempt(victim)
                if victim is sequence:
                    break
            if sequence in self.running and sequence.finish_reason is None:
                ready.append(sequence)
        return [s for s in ready if s in self.running], ended

    def preempt(self, sequence) -> None:
        """Free the sequence's blocks and put it first in the queue (it replays when readmitted)."""
        self._release(sequence)
        sequence.computed, sequence.registered = 0, 0
        self.running.remove(sequence)
        self.waiting.appendleft(sequence)
        self.on_waiting(1)
        self.preemptions += 1

    def finish(self, sequence) -> None:
        """A finished sequence leaves the batch; its blocks serve others at once (its cached
        ones stay findable until then)."""
        if sequence in self.running:
            self.running.remove(sequence)
            self._release(sequence)

    def clear(self) -> list:
        """Every sequence held (running, then waiting), their blocks released and the queue and
        the batch emptied (the engine failed: the caller fails them)."""
        held = self.running + list(self.waiting)
        for sequence in held:
            if sequence.blocks:
                self._release(sequence)
        self.running, self.waiting = [], deque()
        return held


def newest(running: list):
    """The sequence preempted when the pool is full: the last to arrive, so that the earlier
    ones keep their places (first come, first served)."""
    return max(running, key=lambda s: s.arrival)
