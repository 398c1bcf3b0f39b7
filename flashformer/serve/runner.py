"""The model's steps over the paged cache: the forwards a scheduler step asks for, their block
tables and write slots, and the logits of the tokens that are some sequence's newest.

Batch invariance: a request gets the same tokens alone or among others.
With float matmuls (whose rows may round differently with the batch's size)
a prompt is always computed alone (a batch of one) in the same chunks, and
every decode step runs with the batch padded to max_batch rows, so the
matmuls see the same shapes whoever else is running (the separate steps:
`prefill`, then `decode`). A quantized model, whose kernels compute each row
alone, runs one forward per step instead (`packed`): the decoding sequences'
tokens and the prompt chunks packed in one row (vLLM's chunked prefill),
which reads the weights once for all of them. Either way attention reads
each sequence's own blocks only (attention.paged), and sampling draws from
the sequence's own generator (engine.py).

Row r of a forward feeds token `computed` of its sequence: the newest one, or after a
preemption one it had generated before (a replay); each forward moves `computed` on.
"""

from __future__ import annotations

import torch

from flashformer.attention.paged import kv_slots
from flashformer.kernels.quantized import QuantizedLinear
from flashformer.serve.paged_cache import BlockPool, make_paged_caches


def pads_decode(model) -> bool:
    """Whether decode steps are padded to max_batch rows. A float GEMM's rows may round
    differently with the batch size; a model whose every matmul is a quantized kernel (each
    row computed alone, the same bits at any row count: kernels.quantized) runs only its rows."""
    return any(isinstance(m, torch.nn.Linear) for m in model.modules()) or not any(
        isinstance(m, QuantizedLinear) for m in model.modules()
    )


class ModelRunner:
    """The model, its paged caches and the forwards of a step; see the module docstring.

    max_batch: the rows of a padded decode step; context: the most tokens a sequence holds
    (the width of the block tables)."""

    def __init__(self, model, pool: BlockPool, *, max_batch: int, context: int):
        self.model, self.pool, self.max_batch = model, pool, max_batch
        self.caches, self.batch = make_paged_caches(model, pool)
        self.pad_decode = pads_decode(model)
        self.max_blocks = pool.blocks_for(context)
        self.device = next(model.parameters()).device

    # ---- the separate steps (float matmuls) ----

    def prefill(self, sequence, start: int, end: int) -> torch.Tensor:
        """Compute prompt tokens start .. end - 1 alone (a batch of one); the logits (V,) of
        the last of them."""
        tokens = torch.tensor([sequence.tokens[start:end]], device=self.device)  # (1, C)
        positions = torch.arange(start, end, device=self.device)[None]  # (1, C)
        self._set_batch([sequence], [end], [list(range(start, end))])
        logits = self.model(tokens, position_ids=positions, kv_caches=self.caches, logits_to_keep=1).logits
        sequence.computed = end
        return logits[0, -1]

    def decode(self, sequences: list) -> torch.Tensor:
        """One decode step for the sequences, row r feeding token `computed` of sequence r;
        padded to max_batch rows when the model has float matmuls (see pads_decode). The
        logits (len(sequences), V)."""
        rows = self.max_batch if self.pad_decode else len(sequences)
        tokens = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        positions = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        for r, sequence in enumerate(sequences):
            tokens[r, 0] = sequence.tokens[sequence.computed]
            positions[r, 0] = sequence.computed
        self._set_batch(
            sequences, [s.computed + 1 for s in sequences], [[s.computed] for s in sequences], rows
        )
        logits = self.model(tokens, position_ids=positions, kv_caches=self.caches, logits_to_keep=1).logits
        for sequence in sequences:
            sequence.computed += 1
        return logits[: len(sequences), -1]

    # ---- the packed step (quantized matmuls) ----

    def packed(self, work: list[tuple[object, int, int]]) -> list[tuple[object, torch.Tensor]]:
        """One forward over every (sequence, start, end) of `work` (decode tokens and prompt
        chunks) packed in one row (attention sees each sequence's own tokens: PagedBatch), so
        the weights are read once for all of them. Returns (sequence, logits (V,)) for the
        sequences whose newest token was fed (the others are in a prompt or a replay)."""
        tokens, positions, owners, starts = [], [], [], [0]  # owners: each token's row of work
        for i, (sequence, start, end) in enumerate(work):
            tokens += sequence.tokens[start:end]
            positions += range(start, end)
            owners += [i] * (end - start)
            starts.append(starts[-1] + end - start)
        tables = self._block_tables([sequence for sequence, _, _ in work], len(work))
        slots = kv_slots(tables[owners], torch.tensor(positions)[:, None], self.pool.block_size)  # (T, 1)
        lengths = torch.tensor([end for _, _, end in work], dtype=torch.int32)
        device = self.device
        self.batch.set(
            tables.to(device),
            lengths.to(device),
            slots.view(1, -1).to(device),  # (1, T)
            q_starts=torch.tensor(starts, device=device),
        )
        out = self.model(
            torch.tensor([tokens], device=device),  # (1, T)
            position_ids=torch.tensor([positions], device=device),
            kv_caches=self.caches,
            logits_to_keep=1,
        )
        ready = []  # sequences whose last token of this step is their newest: they get a new one
        for i, (sequence, _, end) in enumerate(work):
            sequence.computed = end
            if end == len(sequence.tokens):
                ready.append((sequence, starts[i + 1] - 1))
        if not ready:
            return []
        rows = torch.tensor([row for _, row in ready], device=device)
        logits = self.model.project(out.last_hidden_state[0, rows][None])[0]  # (N, vocab)
        return [(sequence, row_logits) for (sequence, _), row_logits in zip(ready, logits)]

    # ---- block tables and slots ----

    def _set_batch(self, sequences, seq_lens, positions, rows: int | None = None) -> None:
        """The block tables, lengths and write slots of one forward, checked once here (the
        layers then skip their checks); rows past the sequences (padding) read and write a
        scratch slot of their own."""
        rows = rows or len(sequences)
        tables = self._block_tables(sequences, rows)
        lengths = torch.ones(rows, dtype=torch.int32)
        where = torch.zeros((rows, len(positions[0])), dtype=torch.int64)
        for r, (length, at) in enumerate(zip(seq_lens, positions)):
            lengths[r] = length
            where[r] = torch.tensor(at)
        slots = kv_slots(tables, where, self.pool.block_size)  # (rows, L)
        for r in range(len(sequences), rows):
            block, slot = self.pool.scratch_slot(r)
            tables[r, 0], slots[r] = block, slot
        self.batch.set(tables.to(self.device), lengths.to(self.device), slots.to(self.device), len(sequences))

    def _block_tables(self, sequences, rows: int) -> torch.Tensor:
        """(rows, max_blocks) int32: row r lists sequence r's blocks; rows past them are zeros."""
        tables = torch.zeros((rows, self.max_blocks), dtype=torch.int32)
        for r, sequence in enumerate(sequences):
            tables[r, : len(sequence.blocks)] = torch.tensor(sequence.blocks, dtype=torch.int32)
        return tables
