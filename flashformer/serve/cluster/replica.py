"""EngineReplica: one Engine in a Ray Serve replica (an actor process of its own, on any node of
the cluster), serving Jobs (remote.py) as streams of events.

The model is loaded by a thread of the replica's own, which then runs the engine's loop, as
`flashformer serve` runs it on the thread that loaded the model (loop.py says why: torch's
OpenMP pools); generate() runs in the replica's event loop and hands the loop's events on. A
stream yields lists of the events that arrived together, so that a step's tokens of one request
cross to the app as one message, not one per token.

Ray Serve calls check_health() on its own schedule; a replica whose loop has stopped reports
itself unhealthy and is replaced, as is one whose process died.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import replace

import torch
from ray import serve

from flashformer.checkpoints.loading import load, load_draft_model
from flashformer.generate.constraints import compile_constraint
from flashformer.generate.proposers import PROPOSERS
from flashformer.model.models import EncoderModel
from flashformer.model.quantize import DEFAULT_ACTIVATIONS
from flashformer.serve.cluster.remote import Job
from flashformer.serve.engine import Busy, Engine
from flashformer.serve.request import Event, Request
from flashformer.serve.speculation import SpeculativeConfig


class EngineReplica:
    """A replica: model (a path every node can read), load_options (load()'s quantize,
    activations), engine_options (Engine's keywords), threads (torch threads; None: torch's)."""

    def __init__(self, model: str, load_options: dict, engine_options: dict, threads: int | None = None):
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self.engine: Engine | None = None
        self._thread = threading.Thread(
            target=self._serve,
            args=(model, load_options, engine_options, threads),
            name="flashformer-engine",
            daemon=True,
        )
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise RuntimeError(f"the replica could not load {model}: {self._failure!r}") from self._failure

    def _serve(self, model_path: str, load_options: dict, engine_options: dict, threads: int | None) -> None:
        """Load, then run the loop on this same thread until the replica goes."""
        try:
            started = time.perf_counter()
            if threads:
                torch.set_num_threads(threads)
            model, tokenizer = load(model_path, **load_options)
            if isinstance(model, EncoderModel):
                raise ValueError(f"{model_path} is an encoder; --replicas serves text-generating models")
            options = dict(engine_options)
            speculative = options.get("speculative")
            if isinstance(speculative, SpeculativeConfig) and PROPOSERS[speculative.method].needs_model:
                quantize = speculative.quantization or load_options.get("quantize")
                options["draft_model"] = load_draft_model(
                    speculative.model, quantize, load_options.get("activations", DEFAULT_ACTIVATIONS)
                )
            self.engine = Engine(model, tokenizer, **options)
            self.engine.start_seconds = time.perf_counter() - started
        except BaseException as error:  # told to the constructor, which fails the replica
            self._failure = error
            self._ready.set()
            return
        self._ready.set()
        self.engine.run()

    def describe(self) -> dict:
        """What the app's RemoteEngine needs to check requests as an Engine would."""
        engine = self.engine
        return {
            "config": engine.model.config,
            "context": engine.context,
            "block_size": engine.pool.block_size,
            "pool_tokens": engine.pool.capacity * engine.pool.block_size,
            "max_batch": engine.max_batch,
            "max_waiting": engine.max_waiting,
            "start_seconds": engine.start_seconds,
        }

    async def generate(self, job: Job):
        """The job's events, in lists of those that arrived together, until "done" or "error".
        Cancelled (the client went away): the request is cancelled in the engine."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        params = job.params
        if job.constraint is not None:
            vocab = self.engine.model.config.vocab_size
            compiled = await loop.run_in_executor(
                None, compile_constraint, job.constraint, self.engine.tokenizer, vocab
            )
            params = replace(params, constraint=compiled)
        request = Request(
            job.prompt_ids, params, job.n, lambda e: loop.call_soon_threadsafe(events.put_nowait, e)
        )
        try:
            self.engine.submit(request)
        except (Busy, ValueError) as error:
            yield [Event("error", message=f"replica {self._name()}: {error}")]
            return
        try:
            while True:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                yield batch
                if any(event.kind in ("done", "error") for event in batch):
                    return
        finally:
            if not request.finished:
                request.cancel()

    def stats(self) -> dict:
        """The engine's counters (engine.metrics()), with who and where this replica is."""
        import ray

        return {
            "replica": self._name(),
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            **self.engine.metrics(),
        }

    def check_health(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("the engine's loop has stopped")

    def _name(self) -> str:
        return serve.get_replica_context().replica_id.unique_id
