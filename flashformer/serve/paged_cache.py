"""A paged KV cache (PagedAttention's idea): every sequence's keys and values
live in fixed-size blocks of one pool, preallocated once, found through the
sequence's block table.

    pool = BlockPool(num_blocks=512, block_size=16)
    caches, batch, _ = make_paged_caches(model, pool)
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

Prefix caching (BlockPool): full computed blocks are registered under a
hash of their tokens chained with every block before them; a later sequence
that begins with the same tokens holds those blocks too (reference counts)
instead of computing them again, and blocks nobody holds stay findable,
evicted least recently released first, until an allocation needs them.
The scheduler decides which blocks may be registered and reused.

Sliding-window layers (Gemma 2/3's local layers beside full ones) get a pool of their own, the
window group: a sequence holds there only the blocks its next queries can still see, so a 32K
chat costs those layers a window's worth of keys, not 32K (vLLM's hybrid KV cache manager does
the same). A sequence's window table has the full table's width; entries left of its window are
released (NO_BLOCK, read as the scratch block 0, never seen by a query). Their blocks are chain-
hashed like the full group's, so a cached window serves a later prompt that begins the same way.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from torch import Tensor

from flashformer.attention.paged import packed_paged_attention, paged_attention, write_kv
from flashformer.generate.cache import kv_types
from flashformer.kernels import kv_blocks

NO_BLOCK = -1  # a window table's entry left of the sequence's window: released, never read


class BlockPool:
    """Which of num_blocks blocks are free, how many sequences hold each, and which hold a
    cached prefix. Allocation is all or nothing. Blocks 0 .. reserved - 1 are scratch, never
    given out.

    Prefix caching (vLLM's automatic prefix caching): a full block whose keys and values are
    computed can be registered under its chain hash (`block_hash`: its tokens and the hash of
    every block before it, so one hash names the whole prefix up to the block's end). Another
    sequence whose tokens begin the same way finds the longest run of such blocks (`lookup`)
    and holds them too (`share`): a reference count says how many sequences hold a block. A
    block nobody holds is free; a free block that holds a cached prefix stays findable, in
    least-recently-released order, until an allocation finds no never-cached block left and
    takes it (its hash is forgotten then). A sequence's blocks are released last block first,
    so its tail (the part least likely shared) goes before its head.

    The hash covers the tokens only: one pool serves one model with one quantization and one
    KV dtype (an Engine owns it), and nothing else changes a block's keys and values."""

    def __init__(self, num_blocks: int, block_size: int, reserved: int = 1):
        if block_size < 1 or reserved < 1 or num_blocks <= reserved:
            raise ValueError(
                f"a block pool needs block_size >= 1 and num_blocks > reserved >= 1 (scratch blocks); "
                f"got num_blocks={num_blocks}, block_size={block_size}, reserved={reserved}"
            )
        self.num_blocks, self.block_size, self.reserved = num_blocks, block_size, reserved
        self._empty = list(range(num_blocks - 1, reserved - 1, -1))  # never cached: a stack, low first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free and cached: oldest first
        self._refs = [0] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    @property
    def free(self) -> int:
        """Blocks an allocation may take (cached ones nobody holds included)."""
        return len(self._empty) + len(self._evictable)

    @property
    def in_use(self) -> int:
        """Blocks some sequence holds."""
        return self.capacity - self.free

    @property
    def cached(self) -> int:
        """Blocks holding a registered prefix, held or not."""
        return len(self._by_hash)

    @property
    def cached_free(self) -> int:
        """Cached blocks nobody holds (kept until an allocation needs them)."""
        return len(self._evictable)

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
        """`count` blocks, each held once, or None (and nothing taken) when fewer are free:
        never-cached blocks first, then the least recently released cached ones."""
        if count > self.free:
            return None
        taken = [self._empty.pop() for _ in range(min(count, len(self._empty)))]
        while len(taken) < count:
            block, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(block)]
            taken.append(block)
        for block in taken:
            self._refs[block] = 1
        return taken

    def release(self, blocks: list[int]) -> None:
        """One holder fewer for each block; a block nobody holds is free (still findable when
        cached). Last block first: a sequence's tail is evicted before its head."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._empty.append(block)

    # ---- the prefix cache ----

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest run of `hashes` (a sequence's chain hashes, first block
        first) that are cached; nothing is taken (see share)."""
        found = []
        for digest in hashes:
            block = self._by_hash.get(digest)
            if block is None:
                break
            found.append(block)
        return found

    def free_among(self, blocks: list[int]) -> int:
        """How many of `blocks` nobody holds (sharing them takes them from the free ones)."""
        return sum(self._refs[block] == 0 for block in blocks)

    def share(self, blocks: list[int]) -> None:
        """Hold cached blocks once more (a free one stops being evictable)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1

    def register(self, block: int, digest: bytes) -> None:
        """Make a held block, full and computed, findable under `digest`. A prefix already
        cached in another block (two sequences computed it at once) keeps that one: this block
        stays uncached and is reused as an empty one when released."""
        if digest not in self._by_hash and block not in self._hash_of:
            self._by_hash[digest] = block
            self._hash_of[block] = digest


def block_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """The chain hash of a full block: SHA-256 of the previous block's hash and this block's
    token ids, so equal hashes mean equal prefixes (a collision, 2^-128 likely, is the only
    way two prefixes could share keys and values)."""
    digest = hashlib.sha256(parent or b"")
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def side_tagged(digest: bytes, short: int) -> bytes:
    """A LongRoPE block's key: its chain hash and how many of its tokens were turned by the short
    table (scheduler.py: the same tokens written long are other keys and values)."""
    return hashlib.sha256(digest + short.to_bytes(4, "little")).digest()


def extend_hashes(
    hashes: list[bytes], tokens: list[int], block_size: int, count: int, salt: bytes | None = None
) -> list[bytes]:
    """`hashes` (the chain hashes of the first full blocks of `tokens`) extended, in place, to
    the first `count` blocks (count * block_size <= len(tokens)); returns it. salt: the first
    block's parent (adapter_salt: a LoRA adapter's blocks chain apart from the base's)."""
    for i in range(len(hashes), count):
        hashes.append(
            block_hash(hashes[-1] if hashes else salt, tokens[i * block_size : (i + 1) * block_size])
        )
    return hashes


def adapter_salt(adapter: str | None, load: int = 0) -> bytes | None:
    """The parent of the first block of a sequence run with a LoRA adapter: the same tokens give
    other keys and values under another adapter, so its blocks must never be found by the base's
    or another adapter's sequences (vLLM keys its blocks by the LoRA the same way). load: which
    loading of that name (an adapter loaded again at run time may be another one). None: the
    base, whose hashes stay as they were. A 32-byte digest, as a parent block's hash is."""
    if adapter is None:
        return None
    return hashlib.sha256(f"flashformer lora adapter\0{load}\0{adapter}".encode()).digest()


def layer_windows(model) -> list[int | None]:
    """Each decoder layer's window: how many keys before the query it sees (None: all). A model
    with both kinds (and no global tokens, which a window would have to keep) splits its pools in
    two groups (make_paged_caches); otherwise every layer is in the one group."""
    config = model.config
    windows = [model.decoder.block(i).attn.window for i in range(config.n_layers)]
    lefts = [None if w is None else w[0] for w in windows]
    if None not in lefts or config.global_tokens:
        return [None] * config.n_layers
    return lefts


def window_of(model) -> int | None:
    """The keys before the query the model's sliding-window layers see, when they have a group
    of their own (layer_windows), else None. One window size per model (Gemma 2 and 3)."""
    sizes = {w for w in layer_windows(model) if w is not None}
    if len(sizes) > 1:
        raise ValueError(
            f"a paged cache takes one sliding-window size per model; this one has {sorted(sizes)}"
        )
    return sizes.pop() if sizes else None


def window_blocks_held(window: int, step_tokens: int, block_size: int) -> int:
    """The most window-group blocks a sequence holds at once: those of the `window` keys before a
    step's first query and of the step's tokens (at most step_tokens), at block granularity."""
    return (window + step_tokens - 1) // block_size + 2


def window_pool_for(
    model, pool: BlockPool, max_batch: int, step_tokens: int
) -> tuple[int | None, BlockPool | None]:
    """(the window, the window group's pool) for a model served from `pool`, or (None, None)
    when it has no window group: room for max_batch sequences' windows (window_blocks_held, a
    step computing at most step_tokens tokens of a sequence), never more blocks than `pool` (a
    sequence's window blocks stand for some of its full ones), the same scratch blocks."""
    window = window_of(model)
    if window is None:
        return None, None
    held = window_blocks_held(window, step_tokens, pool.block_size)
    blocks = min(pool.num_blocks, pool.reserved + max_batch * held)
    return window, BlockPool(blocks, pool.block_size, pool.reserved)


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

    def set(
        self, block_tables: Tensor, seq_lens: Tensor, slots: Tensor, q_starts: Tensor | None = None
    ) -> None:
        """Every row attends, padding rows included (over scratch slots of their own: the padded
        decode batch of a float model run eagerly, runner.py)."""
        self.block_tables, self.seq_lens, self.slots = block_tables, seq_lens, slots
        self.q_starts = q_starts


class PagedKVCache:
    """One self-attention layer's share of the pool: keys and values
    (Hk, num_blocks, block_size, D), each of its element type (kernels/kv_blocks.py: f32, f16,
    or q8_0 / q4_0 rows (..., row bytes), which only the native decoder reads and writes). The
    attention layer hands it the new keys and values and the queries (`attend`): they are
    written to their slots and the queries attend over each row's blocks."""

    paged = True

    def __init__(
        self,
        pool: BlockPool,
        batch: PagedBatch,
        kv_heads: int,
        head_dim: int,
        k_type: str,
        v_type: str,
        device,
    ):
        lead = (kv_heads, pool.num_blocks, pool.block_size)
        self.k_type, self.v_type = k_type, v_type
        self.k = kv_blocks.empty(k_type, lead, head_dim, device)
        self.v = kv_blocks.empty(v_type, lead, head_dim, device)
        self.batch = batch

    @property
    def quantized(self) -> bool:
        return kv_blocks.holds_blocks(self.k_type, self.v_type)

    @property
    def block_bytes(self) -> int:
        """The bytes one block of the pool takes in this layer (keys and values)."""
        return (self.k[:, 0].numel() * self.k.element_size()) + (self.v[:, 0].numel() * self.v.element_size())

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
        softcap are the layer's (a sliding-window layer reads only its window: of its group's pool
        when it has one, else of the shared pool). (The batch's tables and slots were checked
        once, when set, not per layer.)"""
        if self.quantized:
            raise ValueError(
                f"a {self.k_type} / {self.v_type} KV cache is read by the native decoder only; this model runs "
                f"its modules (cache types f32 or f16 serve it)"
            )
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
        return paged_attention(
            q,
            self.k,
            self.v,
            self.batch.block_tables,
            self.batch.seq_lens,
            scale=scale,
            window=window,
            softcap=softcap,
            validate=False,
        )  # (B, Hq, L, D), one call for the batch


def make_paged_caches(
    model,
    pool: BlockPool,
    cache_type_k: str | None = None,
    cache_type_v: str | None = None,
    window_pool: BlockPool | None = None,
) -> tuple[list[PagedKVCache], PagedBatch, PagedBatch | None]:
    """One PagedKVCache per decoder layer of `model`: the full-attention layers' in `pool`, sharing
    one PagedBatch, and, given window_pool, the sliding-window layers' there, sharing a second
    (layer_windows); keys and values of the types asked for (generate.cache.kv_types: the model's
    own float type by default). Returns (caches, batch, window batch or None)."""
    config = model.config
    if config.arch != "decoder":
        raise ValueError(f"a paged cache serves decoder models; got arch {config.arch!r}")
    if config.position in ("alibi", "relative"):
        raise ValueError(f"paged attention does not take {config.position} position biases")
    if config.attention_sinks or config.global_tokens:
        # refused here, when the server starts, not at the first request's step
        raise ValueError(
            "paged attention has no sink term and no global tokens: this model has "
            f"attention_sinks={config.attention_sinks} (gpt-oss), global_tokens={config.global_tokens}; "
            "it runs with generate() and chat, not served yet"
        )
    if "conv" in (config.layer_types or ()):
        raise ValueError(
            "the paged cache keeps keys and values, and this model's conv layers (LFM2's short "
            "convolutions, lfm2, layer_types 'conv') keep a state per sequence, which the server has no "
            "pool for yet; it runs with generate() and chat, not served yet"
        )
    if config.kv_shared_layers or config.global_head_dim not in (None, config.head_dim):
        raise ValueError(
            "paged attention keeps one block shape and each layer's own keys and values: this model has "
            f"kv_shared_layers={config.kv_shared_layers} and global_head_dim={config.global_head_dim} "
            f"beside head_dim={config.head_dim} (Gemma 4); it runs with generate() and chat, not served yet"
        )
    device = next(model.parameters()).device
    k_type, v_type = kv_types(model, device, cache_type_k, cache_type_v)
    windows = layer_windows(model) if window_pool is not None else [None] * config.n_layers
    if window_pool is not None and all(w is None for w in windows):
        raise ValueError(
            "window_pool: this model has no sliding-window layers beside full ones to keep there"
        )
    batch = PagedBatch()
    window_batch = PagedBatch() if window_pool is not None else None
    caches = [
        PagedKVCache(
            pool if window is None else window_pool,
            batch if window is None else window_batch,
            config.n_kv_heads,
            config.head_dim,
            k_type,
            v_type,
            device,
        )
        for window in windows
    ]
    return caches, batch, window_batch
