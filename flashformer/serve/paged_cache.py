"""A paged KV cache (PagedAttention's idea): every sequence's keys and values
live in fixed-size blocks of one pool, preallocated once, found through the
sequence's block table.

    pool = BlockPool(num_blocks=512, block_size=16)
    caches, batch = make_paged_caches(model, pool)
    blocks = pool.allocate(3)                         # a sequence grows by whole blocks
    batch.set(block_tables, seq_lens, slots)          # what the next forward reads and writes
    model(input_ids, position_ids=..., kv_caches=caches)
    pool.release(blocks)                              # a finished sequence returns them at once

A sequence of n tokens holds ceil(n / block_size) blocks wherever they are in
the pool, so memory is never reserved for tokens a sequence may not reach,
and a finished sequence's blocks serve the next one at once. The first
`reserved` blocks are kept aside: the rows that pad a batch to its fixed
size write there (each to a slot of its own) and read only them, so they
never touch a sequence's blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashformer.attention.paged import packed_paged_attention, paged_attention, write_kv
from flashformer.generate.cache import cache_dtype


class BlockPool:
    """Which of num_blocks blocks are free. Allocation is all or nothing.
    Blocks 0 .. reserved - 1 are scratch, never given out."""

    def __init__(self, num_blocks: int, block_size: int, reserved: int = 1):
        if block_size < 1 or reserved < 1 or num_blocks <= reserved:
            raise ValueError(
                f"a block pool needs block_size >= 1 and num_blocks > reserved >= 1 (scratch blocks); "
                f"got num_blocks={num_blocks}, block_size={block_size}, reserved={reserved}"
            )
        self.num_blocks, self.block_size, self.reserved = num_blocks, block_size, reserved
        self._free = list(range(num_blocks - 1, reserved - 1, -1))  # a stack: low blocks first

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    @property
    def capacity(self) -> int:
        """Blocks sequences can hold (all but the scratch blocks)."""
        return self.num_blocks - self.reserved

    def scratch_slot(self, row: int) -> tuple[int, int]:
        """(block, slot) where padding row `row` writes: a slot of its own in the scratch blocks."""
        block = row // self.block_size
        if block >= self.reserved:
            raise ValueError(f"padding row {row} needs more than the {self.reserved} scratch blocks")
        return block, block * self.block_size + row % self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, count: int) -> list[int] | None:
        """`count` blocks, or None (and nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        taken, self._free = self._free[len(self._free) - count :], self._free[: len(self._free) - count]
        return taken[::-1]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class PagedBatch:
    """What one forward pass reads and writes, shared by every layer's cache:
    block_tables (B, max_blocks) int32, seq_lens (B,) int32 (keys each row
    holds after this pass), slots (B, L) int64 (where the L new tokens of
    each row go: block * block_size + offset, all distinct).

    Packed (q_starts given): the forward's input is one row of T tokens, the
    new tokens of S sequences one after another (sequence s: tokens q_starts[s]
    .. q_starts[s + 1] - 1); block_tables and seq_lens have S rows, slots is (1, T)."""

    def __init__(self):
        self.block_tables = self.seq_lens = self.slots = self.q_starts = None
        self.real_rows = 0

    def set(
        self,
        block_tables: Tensor,
        seq_lens: Tensor,
        slots: Tensor,
        real_rows: int | None = None,
        q_starts: Tensor | None = None,
    ) -> None:
        """real_rows: the rows that are sequences; the rest only pad the batch (their
        attention output is left zero: nothing reads it)."""
        self.block_tables, self.seq_lens, self.slots = block_tables, seq_lens, slots
        self.real_rows = block_tables.shape[0] if real_rows is None else real_rows
        self.q_starts = q_starts


class PagedKVCache:
    """One self-attention layer's share of the pool: keys and values
    (Hk, num_blocks, block_size, D). The attention layer hands it the new
    keys and values and the queries (`attend`): they are written to their
    slots and the queries attend over each row's blocks."""

    paged = True

    def __init__(self, pool: BlockPool, batch: PagedBatch, kv_heads: int, head_dim: int, dtype, device):
        shape = (kv_heads, pool.num_blocks, pool.block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.batch = batch

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        scale: float,
        window: tuple[int | None, int | None] | None = None,
        softcap: float | None = None,
    ) -> Tensor:
        """q (B, Hq, L, D), k and v (B, Hk, L, D) the new tokens -> (B, Hq, L, D); window and
        softcap are the layer's (a sliding-window layer keeps every key in the pool and reads
        only its window). (The batch's tables and slots were checked once, when set, not per layer.)"""
        write_kv(self.k, self.v, k, v, self.batch.slots, validate=False)
        if self.batch.q_starts is not None:  # one row of T tokens from S sequences
            out = packed_paged_attention(
                q[0].transpose(0, 1),  # (T, Hq, D)
                self.k,
                self.v,
                self.batch.block_tables,
                self.batch.seq_lens,
                self.batch.q_starts,
                scale=scale,
                window=window,
                softcap=softcap,
                validate=False,
            )  # (T, Hq, Dv)
            return out.transpose(0, 1)[None]  # (1, Hq, T, Dv)
        real = self.batch.real_rows
        tables, lengths = self.batch.block_tables[:real], self.batch.seq_lens[:real]
        out = paged_attention(
            q[:real],
            self.k,
            self.v,
            tables,
            lengths,
            scale=scale,
            window=window,
            softcap=softcap,
            validate=False,
        )
        if real == q.shape[0]:
            return out
        return torch.cat([out, out.new_zeros(q.shape[0] - real, *out.shape[1:])])  # (B, Hq, L, D)


def make_paged_caches(model, pool: BlockPool) -> tuple[list[PagedKVCache], PagedBatch]:
    """One PagedKVCache per decoder layer of `model`, all sharing one PagedBatch."""
    config = model.config
    if config.arch != "decoder":
        raise ValueError(f"a paged cache serves decoder models; got arch {config.arch!r}")
    if config.position in ("alibi", "relative"):
        raise ValueError(f"paged attention does not take {config.position} position biases")
    device = next(model.parameters()).device
    dtype = cache_dtype(model, device)
    batch = PagedBatch()
    caches = [
        PagedKVCache(pool, batch, config.n_kv_heads, config.head_dim, dtype, device)
        for _ in range(config.n_layers)
    ]
    return caches, batch
