"""The engine's decode step with fixed shapes, compiled once per batch size at start.

A decode step feeds one token per sequence against the paged cache. Eagerly, its
Python (the layers' calls, the checks, the dispatch) costs more than its arithmetic
on a small model: the step is what `generate(compile=True)` compiles, and the
engine's step should cost what that one does. Here the step's inputs live in
preallocated tensors of a few fixed batch sizes (`buckets`):

    tokens, positions   (B, 1) int64     row r's token and its position
    block_tables        (B, max_blocks)  int32, row r's blocks (zeros past them)
    seq_lens            (B,) int32       keys row r holds after this step
    slots               (B, 1) int64     where row r's new key and value go

and each step copies the sequences' values into the smallest bucket that holds
them, the rows past them padding (each reads and writes a scratch slot of its own,
paged_cache.BlockPool.scratch_slot). The compiled function sees the same tensors,
with the same shapes, every time: one graph per bucket, traced and compiled by
`warm_up` before the server answers, every layer's attention one batched
paged-attention call over all B rows (attention.paged, its C++ kernel on the CPU).
Sampling stays outside: the step returns the logits of every row.

Which buckets: a float model's GEMM rows may round differently with the row count,
so its only bucket is max_batch (every step the same shape, runner.py). A model
whose every matmul is a quantized kernel computes each row alone, and the compiled
graph's other operations (norms, RoPE, residuals) are per row too, so a row's bits
do not depend on the bucket: 1, 4, 16, ... up to max_batch, so that one client pays
for one row, not max_batch (tests/serve check the tokens alone and among others).
Powers of 4 rather than of 2: every bucket is a graph to compile at the start (with
SmolLM2-135M's 30 layers, minutes of C++ compilation each on 2 loaded cores), and a
quantized step's cost grows slowly with its rows (the weights are read once for all).

torch.compile runs with dynamic=False (each bucket its own static graph; automatic
dynamic shapes would swap a graph for a symbolic one whose code may round
differently) and fails rather than silently falling back to eager past its
recompile limit (which would also change the bits). Inductor's on-disk FX graph
cache makes the next start with the same model and shapes faster (cli/serve.py
points it at a lasting folder).

What a step costs besides its kernels is dynamo's check that the graph still
fits its inputs (the guards) and the passing of those inputs. Only the block
tables' width is symbolic: with the pools' sizes symbolic too, each of
SmolLM2's 30 caches brought 4 symbolic sizes, 121 in all, each checked by a
Python guard and passed as a tensor, 2.6 ms of a 20 ms step on a 2-core AVX2
EPYC (17.3 ms with static pools). An engine with another pool shape compiles
graphs of its own. Once `warm_up` has run every bucket through the full guards,
it checks each bucket's guards once more itself and keeps the graph they chose,
which later steps call directly, without dynamo (generate.direct_step): every
input a step sees is one that warm-up saw, the same model, caches and bucket
tensors, with the same shapes, so no guard could fail. Where no graph passes
(a torch without dynamo's cache accessor), the steps skip the guards that
cannot tell the compiled graphs apart (torch.compiler.set_stance's
skip_guard_eval_unsafe, which still checks every tensor's shape and dtype),
1.9 ms of the 17.3 ms above; the direct call also drops what that still checks.
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch
from torch import Tensor

from flashformer.generate.direct_step import direct_call
from flashformer.kernels import extension
from flashformer.kernels.cpu import cpu_decode_step_options

# graphs one process may hold for the step: buckets x models x pool shapes (a test session
# builds many engines); past it torch.compile raises instead of running eagerly
RECOMPILE_LIMIT = 64

# a quantized model's buckets: 1, 4, 16, ... (see the module docstring)
BUCKET_GROWTH = 4


def buckets_for(max_batch: int, rows_alone: bool) -> tuple[int, ...]:
    """The batch sizes of the compiled step: max_batch alone for float matmuls; powers of
    BUCKET_GROWTH below it and max_batch when every row is computed alone (see the module
    docstring)."""
    if not rows_alone:
        return (max_batch,)
    sizes = {max_batch}
    size = 1
    while size < max_batch:
        sizes.add(size)
        size *= BUCKET_GROWTH
    return tuple(sorted(sizes))


def paged_decode_step(model, tokens: Tensor, positions: Tensor, caches: list) -> Tensor:
    """tokens, positions (B, 1) against the paged caches (their PagedBatch set) -> logits (B, V)
    float32."""
    out = model(tokens, position_ids=positions, kv_caches=caches, logits_to_keep=1)
    return out.logits[:, -1].float()


@functools.cache
def compiled_step(device_type: str):
    """paged_decode_step under torch.compile, made on first use (importing the compiler is
    slow), one per device type; dynamo keeps a graph per model and shape under it."""
    if device_type == "cpu":
        extension.load()  # the C++ kernels (paged attention's "cpu" backend) before tracing
    options = cpu_decode_step_options() if device_type == "cpu" else None
    return torch.compile(paged_decode_step, dynamic=False, options=options)


def let_table_width_vary(inputs) -> None:
    """The block tables' width (the context over the block size) is symbolic in the graph: one
    size, reaching only the attention call, so another context reuses the graphs. The pools'
    sizes stay static (see the module docstring: symbolic, they cost more than their graphs)."""
    for step_inputs in inputs:
        torch._dynamo.maybe_mark_dynamic(step_inputs.block_tables, 1)  # (B, max_blocks)


class StepInputs:
    """One bucket's preallocated inputs (see the module docstring)."""

    def __init__(self, rows: int, max_blocks: int, device):
        self.rows = rows
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.slots = torch.zeros(rows, 1, dtype=torch.long, device=device)


class DecodeStep:
    """One decode step over the paged cache, padded to a bucket (see the module docstring).

    caches, batch: the runner's PagedKVCaches and their shared PagedBatch; pool: the block
    pool (its scratch slots pad the rows); compile: torch.compile the step (False: the same
    padded step, eagerly)."""

    def __init__(
        self, model, caches, batch, pool, *, max_blocks: int, buckets: tuple[int, ...], compile: bool
    ):
        if max(buckets) > pool.reserved * pool.block_size:
            raise ValueError(
                f"a bucket of {max(buckets)} rows needs that many scratch slots; the pool keeps "
                f"{pool.reserved} scratch blocks of {pool.block_size}"
            )
        self.model, self.caches, self.batch, self.pool = model, caches, batch, pool
        self.buckets = buckets
        device = next(model.parameters()).device
        self.inputs = {rows: StepInputs(rows, max_blocks, device) for rows in buckets}
        self.compiled = compile
        self.step = compiled_step(device.type) if compile else paged_decode_step
        if compile:
            let_table_width_vary(self.inputs.values())
        self.warm_up_s: float | None = None  # seconds warm_up took (tracing and compiling)
        self.direct: dict = {}  # rows -> the bucket's graph called without dynamo, after warm-up

    def bucket(self, count: int) -> int:
        """The smallest bucket with room for `count` rows."""
        for rows in self.buckets:
            if rows >= count:
                return rows
        raise ValueError(f"a decode step of {count} sequences exceeds the largest bucket {self.buckets[-1]}")

    def __call__(self, sequences: list) -> Tensor:
        """Row r feeds token `computed` of sequence r (its blocks hold a slot for it); the logits
        (len(sequences), V) float32. Moves each sequence's `computed` on."""
        inputs = self.inputs[self.bucket(len(sequences))]
        self._fill(inputs, sequences)
        logits = self._run(inputs)
        for sequence in sequences:
            sequence.computed += 1
        return logits[: len(sequences)]

    @torch.no_grad()
    def warm_up(self) -> float:
        """Run every bucket once with padding rows only (each writes its scratch slot), so
        that tracing and compiling happen now and not in a client's request; the seconds."""
        start = time.perf_counter()
        for rows, inputs in self.inputs.items():
            self._fill(inputs, [])
            self._run(inputs)  # (sets the batch to this bucket's tensors)
            if self.compiled:  # the bucket's graph, to call without dynamo (see the module docstring)
                args = (self.model, inputs.tokens, inputs.positions, self.caches)
                self.direct[rows] = direct_call(paged_decode_step, args, args)
        self.warm_up_s = time.perf_counter() - start
        return self.warm_up_s

    def _run(self, inputs: StepInputs) -> Tensor:
        self.batch.set(inputs.block_tables, inputs.seq_lens, inputs.slots)  # every row attends
        if not self.compiled:
            return self.step(self.model, inputs.tokens, inputs.positions, self.caches)
        direct = self.direct.get(inputs.rows)
        if direct is not None:
            return direct(self.model, inputs.tokens, inputs.positions, self.caches)
        # warming up (or never warmed): every guard runs; after warm-up, see the module docstring
        guards = (
            contextlib.nullcontext()
            if self.warm_up_s is None
            else torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        )
        with (
            torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True),
            guards,
        ):
            return self.step(self.model, inputs.tokens, inputs.positions, self.caches)

    def _fill(self, inputs: StepInputs, sequences: list) -> None:
        """Write the sequences' rows into the bucket's tensors in place; the rest pad."""
        size = self.pool.block_size
        rows = inputs.rows
        tokens, positions, lengths, slots = [0] * rows, [0] * rows, [1] * rows, [0] * rows
        tables = torch.zeros(rows, inputs.block_tables.shape[1], dtype=torch.int32)
        for r, sequence in enumerate(sequences):
            at = sequence.computed
            tokens[r], positions[r], lengths[r] = sequence.tokens[at], at, at + 1
            slots[r] = sequence.blocks[at // size] * size + at % size
            tables[r, : len(sequence.blocks)] = torch.tensor(sequence.blocks, dtype=torch.int32)
        for r in range(len(sequences), rows):
            block, slots[r] = self.pool.scratch_slot(r)
            tables[r, 0] = block
        inputs.tokens.copy_(torch.tensor(tokens)[:, None])
        inputs.positions.copy_(torch.tensor(positions)[:, None])
        inputs.seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        inputs.slots.copy_(torch.tensor(slots)[:, None])
        inputs.block_tables.copy_(tables)
