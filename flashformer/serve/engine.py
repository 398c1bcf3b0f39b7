"""Continuous batching: one loop owns the model and serves every request.

Each step the loop
1. drops the sequences whose clients went away and frees their blocks;
2. admits waiting sequences while the batch has room and the pool has the
   blocks their prompt needs;
3. runs prefill chunks (a prompt is computed in fixed chunks of
   `prefill_chunk` tokens, at most `prefill_budget` tokens per step while
   other sequences are decoding, so a long prompt never stalls everyone's
   next token for long; IDLE_BUDGET_FACTOR times that when none is);
4. runs one decode step for every sequence past its prompt, together;
5. samples each sequence's next token, streams its text to its client, and
   frees a finished sequence's blocks at once.

When a sequence needs a block and the pool has none, the newest sequence is
preempted: its blocks are freed and it waits at the front of the queue; when
readmitted it computes its prompt again and then replays the tokens it had
generated, one decode step each, so its cache is rebuilt by the very same
operations as before and it continues with the same tokens.

Batch invariance: a request gets the same tokens alone or among others.
With float matmuls (whose rows may round differently with the batch's size)
a prompt is always computed alone (a batch of one) in the same chunks, and
every decode step runs with the batch padded to max_batch rows, so the
matmuls see the same shapes whoever else is running. A quantized model, whose
kernels compute each row alone, runs one forward per step instead: the
decoding sequences' tokens and the prompt chunks packed in one row (vLLM's
chunked prefill), which reads the weights once for all of them. Either way
attention reads each sequence's own blocks only (attention.paged), and
sampling draws from the sequence's own generator, seeded from the request.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from flashformer.attention.paged import kv_slots
from flashformer.generate.sampling import GenerationSettings, LogitsProcessor, choose_tokens
from flashformer.kernels.quantized import QuantizedLinear
from flashformer.serve.loop import Busy, ModelLoop
from flashformer.serve.paged_cache import BlockPool, make_paged_caches
from flashformer.text.detokenizer import Detokenizer

__all__ = ["Busy", "Engine", "Event", "Request", "SamplingParams"]

# A step's prompt tokens when no sequence is decoding (nobody's next token waits for them), as a
# multiple of prefill_budget: more prompts start at once, and a step still ends soon enough for
# the first of them to get their second token without a long wait.
IDLE_BUDGET_FACTOR = 8


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # strings that end the text, never returned
    logprobs: int | None = None  # None: none; k: the chosen token's log-probability and the top k
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the top_logprobs alternatives, best first


@dataclass
class Event:
    """What a client receives. kind "delta": new text (and its tokens' log-probabilities) of
    choice `index`; "finish": choice `index` ended with `finish_reason`; "done": every choice
    ended (usage holds the token counts); "error": the request failed (message)."""

    kind: str
    index: int = 0
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    message: str = ""


class Request:
    """A prompt and its settings, `n` sequences (choices), and where their events go.

    emit: called from the engine's thread with each Event (the server hands it to its
    event loop). cancel() may be called from any thread: within one step the request's
    sequences stop and their blocks are freed.
    """

    _ids = itertools.count(1)

    def __init__(self, prompt_ids: list[int], params: SamplingParams, n: int, emit: Callable[[Event], None]):
        self.id = next(Request._ids)
        self.prompt_ids, self.params, self.emit = list(prompt_ids), params, emit
        self.settings = generation_settings(params)
        self.process: LogitsProcessor | None = None  # set by Engine.submit, on the model's device
        self.cancelled = threading.Event()
        self.sequences = [Sequence(self, index) for index in range(n)]
        self.completion_tokens = 0

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


class Sequence:
    """One choice of a request: its tokens (prompt + generated), the blocks holding their keys
    and values, how many of them are computed, and its text so far (its detokenizer)."""

    _order = itertools.count()

    def __init__(self, request: Request, index: int):
        self.request, self.index = request, index
        self.tokens = list(request.prompt_ids)
        self.prompt_len = len(self.tokens)
        self.blocks: list[int] = []
        self.computed = 0  # tokens whose keys and values are in the blocks
        self.detokenizer: Detokenizer | None = None  # set by Engine.submit (it has the tokenizer)
        self.finish_reason: str | None = None
        self.arrival = next(Sequence._order)
        seed = request.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        # choices of one request differ, and each is reproducible from (seed, index)
        self.generator = torch.Generator().manual_seed((seed * 1_000_003 + index) % 2**63)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def in_prefill(self) -> bool:
        return self.computed < self.prompt_len


class Engine(ModelLoop):
    """The model, its paged cache and the scheduler loop; see the module docstring.

    max_batch: sequences decoded together (and the fixed batch of every decode step);
    num_blocks, block_size: the KV pool; context: the most tokens a sequence may hold;
    prefill_chunk, prefill_budget: a prompt's chunk and the prompt tokens a step may compute
    while others decode; max_waiting: sequences that may wait before submit() raises Busy.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        max_batch: int = 16,
        num_blocks: int = 512,
        block_size: int = 16,
        context: int | None = None,
        prefill_chunk: int = 128,
        prefill_budget: int = 128,
        max_waiting: int = 256,
    ):
        super().__init__(max_waiting)
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_batch, self.prefill_chunk, self.prefill_budget = max_batch, prefill_chunk, prefill_budget
        self.context = min(model.config.max_seq_len, context or model.config.max_seq_len)
        self.pool = BlockPool(num_blocks, block_size, reserved=-(-max_batch // block_size))
        self.caches, self.batch = make_paged_caches(model, self.pool)
        # A float GEMM's rows may round differently with the batch size, so decode steps are
        # padded to max_batch rows; a model whose every matmul is a quantized kernel (each row
        # computed alone, the same bits at any row count: kernels.quantized) runs only its rows.
        self.pad_decode = any(isinstance(m, torch.nn.Linear) for m in model.modules()) or not any(
            isinstance(m, QuantizedLinear) for m in model.modules()
        )
        self.max_blocks = self.pool.blocks_for(self.context)
        self.device = next(model.parameters()).device
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = {"steps": 0, "generated_tokens": 0, "prompt_tokens": 0, "preemptions": 0}

    # ---- the other threads' side ----

    def submit(self, request: Request) -> None:
        """Queue a request (thread-safe). Raises Busy past max_waiting and ValueError for a
        prompt that can never fit (the context, or the whole pool)."""
        length = len(request.prompt_ids)
        if length < 1:
            raise ValueError("the prompt is empty: give at least one token")
        if length >= self.context:
            raise ValueError(
                f"the prompt is {length} tokens; this model's context is {self.context} tokens "
                f"(prompt and completion together)"
            )
        if self.pool.blocks_for(length + 1) > self.pool.capacity:
            raise ValueError(
                f"the prompt is {length} tokens; the KV pool holds {self.pool.capacity * self.pool.block_size}"
            )
        request.process = LogitsProcessor(request.settings, self.device)
        for sequence in request.sequences:
            sequence.detokenizer = Detokenizer(self.tokenizer, request.params.stop)
        self._enqueue(request, len(request.sequences))

    def metrics(self) -> dict:
        return {
            "requests_running": len({id(s.request) for s in list(self.running)}),
            "sequences_running": len(self.running),
            "sequences_waiting": self._waiting_count,
            "kv_blocks_in_use": self.pool.in_use,
            "kv_blocks_total": self.pool.capacity,
            "tokens_per_second": self._rate(),
            **self.stats,
        }

    # ---- the loop ----

    def _accept(self, request: Request) -> None:
        self.waiting.extend(request.sequences)

    def _has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def _fail_all(self, message: str) -> None:
        for sequence in self.running + list(self.waiting):
            self._fail(sequence, message)
        self.running, self.waiting = [], deque()

    @torch.no_grad()
    def step(self) -> None:
        """One scheduler iteration (see the module docstring)."""
        self._drop_cancelled()
        self._admit()
        if self.pad_decode:
            self._separate_step()
        else:
            self._packed_step()
        self.stats["steps"] += 1

    def _budget(self) -> int:
        """Prompt tokens this step may compute (see IDLE_BUDGET_FACTOR)."""
        decoding = any(not s.in_prefill for s in self.running)
        return self.prefill_budget * (1 if decoding else IDLE_BUDGET_FACTOR)

    def _prefill_plan(self, budget: int) -> list[tuple[Sequence, int, int]]:
        """This step's prompt chunks, (sequence, start, end), in admission order within the budget;
        chunk boundaries are fixed multiples of prefill_chunk."""
        plan = []
        for sequence in [s for s in self.running if s.in_prefill]:
            if budget <= 0:
                break
            start = sequence.computed
            end = min(start + self.prefill_chunk - start % self.prefill_chunk, sequence.prompt_len)
            plan.append((sequence, start, end))
            budget -= end - start
        return plan

    def _separate_step(self) -> None:
        """Prompt chunks one forward each (a batch of one), then one decode step for all."""
        for sequence, start, end in self._prefill_plan(self._budget()):
            self._prefill_chunk(sequence, start, end)
        decoding = [s for s in self.running if not s.in_prefill and s.finish_reason is None]
        decoding = self._make_room(decoding)
        if decoding:
            self._decode(decoding)

    def _packed_step(self) -> None:
        """For a model whose rows are computed alone: one forward over every decoding sequence's
        next token and this step's prompt chunks, packed in one row (attention sees each
        sequence's own tokens: PagedBatch), so the weights are read once for all of them."""
        budget = self._budget()
        decoding = self._make_room([s for s in self.running if not s.in_prefill and s.finish_reason is None])
        work = [(s, s.computed, s.computed + 1) for s in decoding]  # (sequence, start, end)
        work += self._prefill_plan(budget)
        if not work:
            return
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
        for i, (sequence, start, end) in enumerate(work):
            if start < sequence.prompt_len:
                self.stats["prompt_tokens"] += end - start
            sequence.computed = end
            if end == len(sequence.tokens):
                ready.append((sequence, starts[i + 1] - 1))
        if ready:
            rows = torch.tensor([row for _, row in ready], device=device)
            logits = self.model.project(out.last_hidden_state[0, rows][None])[0]  # (N, vocab)
            for (sequence, _), row_logits in zip(ready, logits):
                self._sample(sequence, row_logits)

    def _drop_cancelled(self) -> None:
        for sequence in [s for s in self.waiting if s.request.cancelled.is_set()]:
            self.waiting.remove(sequence)
            self._count_waiting(-1)
            sequence.finish_reason = sequence.finish_reason or "cancelled"
        for sequence in [s for s in self.running if s.request.cancelled.is_set()]:
            sequence.finish_reason = sequence.finish_reason or "cancelled"
            self._retire(sequence)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            sequence = self.waiting[0]
            if sequence.finish_reason is not None:
                self.waiting.popleft()
                self._count_waiting(-1)
                continue
            blocks = self.pool.allocate(self.pool.blocks_for(len(sequence.tokens) + 1))
            if blocks is None:
                return
            self.waiting.popleft()
            self._count_waiting(-1)
            sequence.blocks, sequence.computed = blocks, 0
            self.running.append(sequence)

    def _prefill_chunk(self, sequence: Sequence, start: int, end: int) -> None:
        """Compute prompt tokens start .. end - 1 (a batch of one); after the last chunk of a
        fresh sequence, sample its first token."""
        tokens = torch.tensor([sequence.tokens[start:end]], device=self.device)  # (1, C)
        positions = torch.arange(start, end, device=self.device)[None]  # (1, C)
        self._set_batch([sequence], [end], [list(range(start, end))])
        logits = self.model(tokens, position_ids=positions, kv_caches=self.caches, logits_to_keep=1).logits
        sequence.computed = end
        self.stats["prompt_tokens"] += end - start
        if end == sequence.prompt_len and len(sequence.tokens) == sequence.prompt_len:
            self._sample(sequence, logits[0, -1])

    def _make_room(self, decoding: list[Sequence]) -> list[Sequence]:
        """Give every decoding sequence a slot for its next token, preempting the newest
        sequences while the pool has no free block."""
        ready = []
        for sequence in sorted(decoding, key=lambda s: s.arrival):
            if sequence.finish_reason is not None or sequence not in self.running:
                continue
            while self.pool.blocks_for(sequence.computed + 1) > len(sequence.blocks):
                block = self.pool.allocate(1)
                if block is not None:
                    sequence.blocks += block
                    continue
                victim = max(self.running, key=lambda s: s.arrival)
                if victim is sequence and len(self.running) == 1:
                    sequence.finish_reason = "length"  # alone, it fills the whole pool
                    self._retire(sequence)
                    break
                self._preempt(victim)
                if victim is sequence:
                    break
            if sequence in self.running and sequence.finish_reason is None:
                ready.append(sequence)
        return [s for s in ready if s in self.running]

    def _preempt(self, sequence: Sequence) -> None:
        self.pool.release(sequence.blocks)
        sequence.blocks, sequence.computed = [], 0
        self.running.remove(sequence)
        self.waiting.appendleft(sequence)
        self._count_waiting(1)
        self.stats["preemptions"] += 1

    def _decode(self, sequences: list[Sequence]) -> None:
        """One decode step for the sequences: row r feeds token `computed` of its sequence (a
        replayed one after a preemption, or the newest). The batch is padded to max_batch rows
        when the model has float matmuls (see pad_decode)."""
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
        for r, sequence in enumerate(sequences):
            sequence.computed += 1
            if sequence.computed == len(sequence.tokens):  # caught up: a new token
                self._sample(sequence, logits[r, -1])

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

    # ---- tokens out ----

    def _sample(self, sequence: Sequence, logits: torch.Tensor) -> None:
        """Pick the next token from one row's logits (V,), then stream and check for the end."""
        request = sequence.request
        logits = logits.float()
        scores = request.process(logits[None], None, len(sequence.generated))  # (1, V)
        token = int(choose_tokens(scores, request.settings.do_sample, sequence.generator)[0])
        sequence.tokens.append(token)
        self.stats["generated_tokens"] += 1
        self._note_progress(1)
        self._stream(sequence, token_logprobs(logits, token, request.params.logprobs))

    def _stream(self, sequence: Sequence, logprobs: list[TokenLogprob]) -> None:
        """Send the text the newest token made certain; end the sequence at a stop token, a
        stop string, max_tokens or the context (then the held-back text goes too)."""
        params, token = sequence.request.params, sequence.tokens[-1]
        detokenizer = sequence.detokenizer
        text, reason = "", None
        if token in params.stop_token_ids:  # never part of the text
            reason = "stop"
        else:
            text = detokenizer.add(token)
            reason = "stop" if detokenizer.stopped else None
        if reason is None and len(sequence.generated) >= params.max_tokens:
            reason = "length"
        if reason is None and len(sequence.tokens) >= self.context:
            reason = "length"
        if reason is not None:
            text += detokenizer.finish()
        if text or logprobs:
            sequence.request.emit(Event("delta", sequence.index, text, logprobs))
        if reason is not None:
            sequence.finish_reason = reason
            sequence.request.completion_tokens += len(sequence.generated)
            self._retire(sequence)

    def _retire(self, sequence: Sequence) -> None:
        """Free a finished sequence's blocks; tell its client; when its request is done, say so."""
        if sequence in self.running:
            self.running.remove(sequence)
            self.pool.release(sequence.blocks)
            sequence.blocks = []
        request = sequence.request
        if sequence.finish_reason != "cancelled":
            request.emit(Event("finish", sequence.index, finish_reason=sequence.finish_reason))
        if request.finished and not request.cancelled.is_set():
            prompt = len(request.prompt_ids)
            usage = {
                "prompt_tokens": prompt,
                "completion_tokens": request.completion_tokens,
                "total_tokens": prompt + request.completion_tokens,
            }
            request.emit(Event("done", usage=usage))

    def _fail(self, sequence: Sequence, message: str) -> None:
        if sequence.blocks:
            self.pool.release(sequence.blocks)
            sequence.blocks = []
        if sequence.finish_reason is None:
            sequence.finish_reason = "error"
            sequence.request.emit(Event("error", sequence.index, message=message))


def generation_settings(params: SamplingParams) -> GenerationSettings:
    """The request's settings in generate()'s terms: temperature 0 is greedy; every other
    setting (repetition penalty, top-k, min tokens) stays at its no-op default."""
    return GenerationSettings(
        do_sample=params.temperature > 0, temperature=params.temperature, top_p=params.top_p
    )


def token_logprobs(logits: torch.Tensor, token: int, top: int | None) -> list[TokenLogprob]:
    """The chosen token's log-probability under the model's own distribution (logits (V,),
    before temperature and top-p) and the `top` most likely tokens; [] when top is None."""
    if top is None:
        return []
    log_probs = F.log_softmax(logits, dim=-1)
    best = torch.topk(log_probs, top) if top > 0 else None
    alternatives = [] if best is None else list(zip(best.indices.tolist(), best.values.tolist()))
    return [TokenLogprob(token, float(log_probs[token]), alternatives)]
