"""Continuous batching: one loop owns the model and serves every request.

Each step the engine
1. drops the sequences whose clients went away and frees their blocks;
2. admits waiting sequences while the batch has room and the pool has the
   blocks their prompt needs, each starting after the longest cached prefix
   it may reuse (scheduler.py: admission, prefix caching);
3. runs this step's prompt chunks (scheduler.py: the prefill plan, chunks
   within a budget) and one decode step for every sequence past its prompt
   (scheduler.py: making room, preempting the newest sequence when the pool
   is full), through runner.py: one packed forward of both through the native
   decoder (or a quantized model's modules); for a float model run eagerly, a
   forward per chunk and a padded decode batch;
4. chooses each sequence's next token (generate.sampling's RowChooser: the
   request's logits processor, the sequence's grammar mask, history and
   generator; the plain argmax rows in one call), streams its text to its
   client (output.py: stop strings, partial UTF-8 held back, the events), and
   frees a finished sequence's blocks at once; a drafting sequence's rows are
   checked draft by draft (speculation.py).

Batch invariance (runner.py) holds for sampling too: each sequence draws from
its own generator, seeded from the request's seed and the choice's index.
A preempted sequence replays the tokens it had generated (scheduler.py); a
token is sampled only once its sequence has caught up.

Modules: loop.py (threads, inbox, Busy), scheduler.py (policy), runner.py (the model's forwards),
paged_cache.py (the pool), request.py (requests, their sequences and events), output.py (text and
events out), speculation.py (drafts and their check); this one, the Engine and its step.
"""

from __future__ import annotations

import itertools
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from flashformer.adapters import load_peft, remove_adapter, set_active
from flashformer.eval.loglikelihood import token_logprobs as score_prompt
from flashformer.generate.sampling import LogitsProcessor, RowChooser, choose_tokens
from flashformer.serve import output
from flashformer.serve.loop import Busy, ModelLoop
from flashformer.serve.paged_cache import BlockPool, adapter_salt, window_pool_for
from flashformer.serve.request import (
    Event,
    Request,
    Sequence,
    TokenLogprob,
    check_prompt_fits,
    token_logprobs,
)
from flashformer.serve.runner import ModelRunner
from flashformer.serve.scheduler import Scheduler
from flashformer.serve.speculation import SpeculativeConfig, Speculator
from flashformer.text.detokenizer import Detokenizer

__all__ = ["AdapterChange", "Busy", "Engine"]


@dataclass
class AdapterChange:
    """A LoRA adapter to load (path) or unload (path None), made by the loop between two steps
    (only the loop touches the model); `done` holds its outcome for the thread that asked."""

    name: str
    path: str | None
    done: Future


class Engine(ModelLoop):
    """The loop that serves text requests: a Scheduler (policy), a ModelRunner (the model's
    forwards), sampling and detokenizing per sequence, and the events; see the module docstring.

    max_batch: sequences decoded together (and the fixed batch of every decode step);
    num_blocks, block_size: the KV pool; context: the most tokens a sequence may hold;
    prefill_chunk, prefill_budget: a prompt's chunk and the prompt tokens a step may compute
    while others decode; max_waiting: sequences that may wait before submit() raises Busy;
    prefix_cache: reuse the cached keys and values of prompts' common beginnings
    (scheduler.py: prefix caching); native: run the model's native decoder where it has one
    (runner.py; False: its PyTorch modules, eagerly); cache_type_k / cache_type_v: the KV pool's
    element types for keys and values (f32, f16, q8_0, q4_0; llama.cpp's --cache-type-k / -v; the
    model's float type by default). Nothing is compiled: the engine serves its
    first request as soon as it is built (start_seconds, which `flashformer serve` sets, says
    when that was).
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
        prefix_cache: bool = True,
        native: bool = True,
        speculative: SpeculativeConfig | None = None,
        draft_model=None,
        cache_type_k: str | None = None,
        cache_type_v: str | None = None,
    ):
        super().__init__(max_waiting)
        self.model, self.tokenizer, self.max_batch = model.eval(), tokenizer, max_batch
        self.context = min(model.config.max_seq_len, context or model.config.max_seq_len)
        self.pool = BlockPool(num_blocks, block_size, reserved=-(-max_batch // block_size))
        step_tokens = max(prefill_chunk, 1 + (speculative.num_speculative_tokens if speculative else 0))
        self.window, self.window_pool = window_pool_for(model, self.pool, max_batch, step_tokens)
        self.runner = ModelRunner(
            model,
            self.pool,
            max_batch=max_batch,
            context=self.context,
            native=native,
            cache_type_k=cache_type_k,
            cache_type_v=cache_type_v,
            window_pool=self.window_pool,
        )
        self.device = self.runner.device
        rows_alone = not self.runner.pad_decode
        self.scheduler = Scheduler(
            self.pool,
            max_batch=max_batch,
            prefill_chunk=prefill_chunk,
            prefill_budget=prefill_budget,
            on_waiting=self._count_waiting,
            prefix_cache=prefix_cache,
            rows_alone=rows_alone,
            window_pool=self.window_pool,
            window=self.window,
            long_rope_after=self.runner.long_rope_after,
        )
        self.counts = {"steps": 0, "generated_tokens": 0, "prompt_tokens": 0}
        self.kv_bytes_peak = 0  # the most bytes of KV blocks sequences held at a step's start or end
        # speculation verifies drafts in the packed step (rows computed alone)
        self.speculator = None
        if speculative is not None and not self.runner.pad_decode:
            self.speculator = Speculator(speculative, self.model, draft_model)
            self.counts.update(speculative_drafted_tokens=0, speculative_accepted_tokens=0)
        self._step = self._separate_step if self.runner.pad_decode else self._packed_step
        self.start_seconds = 0.0  # from the process's start to serving (set by `flashformer serve`)
        # each adapter's prefix-cache salt: those loaded at start are load 0 (as Sequence assumes)
        self._salts = {name: adapter_salt(name) for name in self.adapters}
        self._loads = itertools.count(1)

    @property
    def waiting(self) -> deque[Sequence]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def pad_decode(self) -> bool:
        return self.runner.pad_decode

    @property
    def stats(self) -> dict:
        """Counters since the start (/metrics reports them)."""
        scheduler = self.scheduler
        return {
            **self.counts,
            "start_seconds": self.start_seconds,
            "preemptions": scheduler.preemptions,
            "prefix_cache_queries": scheduler.cache_queries,
            "prefix_cache_hits": scheduler.cache_hits,
        }

    # ---- the other threads' side ----

    @property
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters loaded beside the model, by name: a request's params.adapter."""
        return self.runner.adapters

    def submit(self, request: Request) -> None:
        """Queue a request (thread-safe). Raises Busy past max_waiting and ValueError for a
        prompt that can never fit (the context, or the whole pool) or an adapter not loaded."""
        adapter = request.params.adapter
        if adapter is not None and adapter not in self.adapters:
            raise ValueError(f"adapter {adapter!r} is not loaded; loaded: {list(self.adapters)}")
        check_prompt_fits(len(request.prompt_ids), self.context, self.pool.capacity * self.pool.block_size)
        request.process = LogitsProcessor(request.settings, self.device)
        constraint, thinking = request.params.constraint, request.params.thinking
        for sequence in request.sequences:
            sequence.detokenizer = Detokenizer(self.tokenizer, request.params.stop)
            matcher = None if constraint is None else constraint.matcher()  # its own place in the grammar
            sequence.chooser = RowChooser(request.process, sequence.generator, matcher, thinking)
        self._enqueue(request, len(request.sequences))

    def change_adapter(self, name: str, path: str | None = None) -> Future:
        """Load the PEFT adapter at `path` as `name` (path None: unload `name`) between two steps
        (thread-safe). The Future's result is None, or its exception: AdapterError (a bad folder),
        LookupError (unloading a name not loaded), ValueError (a name taken, or in use)."""
        done: Future = Future()
        self._inbox.put(AdapterChange(name, path, done))
        return done

    def metrics(self) -> dict:
        return {
            "requests_running": len({id(s.request) for s in list(self.running)}),
            "sequences_running": len(self.running),
            "sequences_waiting": self._waiting_count,
            "kv_blocks_in_use": self.pool.in_use,
            "kv_blocks_total": self.pool.capacity,
            "kv_blocks_cached": self.pool.cached,
            **self.runner.kv_metrics(self.kv_bytes_peak),
            "prefix_cache_hit_rate": self.scheduler.cache_hits / max(1, self.scheduler.cache_queries),
            "tokens_per_second": self._rate(),
            **self.stats,
        }

    # ---- the loop ----

    def _accept(self, request: Request | AdapterChange) -> None:
        if isinstance(request, AdapterChange):
            self._change_adapter(request)
            return
        adapter = request.params.adapter
        if adapter is not None:
            if adapter not in self._salts:  # unloaded since it was submitted
                self._count_waiting(-len(request.sequences))
                for sequence in request.sequences:
                    sequence.finish_reason = "error"
                request.emit(Event("error", message=f"adapter {adapter!r} was unloaded"))
                return
            for sequence in request.sequences:
                sequence.cache_salt = self._salts[adapter]
        if request.params.prompt_logprobs is not None or request.params.max_tokens == 0:
            if not self._score_prompt(request):
                return
        self.waiting.extend(request.sequences)

    def _score_prompt(self, request: Request) -> bool:
        """The prompt's log-probabilities, when asked, in one forward of its own (eval's
        token_logprobs: the same numbers alone or among others), sent before any token; a
        request for no token ends here. Whether its sequences go on to be generated."""
        params = request.params
        try:
            if params.prompt_logprobs is not None:
                with self.runner.adapted([params.adapter]):
                    scored = score_prompt(self.model, request.prompt_ids, params.prompt_logprobs)
                first = TokenLogprob(request.prompt_ids[0], None, None)
                entries = [first] + [TokenLogprob(s.token, s.logprob, s.top) for s in scored[1:]]
                request.emit(Event("prompt", logprobs=entries))
                self.counts["prompt_tokens"] += len(request.prompt_ids)
        except Exception as error:  # the loop must go on for the others
            self._count_waiting(-len(request.sequences))
            for sequence in request.sequences:
                sequence.finish_reason = "error"
            request.emit(Event("error", message=f"scoring the prompt failed: {error!r}"))
            return False
        if params.max_tokens > 0:
            return True
        self._count_waiting(-len(request.sequences))
        for sequence in request.sequences:
            sequence.finish_reason = "length"
            output.announce(sequence)
        return False

    def _change_adapter(self, change: AdapterChange) -> None:
        """An AdapterChange, on the loop's thread: the model, the runner's names and the salts."""
        try:
            if change.path is None:
                self._unload(change.name)
            else:
                self._load(change.name, change.path)
        except Exception as error:  # the client is told; the loop goes on
            change.done.set_exception(error)
        else:
            change.done.set_result(None)

    def _load(self, name: str, path: str) -> None:
        if self.runner.native is not None:
            raise ValueError(
                "this server runs the native decoder, which runs no adapter: start it with --enable-lora "
                "(or a --lora) to load adapters at run time"
            )
        if name in self.adapters:
            raise ValueError(f"an adapter named {name!r} is loaded already")
        load_peft(self.model, path, name)  # AdapterError, the model unchanged, if it does not fit
        set_active(self.model, ())  # each row chooses its own
        self.runner.adapters = (*self.adapters, name)
        self._salts[name] = adapter_salt(name, next(self._loads))  # never a block of an earlier `name`

    def _unload(self, name: str) -> None:
        if name not in self.adapters:
            raise LookupError(f"no adapter named {name!r} is loaded; loaded: {list(self.adapters)}")
        using = [s for s in (*self.running, *self.waiting) if s.request.params.adapter == name]
        if using:
            raise ValueError(f"adapter {name!r} is in use by {len(using)} sequences; unload it when they end")
        remove_adapter(self.model, name)
        self.runner.adapters = tuple(n for n in self.adapters if n != name)
        del self._salts[name]

    def _has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def _fail_all(self, message: str) -> None:
        for sequence in self.scheduler.clear():
            if sequence.finish_reason is None:
                sequence.finish_reason = "error"
                sequence.request.emit(Event("error", sequence.index, message=message))

    @torch.no_grad()
    def step(self) -> None:
        """One scheduler iteration (see the module docstring)."""
        self._drop_cancelled()
        self.scheduler.admit()
        self.kv_bytes_peak = max(self.kv_bytes_peak, self.runner.kv_bytes_held())
        self._step()
        for sequence in self.running:  # a step's tokens reach each client as one delta (a verify's several)
            output.send_held(sequence)
        self.kv_bytes_peak = max(self.kv_bytes_peak, self.runner.kv_bytes_held())
        self.counts["steps"] += 1

    def _separate_step(self) -> None:
        """Prompt chunks one forward each (a batch of one), then one decode step for all."""
        for sequence, start, end in self.scheduler.prefill_plan(self.scheduler.budget()):
            self.scheduler.before_forward([(sequence, start, end)])
            logits = self.runner.prefill(sequence, start, end)
            self.scheduler.remember([sequence])
            self.counts["prompt_tokens"] += end - start
            if sequence.computed == len(sequence.tokens):  # a fresh prompt's last chunk
                self._sample(sequence, logits)
        self._decode()

    def _decode(self) -> None:
        """One decode step (runner.decode) for every decoding sequence with room for its token."""
        decoding = self._make_room(self.scheduler.decoding())
        if decoding:
            self.scheduler.before_forward([(s, s.computed, s.computed + 1) for s in decoding])
            logits = self.runner.decode(decoding)  # (N, vocab)
            self.scheduler.remember(decoding)
            # the sequences caught up get a new token (a replay's rows are not sampled)
            ready = [(s, r, r + 1) for r, s in enumerate(decoding) if s.computed == len(s.tokens)]
            self._sample_ready(ready, logits)

    def _packed_step(self) -> None:
        """One forward over every decoding sequence's next token and this step's prompt chunks
        (runner.packed), for a model whose rows are computed alone."""
        budget = self.scheduler.budget()  # before making room: as the step began
        decoding = self._make_room(self.scheduler.decoding())
        plan = self.scheduler.prefill_plan(budget)
        drafts = self._drafts(decoding)  # sequence -> its drafts, fed after its last token
        for sequence, guesses in drafts.items():
            sequence.tokens += guesses
        work = [(s, s.computed, s.computed + 1 + len(drafts.get(s, ()))) for s in decoding]
        work += plan  # (sequence, start, end)
        if not work:
            return
        self.scheduler.before_forward(work)
        ready, logits = self.runner.packed(work, every_row=set(drafts))
        for sequence, guesses in drafts.items():  # unverified: neither tokens nor computed yet
            del sequence.tokens[-len(guesses) :]
            sequence.computed -= len(guesses)
        self.scheduler.remember([sequence for sequence, _, _ in work])
        self.counts["prompt_tokens"] += sum(end - start for _, start, end in plan)
        for sequence, first, end in ready:
            if sequence in drafts:
                kept = self.speculator.verify(sequence, drafts[sequence], logits[first:end], self._sample)
                self.counts["speculative_drafted_tokens"] += len(drafts[sequence])
                self.counts["speculative_accepted_tokens"] += kept
        self._sample_ready([row for row in ready if row[0] not in drafts], logits)

    def _drafts(self, decoding: list[Sequence]) -> dict[Sequence, list[int]]:
        """This step's drafts per sequence, with blocks to hold them (speculation.py)."""
        if self.speculator is None:
            return {}
        return self.speculator.step_drafts(decoding, self.pool, self.context, self.scheduler.long_rope_after)

    def _make_room(self, decoding: list[Sequence]) -> list[Sequence]:
        """The decoding sequences that have a slot for their next token (scheduler.make_room);
        the client of one that alone filled the pool is told it ended."""
        ready, ended = self.scheduler.make_room(decoding)
        for sequence in ended:  # it ends with what it had said, the held-back text included
            output.last_delta(sequence)
            output.announce(sequence)
        return ready

    def _drop_cancelled(self) -> None:
        self.scheduler.drop_cancelled_waiting()
        for sequence in [s for s in self.running if s.request.cancelled.is_set()]:
            sequence.finish_reason = sequence.finish_reason or "cancelled"
            self._retire(sequence)

    def _retire(self, sequence: Sequence) -> None:
        """Free a finished sequence's blocks and tell its client."""
        self.scheduler.finish(sequence)
        output.announce(sequence)

    # ---- tokens out ----

    def _sample_ready(self, ready: list[tuple[Sequence, int, int]], logits: torch.Tensor) -> None:
        """The next token of each (sequence, row, _) of ready from its row of logits (R, V). The
        rows whose choice is the plain argmax (RowChooser.plain) find it in one choose_tokens call
        for all of them (the same token as each alone: an argmax reads its own row only); the
        others go through their own choosers one by one (_sample)."""
        plain = [(s, row) for s, row, _ in ready if s.chooser.plain(len(s.tokens) - s.prompt_len)]
        rows = [row for _, row in plain]
        if rows == list(range(logits.shape[0])):
            scores = logits  # every row: no copy
        else:
            scores = logits[torch.tensor(rows, dtype=torch.long)] if rows else None
        tokens = choose_tokens(scores, False, None).tolist() if rows else []
        chosen = {id(sequence): token for (sequence, _), token in zip(plain, tokens)}
        for sequence, row, _ in ready:
            token = chosen.get(id(sequence))
            if token is None:
                self._sample(sequence, logits[row])
            else:
                self._take(
                    sequence, token, logits[row] if sequence.request.params.logprobs is not None else None
                )

    def _sample(self, sequence: Sequence, logits: torch.Tensor) -> None:
        """Choose the next token from one row's logits (V,) (the sequence's RowChooser), then take it."""
        logits = logits.float()
        token = sequence.chooser.choose(logits, sequence.tokens, len(sequence.tokens) - sequence.prompt_len)
        self._take(sequence, token, logits)

    def _take(self, sequence: Sequence, token: int, logits: torch.Tensor | None) -> None:
        """Append the chosen token (logits: its row (V,), for the log-probabilities and the
        penalties' history; None when neither reads it), then stream it and end the sequence
        where it ends (output.stream)."""
        sequence.chooser.take(token, None if logits is None else logits.device)
        sequence.tokens.append(token)
        self.counts["generated_tokens"] += 1
        self._note_progress(1)
        asked = sequence.request.params.logprobs
        logprobs = [] if asked is None else token_logprobs(logits.float(), token, asked)
        if output.stream(sequence, logprobs, self.context):
            self._retire(sequence)
