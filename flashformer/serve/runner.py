"""The model's steps over the paged cache: the forwards a scheduler step asks for, their block
tables and write slots, and the logits of the tokens that are some sequence's newest.

Batch invariance: a request gets the same tokens alone or among others.

- The native decoder (model/native.py: a decoder-only model, float32 or quantized, on the CPU)
  computes every row alone in every operation, so a step packs the decoding sequences' tokens and
  this step's prompt chunks in one call (vLLM's chunked prefill), which reads the weights once for
  all of them (`packed`). A token's bits do not depend on what else ran, nor on whether it was a
  prompt's or a decode step's.
- Otherwise the model's modules run eagerly. A quantized model, whose kernels compute each row
  alone, runs the same packed forward. A float model's matmuls may round a row differently with
  the batch's size: its prompt is always computed alone (a batch of one) in the same chunks, and
  every decode step runs with the batch padded to max_batch rows, so the matmuls see the same
  shapes whoever else is running (the separate steps: `prefill`, then `decode`).

Either way attention reads each sequence's own blocks only (attention.paged, or the native
decoder's own attention over the same pools), and sampling draws from the sequence's own
generator (engine.py).

LoRA adapters (adapters/): a model with adapters loaded runs each row with its sequence's adapter
(its request's `adapter`, or none: the base), one forward for a batch that mixes them
(adapters.adapter_per_row: a decode step's index per row, a packed step's per token). The native
decoder declines an adapted model, so it runs eagerly.

Row r of a forward feeds token `computed` of its sequence: the newest one, or after a
preemption one it had generated before (a replay); each forward moves `computed` on.
"""

from __future__ import annotations

import contextlib

import torch

from flashformer.adapters.lora import adapter_per_row, lora_layers, set_active
from flashformer.attention.paged import kv_slots
from flashformer.kernels.native_decoder import NativeBatch, NativeCache
from flashformer.kernels.quantized import QuantizedLinear
from flashformer.model.native import native_decoder
from flashformer.model.positional import RotaryEmbedding
from flashformer.serve.paged_cache import NO_BLOCK, BlockPool, make_paged_caches


def pads_decode(model) -> bool:
    """Whether eager decode steps are padded to max_batch rows. A float GEMM's rows may round
    differently with the batch size; a model whose every matmul is a quantized kernel (each
    row computed alone, the same bits at any row count: kernels.quantized) runs only its rows."""
    return any(isinstance(m, torch.nn.Linear) for m in model.modules()) or not any(
        isinstance(m, QuantizedLinear) for m in model.modules()
    )


class ModelRunner:
    """The model, its paged caches and the forwards of a step; see the module docstring.

    max_batch: the rows of a padded decode step; context: the most tokens a sequence holds
    (the width of the block tables); native: run the native decoder where the model has one
    (False: the model's modules, eagerly); cache_type_k / cache_type_v: the pools' element types
    (kernels/kv_blocks.py; q8_0 and q4_0 need the native decoder); window_pool: the sliding-window
    layers' own pool (paged_cache.py's window group; its tables are the sequences' window_blocks)."""

    def __init__(
        self,
        model,
        pool: BlockPool,
        *,
        max_batch: int,
        context: int,
        native: bool = True,
        cache_type_k: str | None = None,
        cache_type_v: str | None = None,
        window_pool: BlockPool | None = None,
    ):
        self.model, self.pool, self.max_batch = model, pool, max_batch
        self.window_pool = window_pool
        self.caches, self.batch, self.window_batch = make_paged_caches(
            model, pool, cache_type_k, cache_type_v, window_pool
        )
        self.native = native_decoder(model) if native else None
        if self.native is None and self.caches[0].quantized:
            raise ValueError(
                f"cache types {self.caches[0].k_type} / {self.caches[0].v_type}: q8_0 and q4_0 blocks are read "
                "by the native decoder only (a decoder-only model on the CPU, native on); use f32 or f16 here"
            )
        self.native_cache = (
            None
            if self.native is None
            else NativeCache([c.k for c in self.caches], [c.v for c in self.caches])
        )
        self.pad_decode = self.native is None and pads_decode(model)
        self._block_bytes = {
            window: sum(c.block_bytes for c in self.caches if c.batch is batch)
            for window, batch in ((False, self.batch), (True, self.window_batch))
        }
        self.max_blocks = pool.blocks_for(context)
        self.device = next(model.parameters()).device
        # the LoRA adapters loaded beside the model (none active: each row chooses its own)
        self.adapters = tuple(
            dict.fromkeys(n for layer in lora_layers(model).values() for n in layer.adapters)
        )
        if self.adapters:
            set_active(model, ())

    def adapted(self, adapters: list[str | None], packed: bool = False):
        """The forward's rows each with its adapter (adapters: a name or None, the base, per batch
        row; packed: per token of the one packed row), a no-op without adapters loaded."""
        if not self.adapters:
            return contextlib.nullcontext()
        index = {name: i for i, name in enumerate(self.adapters)}
        rows = torch.tensor([-1 if a is None else index[a] for a in adapters], device=self.device)  # (B,)
        return adapter_per_row(self.model, self.adapters, rows[None] if packed else rows)  # (1, T) packed

    def _rows_adapted(self, sequences: list, rows: int):
        """adapted() for a batch of `rows` rows, row r < len(sequences) sequence r's."""
        if not self.adapters:  # (a sequence's request is not read without them)
            return contextlib.nullcontext()
        chosen = [s.request.params.adapter for s in sequences]
        return self.adapted(chosen + [None] * (rows - len(sequences)))

    @property
    def kv_bytes(self) -> int:
        """The bytes of the KV pools, every layer's keys and values (both groups)."""
        return sum(c.k.numel() * c.k.element_size() + c.v.numel() * c.v.element_size() for c in self.caches)

    def block_bytes(self, window: bool = False) -> int:
        """The bytes of one block of the full group's pool (or the window group's), every layer
        of the group, keys and values (summed once: the engine asks every step)."""
        return self._block_bytes[window]

    def kv_bytes_held(self) -> int:
        """Bytes of the KV blocks sequences hold now, both groups."""
        held = self.pool.in_use * self.block_bytes()
        if self.window_pool is not None:
            held += self.window_pool.in_use * self.block_bytes(window=True)
        return held

    def kv_metrics(self, peak: int) -> dict:
        """/metrics' KV figures (peak: the most bytes held at once, which the engine tracks)."""
        found = {
            "kv_bytes_in_use": self.kv_bytes_held(),
            "kv_bytes_in_use_peak": peak,
            "kv_bytes_total": self.kv_bytes,
            "kv_block_bytes": self.block_bytes(),
        }
        if self.window_pool is not None:
            found.update(
                kv_window_blocks_in_use=self.window_pool.in_use,
                kv_window_blocks_total=self.window_pool.capacity,
                kv_window_block_bytes=self.block_bytes(window=True),
            )
        return found

    # ---- the separate steps (float matmuls, eagerly) ----

    def prefill(self, sequence, start: int, end: int) -> torch.Tensor:
        """Compute prompt tokens start .. end - 1 alone (a batch of one); the logits (V,) of
        the last of them."""
        tokens = torch.tensor([sequence.tokens[start:end]], device=self.device)  # (1, C)
        positions = torch.arange(start, end, device=self.device)[None]  # (1, C)
        self._set_batch([sequence], [end], [list(range(start, end))])
        with self._rows_adapted([sequence], 1):
            logits = self.model(
                tokens, position_ids=positions, kv_caches=self.caches, logits_to_keep=1
            ).logits
        sequence.computed = end
        return logits[0, -1]

    def decode(self, sequences: list) -> torch.Tensor:
        """One decode step for the sequences, row r feeding token `computed` of sequence r,
        padded to max_batch rows: the rows past them read and write scratch slots of their own
        (paged_cache.BlockPool.scratch_slot). The logits (len(sequences), V)."""
        if len(sequences) > self.max_batch:
            raise ValueError(
                f"a decode step of {len(sequences)} sequences exceeds max_batch={self.max_batch}"
            )
        size, rows = self.pool.block_size, self.max_batch
        tokens, positions, lengths, slots = [0] * rows, [0] * rows, [1] * rows, [0] * rows
        tables = torch.zeros(rows, self.max_blocks, dtype=torch.int32)
        for r, sequence in enumerate(sequences):
            at = sequence.computed
            tokens[r], positions[r], lengths[r] = sequence.tokens[at], at, at + 1
            slots[r] = sequence.blocks[at // size] * size + at % size
            tables[r, : len(sequence.blocks)] = torch.tensor(sequence.blocks, dtype=torch.int32)
        for r in range(len(sequences), rows):
            block, slots[r] = self.pool.scratch_slot(r)
            tables[r, 0] = block
        device = self.device
        lengths = torch.tensor(lengths, dtype=torch.int32, device=device)
        self.batch.set(tables.to(device), lengths, torch.tensor(slots, device=device)[:, None])
        if self.window_batch is not None:  # the same rows in the window group's pool
            tables = self._window_tables(sequences, rows)
            window_slots = [0] * rows
            for r, sequence in enumerate(sequences):
                at = sequence.computed
                window_slots[r] = sequence.window_blocks[at // size] * size + at % size
            for r in range(len(sequences), rows):
                tables[r, 0], window_slots[r] = self.window_pool.scratch_slot(r)
            self.window_batch.set(
                tables.to(device), lengths, torch.tensor(window_slots, device=device)[:, None]
            )
        with self._rows_adapted(sequences, rows):
            out = self.model(
                torch.tensor(tokens, device=device)[:, None],
                position_ids=torch.tensor(positions, device=device)[:, None],
                kv_caches=self.caches,
                logits_to_keep=1,
            )
        for sequence in sequences:
            sequence.computed += 1
        return out.logits[: len(sequences), -1].float()

    # ---- the packed step (the native decoder, or quantized matmuls) ----

    def packed(
        self, work: list[tuple[object, int, int]], every_row: set | None = None
    ) -> tuple[list[tuple[object, int, int]], torch.Tensor]:
        """One forward over every (sequence, start, end) of `work` (decode tokens and prompt
        chunks) packed in one row (attention sees each sequence's own tokens), so the weights
        are read once for all of them. Returns (ready, logits): ready lists (sequence, first,
        end) for the sequences whose newest token was fed (the others are in a prompt or a
        replay), their rows of logits (R, V) being first .. end - 1: the last fed token's alone,
        or for those in every_row (a token and its drafts: speculation.py) every fed token's."""
        groups = self._rope_groups(work)
        if len(groups) > 1:  # the modules choose LongRoPE's table per forward: a forward per side
            ready, logits = [], []
            for group in groups:
                part_ready, part_logits = self.packed(group, every_row)
                offset = sum(len(part) for part in logits)
                ready += [(sequence, first + offset, end + offset) for sequence, first, end in part_ready]
                logits.append(part_logits)
            return ready, torch.cat(logits)
        tokens, positions, starts = [], [], [0]
        for sequence, start, end in work:
            tokens += sequence.tokens[start:end]
            positions += range(start, end)
            starts.append(starts[-1] + end - start)
        ready, rows = [], []  # the sequences whose last token of this step is their newest: a new one
        every_row = {id(sequence) for sequence in every_row or ()}
        for i, (sequence, _, end) in enumerate(work):
            sequence.computed = end
            if end == len(sequence.tokens):
                first = starts[i] if id(sequence) in every_row else starts[i + 1] - 1
                ready.append((sequence, len(rows), len(rows) + starts[i + 1] - first))
                rows += range(first, starts[i + 1])
        if self.native is not None:
            logits = self._native_packed(work, tokens, positions, starts, rows)
        else:
            logits = self._eager_packed(work, tokens, positions, starts, rows)
        return ready, logits

    @property
    def long_rope_after(self) -> int | None:
        """LongRoPE's original context (a forward ending past it turns by the long table); None
        for every other model."""
        rope = getattr(getattr(self.model, "decoder", None), "positions", None)
        if not isinstance(rope, RotaryEmbedding) or rope.long_inv_freq is None:
            return None
        return rope.scaling.original_max_seq_len

    def _rope_groups(self, work) -> list[list]:
        """`work` split by the side of LongRoPE's switch its sequences are on (the native decoder
        chooses per sequence itself; the modules' RotaryEmbedding, per row of a forward, would
        give every packed sequence the long table once one passes the original context)."""
        original = self.long_rope_after
        if self.native is not None or original is None:
            return [work]
        sides = [[item for item in work if (item[2] > original) == long] for long in (False, True)]
        return [side for side in sides if side]

    def _native_packed(self, work, tokens, positions, starts, rows) -> torch.Tensor:
        """packed's forward as one native call: its index tensors are made from Python lists
        (a handful of small tensors, no tensor arithmetic: this runs before every token)."""
        size = self.pool.block_size
        slots = [s.blocks[p // size] * size + p % size for s, start, end in work for p in range(start, end)]
        window_tables = window_slots = None
        if self.window_batch is not None:
            tables = [_released_as_scratch(s.window_blocks) for s, _, _ in work]
            window_tables = _index_table(tables)
            window_slots = torch.tensor(
                [table[p // size] * size + p % size for table, (_, start, end) in zip(tables, work)
                 for p in range(start, end)]
            )  # fmt: skip
        batch = NativeBatch(
            tokens=torch.tensor(tokens),
            positions=torch.tensor(positions),
            q_starts=torch.tensor(starts),
            seq_lens=torch.tensor([end for _, _, end in work]),
            block_tables=_index_table([s.blocks for s, _, _ in work]),
            slots=torch.tensor(slots),
            logit_rows=torch.tensor(rows, dtype=torch.long),
            window_tables=window_tables,
            window_slots=window_slots,
        )
        return self.native.forward(batch, self.native_cache)  # (R, vocab)

    def _eager_packed(self, work, tokens, positions, starts, rows) -> torch.Tensor:
        """packed's forward through the model's modules (quantized matmuls, paged attention)."""
        sequences = [sequence for sequence, _, _ in work]
        owners = [i for i, (_, start, end) in enumerate(work) for _ in range(start, end)]
        where = torch.tensor(positions)[:, None]  # (T, 1)
        tables = self._block_tables(sequences, len(work))
        slots = kv_slots(tables[owners], where, self.pool.block_size)  # (T, 1)
        lengths = torch.tensor([end for _, _, end in work], dtype=torch.int32)
        device = self.device
        self.batch.set(
            tables.to(device),
            lengths.to(device),
            slots.view(1, -1).to(device),  # (1, T)
            q_starts=torch.tensor(starts, device=device),
        )
        if self.window_batch is not None:
            window_tables = self._window_tables(sequences, len(work))
            window_slots = kv_slots(window_tables[owners], where, self.pool.block_size)
            self.window_batch.set(
                window_tables.to(device),
                lengths.to(device),
                window_slots.view(1, -1).to(device),
                q_starts=self.batch.q_starts,
            )
        # a packed row's adapter per token (none read without adapters loaded)
        per_token = [sequences[i].request.params.adapter for i in owners] if self.adapters else []
        with self.adapted(per_token, packed=True):
            out = self.model(
                torch.tensor([tokens], device=device),  # (1, T)
                position_ids=torch.tensor([positions], device=device),
                kv_caches=self.caches,
                logits_to_keep=1,
            )
        if not rows:
            return torch.empty(0, self.model.config.vocab_size, device=device)
        rows = torch.tensor(rows, dtype=torch.long, device=device)
        return self.model.project(out.last_hidden_state[0, rows][None])[0]  # (R, vocab)

    # ---- block tables and slots ----

    def _set_batch(self, sequences, seq_lens, positions) -> None:
        """The block tables, lengths and write slots of one forward, checked once here (the
        layers then skip their checks)."""
        rows = len(sequences)
        tables = self._block_tables(sequences, rows)
        lengths = torch.tensor(seq_lens, dtype=torch.int32)  # (rows,)
        where = torch.tensor(positions, dtype=torch.int64)  # (rows, L)
        slots = kv_slots(tables, where, self.pool.block_size)  # (rows, L)
        self.batch.set(tables.to(self.device), lengths.to(self.device), slots.to(self.device))
        if self.window_batch is not None:
            tables = self._window_tables(sequences, rows)
            slots = kv_slots(tables, where, self.pool.block_size)  # (rows, L)
            self.window_batch.set(tables.to(self.device), lengths.to(self.device), slots.to(self.device))

    def _window_tables(self, sequences, rows: int) -> torch.Tensor:
        """(rows, max_blocks) int32 of the sequences' window tables; released entries (NO_BLOCK)
        read as block 0, a scratch block, which no query's window reaches."""
        tables = torch.zeros((rows, self.max_blocks), dtype=torch.int32)
        for r, sequence in enumerate(sequences):
            row = torch.tensor(_released_as_scratch(sequence.window_blocks), dtype=torch.int32)
            tables[r, : len(row)] = row
        return tables

    def _block_tables(self, sequences, rows: int) -> torch.Tensor:
        """(rows, max_blocks) int32: row r lists sequence r's blocks; rows past them are zeros."""
        tables = torch.zeros((rows, self.max_blocks), dtype=torch.int32)
        for r, sequence in enumerate(sequences):
            tables[r, : len(sequence.blocks)] = torch.tensor(sequence.blocks, dtype=torch.int32)
        return tables


def _released_as_scratch(table: list[int]) -> list[int]:
    """A window table with its released entries (NO_BLOCK) read as block 0, a scratch block
    that no query's window reaches."""
    return [0 if block == NO_BLOCK else block for block in table]


def _index_table(rows: list[list[int]]) -> torch.Tensor:
    """(len(rows), widest row) int64 block tables for a native call: each row's blocks, zeros
    after them (the call reads a sequence's entries up to its length only)."""
    width = max(1, max(len(row) for row in rows))
    return torch.tensor([row + [0] * (width - len(row)) for row in rows])
