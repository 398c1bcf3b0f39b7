"""Attention over a paged KV cache (PagedAttention's layout, as in vLLM).

A server that batches requests continuously cannot give each sequence a
(max_len, D) slab of cache: it would reserve memory for tokens that never come.
Instead each layer owns one pool of fixed-size blocks, and each sequence owns a
list of blocks, in order (its row of the block table):

    k_pool, v_pool   (Hk, num_blocks, block_size, D)   one pair per layer, preallocated
    block_tables     (B, max_blocks) int32             the blocks of sequence b, in order
    seq_lens         (B,) int32                        the keys sequence b holds, newest included

Key position p of sequence b lives in block block_tables[b, p // block_size],
at offset p % block_size; its slot, block * block_size + offset, is its row in
the pool viewed as (Hk, num_blocks * block_size, D). Gathering a sequence's
blocks along dim 1 gives (Hk, n_blocks, block_size, D), a free view as
(Hk, n_blocks * block_size, D). Table entries past a sequence's last block are
never read.

A step writes its new keys and values first (`write_kv`, at slots from
`kv_slots`), then attends (`paged_attention`): the Lq queries of a row are the
last Lq positions of its sequence (bottom-right causal, as in attention()).

Backends:
- "triton": the split-KV decoding kernel (triton/decode.py) reading each key
  tile's rows through the block table; nothing is gathered. Splits have a fixed
  length and are combined in order, up to each sequence's own last split.
- "cpu": the C++ kernel of attention/cpu_kernel.py, float32, one
  call for the whole batch: a task per (sequence, KV head) reads the
  sequence's blocks in place, in order, once for all its query heads (GQA),
  with an online softmax block by block.
- "flash", "eager", "torch": for each sequence, its blocks are gathered (one
  copy of exactly its keys) and attention() runs on them with that backend.
- "auto": triton on CUDA where it supports the request; "cpu" for float32
  decode steps (Lq <= 8) on the CPU when the C++ kernels are built
  (kernels/extension.py); otherwise each sequence goes to
  attention(backend="auto").

Batch invariance: the output for sequence b is bitwise the same whether it is
computed alone or in any batch. The per-sequence backends get it by
construction: sequence b's computation sees a fresh copy of its own keys and
queries and the same shapes whatever the batch; so does the "cpu" kernel, whose
task for sequence b reads only b's blocks, in an order set by b's length. The Triton kernel gets it from
its fixed splits and in-order combine (no tile size, split or reduction order
depends on the other rows). A padded CPU formulation (every sequence's blocks
gathered, one attention() call with a key padding mask) copies the keys and
computes the padding; through SDPA it was not invariant either, its reductions'
length following the longest sequence (docs/benchmarks.md, "Paged attention on
the CPU").
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashformer.attention import cpu_kernel
from flashformer.attention.api import attention
from flashformer.attention.checks import (
    FLOAT_DTYPES,
    check_alibi,
    check_kv_dtypes,
    check_scale,
    check_softcap,
    check_window,
    is_float16_cache,
)
from flashformer.attention.masks import ScoreRules
from flashformer.kernels import extension

PAGED_BACKENDS = ("auto", "cpu", "eager", "flash", "torch", "triton")
INDEX_DTYPES = (torch.int32, torch.int64)


def paged_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    validate: bool = True,
):
    """Causal attention of the newest Lq queries of each sequence to its paged keys.

    q: (B, Hq, Lq, D), query i of row b at key position seq_lens[b] - Lq + i
    (the same Lq for every row; Lq = 1 for a decode step). k_pool (Hk,
    num_blocks, block_size, D), v_pool (Hk, num_blocks, block_size, Dv), in q's
    dtype (or float16 pools for a float32 q, as in attention()) and on its device, Hq % Hk == 0 (MHA, GQA, MQA). block_tables:
    (B, max_blocks) int32/int64; seq_lens: (B,) int32/int64, each in
    [0, max_blocks * block_size]. A query with no key (seq_lens[b] < Lq, or
    an empty sequence) gets output 0 and lse -inf.

    scale (default 1/sqrt(D)), softcap, alibi_slopes ((Hq,) or (B, Hq)) and
    window ((left, right) around the diagonal) mean what they mean in
    attention(). backend: see the module docstring. validate: check the
    values of block_tables and seq_lens against the pool (a device sync on
    CUDA; a caller that checks them once per step may pass False for its
    layers). Shapes, dtypes and devices are always checked.

    Returns out (B, Hq, Lq, Dv) in q's dtype, accumulated in float32; with
    return_lse also lse (B, Hq, Lq) float32 (float64 for float64 inputs).
    Inference only: no gradient flows back into q or the pools.
    """
    rules = _check_paged(q, k_pool, v_pool, block_tables, seq_lens, alibi_slopes, window, softcap, validate)
    scale = check_scale(scale, q.shape[-1])
    if backend not in PAGED_BACKENDS:
        raise ValueError(f"backend must be one of {PAGED_BACKENDS}; got {backend!r}")
    if backend == "auto" and _triton_takes(q, k_pool, v_pool, rules):
        backend = "triton"
    if backend == "auto" and _cpu_kernel_takes(q):
        backend = "cpu"
    if backend == "triton" and k_pool.dtype != q.dtype:  # its kernel reads q's dtype: a widened copy
        k_pool, v_pool = k_pool.to(q.dtype), v_pool.to(q.dtype)
    with torch.no_grad():
        if backend == "triton":  # imported here so that flashformer never needs Triton unless asked for it
            from flashformer.attention.triton import triton_paged_attention

            out, lse = triton_paged_attention(q, k_pool, v_pool, block_tables, seq_lens, rules, scale)
        elif backend == "cpu":
            out, lse = _cpu_paged_attention(q, k_pool, v_pool, block_tables, seq_lens, rules, scale)
        else:  # "auto" here: attention() chooses for each sequence
            out, lse = _attend_each_sequence(
                q, k_pool, v_pool, block_tables, seq_lens, rules, scale, backend, return_lse
            )
    return (out, lse) if return_lse else out


def _triton_takes(q: Tensor, k_pool: Tensor, v_pool: Tensor, rules: ScoreRules) -> bool:
    """backend="auto" runs the Triton kernel on CUDA tensors it supports."""
    if q.device.type != "cuda" or k_pool.dtype != q.dtype:
        return False
    from flashformer.attention.triton import unsupported

    return unsupported(q, k_pool, v_pool, rules) is None


# "auto" on the CPU: the kernel for decode steps, per-sequence SDPA for prompt chunks
CPU_KERNEL_MAX_Q_LEN = 8


def _cpu_kernel_takes(q: Tensor) -> bool:
    """backend="auto" runs the C++ kernel on float32 CPU tensors when it is built, for up to
    CPU_KERNEL_MAX_Q_LEN queries a row: decode steps, where one call beats a call per sequence;
    a prompt chunk is faster through SDPA, as the kernel's queries loop over the keys one row at
    a time (docs/benchmarks.md, "Paged attention on the CPU")."""
    return q.shape[2] <= CPU_KERNEL_MAX_Q_LEN and cpu_kernel.cpu_kernel_runs(q)


def _cpu_paged_attention(q, k_pool, v_pool, block_tables, seq_lens, rules: ScoreRules, scale: float):
    if q.device.type != "cpu" or q.dtype != torch.float32:
        raise ValueError(f"backend='cpu' takes float32 CPU tensors; got q {q.dtype} on {q.device}")
    if not extension.cpp_kernels():
        raise RuntimeError("backend='cpu' needs flashformer's C++ CPU kernels, which could not be built here")
    return cpu_kernel.run_batched(q, k_pool, v_pool, block_tables, seq_lens, rules, scale)


def packed_paged_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    q_starts: Tensor,
    *,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    validate: bool = True,
) -> Tensor:
    """paged_attention for sequences with different numbers of new queries, packed one after
    another (a server's step: one token of each decoding sequence and a chunk of a prompt).

    q: (T, Hq, D), sequence s's queries are rows q_starts[s] .. q_starts[s + 1] - 1, the newest
    positions of its seq_lens[s] keys (bottom-right causal). q_starts: (S + 1,) int, from 0 to T;
    block_tables (S, max_blocks), seq_lens (S,) as in paged_attention (validate: check the
    values of block_tables, seq_lens and q_starts); scale, window and softcap as there. Returns (T, Hq, Dv). float32 on the CPU runs
    the C++ kernel in one call; anything else, paged_attention per sequence. Each sequence's
    result is what it gets alone (batch invariance).
    """
    if not isinstance(q, Tensor) or q.dim() != 3 or 0 in q.shape:
        raise ValueError(f"q must be a 3-D tensor (T, Hq, D) with T, Hq, D >= 1; got {_describe(q)}")
    _check_index(block_tables, "block_tables", 2, "(S, max_blocks)", q.device)
    _check_index(q_starts, "q_starts", 1, "(S + 1,)", q.device)
    sequences = block_tables.shape[0]
    if q_starts.shape[0] != sequences + 1:
        raise ValueError(
            f"q_starts must have S + 1 = {sequences + 1} entries for block_tables of {sequences} rows; "
            f"got {tuple(q_starts.shape)}"
        )
    # paged_attention's checks, on one query per sequence
    one_each = q[:1, None].expand(sequences, -1, -1, -1).transpose(1, 2)  # (S, Hq, 1, D)
    rules = _check_paged(one_each, k_pool, v_pool, block_tables, seq_lens, None, window, softcap, validate)
    if validate:
        bounds = q_starts.tolist()
        if bounds[0] != 0 or bounds[-1] != q.shape[0] or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"q_starts must rise from 0 to T = {q.shape[0]} (q's rows); got {bounds}")
    scale = check_scale(scale, q.shape[-1])
    if cpu_kernel.cpu_kernel_runs(q):
        with torch.no_grad():
            return cpu_kernel.run_packed(q, k_pool, v_pool, block_tables, seq_lens, q_starts, rules, scale)[0]
    bounds = q_starts.tolist()
    out = q.new_zeros(q.shape[0], q.shape[1], v_pool.shape[3])  # (T, Hq, Dv)
    for s, (begin, end) in enumerate(zip(bounds, bounds[1:])):
        if end > begin:
            rows = q[begin:end].transpose(0, 1)[None]  # (1, Hq, n, D)
            result = paged_attention(
                rows,
                k_pool,
                v_pool,
                block_tables[s : s + 1],
                seq_lens[s : s + 1],
                scale=scale,
                window=window,
                softcap=softcap,
                validate=False,
            )
            out[begin:end] = result[0].transpose(0, 1)
    return out


def _attend_each_sequence(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    rules: ScoreRules,
    scale: float,
    backend: str,
    return_lse: bool,
) -> tuple[Tensor, Tensor | None]:
    """Gather each sequence's keys (exactly seq_lens[b] of them) and run attention() on them.

    Sequence b's call sees a fresh copy of its queries and keys (allocated
    alike whatever the batch: no kernel can take another path for another
    alignment) and shapes that depend on sequence b alone, so its result
    does not depend on the batch.
    """
    batch, q_heads, q_len, _ = q.shape
    block_size, dim_v = k_pool.shape[2], v_pool.shape[3]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_zeros(batch, q_heads, q_len, dim_v)
    lse = torch.full((batch, q_heads, q_len), float("-inf"), dtype=lse_dtype, device=q.device)
    slopes = rules.alibi_slopes  # (B|1, Hq, 1, 1) float32/float64, or None
    for b, length in enumerate(seq_lens.tolist()):
        if length == 0:
            continue
        blocks = block_tables[b, : -(-length // block_size)]
        k = k_pool.index_select(1, blocks).flatten(1, 2)[None, :, :length]  # (1, Hk, length, D)
        v = v_pool.index_select(1, blocks).flatten(1, 2)[None, :, :length]  # (1, Hk, length, Dv)
        result = attention(
            q[b : b + 1].clone(),  # (1, Hq, Lq, D), a fresh copy
            k,
            v,
            causal=True,
            window=(rules.window_left, rules.window_right),
            alibi_slopes=None if slopes is None else slopes[b % slopes.shape[0], :, 0, 0],
            softcap=rules.softcap,
            scale=scale,
            backend=backend,
            return_lse=return_lse,
        )
        if return_lse:
            out[b], lse[b] = result[0][0], result[1][0]
        else:
            out[b] = result[0]
    return out, (lse if return_lse else None)


# ---- writing new keys and values ----


def kv_slots(block_tables: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """The pool slots (block * block_size + offset) of key positions of each sequence.

    block_tables: (B, max_blocks) int32/int64; positions: (B, L) int, each in
    [0, max_blocks * block_size). Returns (B, L) int64. The slots of the Lq
    newest tokens of a step: positions = seq_lens[:, None] - Lq + torch.arange(Lq).
    """
    _check_index(block_tables, "block_tables", 2, "(B, max_blocks)", block_tables.device)
    _check_index(positions, "positions", 2, "(B, L)", block_tables.device)
    if positions.shape[0] != block_tables.shape[0]:
        raise ValueError(
            f"positions (B, L) and block_tables (B, max_blocks) must have one row per sequence; got "
            f"positions {tuple(positions.shape)}, block_tables {tuple(block_tables.shape)}"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int; got {block_size!r}")
    capacity = block_tables.shape[1] * block_size
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= capacity):
        raise ValueError(
            f"positions must lie in [0, max_blocks * block_size = {capacity}) for block_tables "
            f"{tuple(block_tables.shape)} and block_size {block_size}; got values in "
            f"[{int(positions.min())}, {int(positions.max())}]"
        )
    positions = positions.long()
    blocks = block_tables.long().gather(1, positions // block_size)  # (B, L)
    return blocks * block_size + positions % block_size


def write_kv(
    k_pool: Tensor, v_pool: Tensor, k_new: Tensor, v_new: Tensor, slots: Tensor, *, validate: bool = True
) -> None:
    """Store new keys and values in their slots of the pools, in place.

    k_new: (B, Hk, L, D), v_new: (B, Hk, L, Dv) (the layout of MultiHeadAttention's
    k and v; a packed batch of T tokens is B = 1, L = T); slots: (B, L)
    int32/int64, slot = block * block_size + offset (kv_slots), all distinct.
    k_new and v_new must have the pools' dtype (or float32 for float16 pools: rounded to them)
    and device. validate: check that
    the slots are distinct and inside the pool (a device sync on CUDA).
    """
    _check_pools(k_pool, v_pool)
    kv_heads, num_blocks, block_size, _ = k_pool.shape
    for name, new, pool in (("k_new", k_new, k_pool), ("v_new", v_new, v_pool)):
        if not isinstance(new, Tensor) or new.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, Hk, L, D); got {_describe(new)}")
        if new.shape[1] != kv_heads or new.shape[3] != pool.shape[3]:
            raise ValueError(
                f"{name} (B, Hk, L, D) must have the heads and head dim of its pool (Hk, num_blocks, "
                f"block_size, D); got {name} {tuple(new.shape)}, pool {tuple(pool.shape)}"
            )
        if (
            new.dtype != pool.dtype and not is_float16_cache(new.dtype, pool.dtype)
        ) or new.device != pool.device:
            raise TypeError(
                f"{name} must have its pool's dtype and device ({pool.dtype} on {pool.device}); "
                f"got {new.dtype} on {new.device}"
            )
    if k_new.shape[:3] != v_new.shape[:3]:
        raise ValueError(
            f"k_new and v_new must share (B, Hk, L); got {tuple(k_new.shape)} and {tuple(v_new.shape)}"
        )
    _check_index(slots, "slots", 2, "(B, L)", k_pool.device)
    if slots.shape != (k_new.shape[0], k_new.shape[2]):
        raise ValueError(
            f"slots must have shape (B, L) = {(k_new.shape[0], k_new.shape[2])} to match k_new "
            f"{tuple(k_new.shape)}; got {tuple(slots.shape)}"
        )
    if validate and slots.numel():
        low, high = int(slots.min()), int(slots.max())
        if low < 0 or high >= num_blocks * block_size:
            raise ValueError(
                f"slots must lie in [0, num_blocks * block_size = {num_blocks * block_size}); "
                f"got values in [{low}, {high}]"
            )
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("slots must be distinct: two new tokens were given the same slot")
    slots = slots.reshape(-1).long()
    blocks, offsets = slots // block_size, slots % block_size  # (B*L,)
    k_pool[:, blocks, offsets] = k_new.transpose(0, 1).reshape(kv_heads, -1, k_new.shape[3]).to(k_pool.dtype)
    v_pool[:, blocks, offsets] = v_new.transpose(0, 1).reshape(kv_heads, -1, v_new.shape[3]).to(v_pool.dtype)


# ---- argument checks ----


def _check_paged(q, k_pool, v_pool, block_tables, seq_lens, alibi_slopes, window, softcap, validate):
    """Checks every argument of paged_attention; returns its ScoreRules (k_len: the table's capacity)."""
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a 4-D tensor (B, Hq, Lq, D); got {_describe(q)}")
    if q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"q must be float16, bfloat16, float32 or float64; got {q.dtype}")
    if 0 in q.shape:
        raise ValueError(f"q must not have an empty dimension; got shape {tuple(q.shape)}")
    _check_pools(k_pool, v_pool)
    batch, q_heads, q_len, dim = q.shape
    kv_heads, num_blocks, block_size, _ = k_pool.shape
    check_kv_dtypes(q.dtype, k_pool.dtype, v_pool.dtype, "k_pool", "v_pool")
    if k_pool.device != q.device or v_pool.device != q.device:
        raise ValueError(
            f"q, k_pool and v_pool must be on one device; got {q.device}, {k_pool.device}, {v_pool.device}"
        )
    if k_pool.shape[3] != dim:
        raise ValueError(
            f"q (B, Hq, Lq, D) and k_pool (Hk, num_blocks, block_size, D) must share the head dim D; "
            f"got q {tuple(q.shape)}, k_pool {tuple(k_pool.shape)}"
        )
    if q_heads % kv_heads:
        raise ValueError(
            f"the query heads Hq must be a multiple of the key/value heads Hk; got q {tuple(q.shape)} "
            f"(Hq={q_heads}), k_pool {tuple(k_pool.shape)} (Hk={kv_heads})"
        )
    _check_index(block_tables, "block_tables", 2, "(B, max_blocks)", q.device)
    _check_index(seq_lens, "seq_lens", 1, "(B,)", q.device)
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(
            f"block_tables (B, max_blocks) and seq_lens (B,) must have a row per query row, B = {batch} "
            f"(q {tuple(q.shape)}); got block_tables {tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)}"
        )
    if validate:
        _check_table_values(block_tables, seq_lens, num_blocks, block_size)
    window_left, window_right = check_window(window)
    return ScoreRules(
        batch=batch,
        q_heads=q_heads,
        q_len=q_len,
        k_len=block_tables.shape[1] * block_size,
        causal=True,
        window_left=window_left,
        window_right=window_right,
        alibi_slopes=None if alibi_slopes is None else check_alibi(alibi_slopes, batch, q_heads, q.device),
        softcap=check_softcap(softcap),
    )


def _check_pools(k_pool, v_pool) -> None:
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(pool, Tensor) or pool.dim() != 4:
            raise ValueError(
                f"{name} must be a 4-D tensor (Hk, num_blocks, block_size, D); got {_describe(pool)}"
            )
        if 0 in pool.shape:
            raise ValueError(f"{name} must not have an empty dimension; got shape {tuple(pool.shape)}")
    if v_pool.shape[:3] != k_pool.shape[:3]:
        raise ValueError(
            f"v_pool must have the heads, blocks and block size of k_pool (Hk, num_blocks, block_size, Dv); "
            f"got k_pool {tuple(k_pool.shape)}, v_pool {tuple(v_pool.shape)}"
        )


def _check_index(t, name: str, dims: int, shape: str, device) -> None:
    if not isinstance(t, Tensor) or t.dim() != dims or t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be an int32/int64 tensor of shape {shape}; got {_describe(t)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}; got {t.device}")


def _check_table_values(block_tables: Tensor, seq_lens: Tensor, num_blocks: int, block_size: int) -> None:
    """seq_lens within each table row's capacity; the entries a sequence uses name blocks of the pool."""
    capacity = block_tables.shape[1] * block_size
    too_long = (seq_lens < 0) | (seq_lens > capacity)
    if bool(too_long.any()):
        b = int(too_long.nonzero()[0, 0])
        raise ValueError(
            f"seq_lens must lie in [0, max_blocks * block_size = {capacity}] (block_tables "
            f"{tuple(block_tables.shape)}, block_size {block_size}); got seq_lens[{b}] = {int(seq_lens[b])}"
        )
    used_blocks = (seq_lens.long() + block_size - 1) // block_size  # (B,)
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < used_blocks[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))  # (B, max_blocks)
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"block_tables[{b}, {j}] = {int(block_tables[b, j])} is not a block of the pool (num_blocks = "
            f"{num_blocks}); sequence {b} holds {int(seq_lens[b])} keys in its first {int(used_blocks[b])} blocks"
        )


def _describe(x) -> str:
    if isinstance(x, Tensor):
        return f"tensor of dtype {x.dtype} and shape {tuple(x.shape)}"
    return type(x).__name__
