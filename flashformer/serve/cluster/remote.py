"""RemoteEngine: what the HTTP app (serve.app's create_app) is given in place of an Engine when the
model runs in replicas on Ray Serve. The app is the one `flashformer serve` always serves, with
every route it has; only where a request goes changes.

    app --Request--> RemoteEngine.submit --Job--> Ray Serve handle --(router.py picks)--> replica
        <--Event---- request.emit      <--[Event, ...]-- the replica's stream of events

The app renders the prompt and checks the request as ever; submit() sends the prompt's ids, the
sampling settings and the prefix key (affinity.prefix_key: the router's input) as a Job, and a
task in the app's event loop hands the replica's events to the request as the local engine's
loop would. A structured output's grammar travels as its spec (compiled on the replica, from
its cache). Cancelling the request (the client went away) cancels the replica's stream, and
the replica's engine drops the sequences within a step.

Faults: a replica that dies mid-stream ends the request with an "error" event (an SSE error
then [DONE], or a 500), never a hang; one that died before its first event had sent anything
is retried once, and Ray's router has dropped the dead replica by then, so it goes to a live
one. Ray's controller replaces the dead replica (its health checks).

add_cluster_routes replaces the app's /health and /metrics with the replicas' view: each
replica's engine counters (gathered with the handle's broadcast), labelled by replica.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, replace

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from ray.exceptions import ActorDiedError, ActorUnavailableError

from flashformer.generate.constraints import ConstraintSpec
from flashformer.serve.cluster.affinity import prefix_key
from flashformer.serve.engine import Busy, Engine
from flashformer.serve.http.status import prometheus
from flashformer.serve.request import Event, Request, SamplingParams, check_prompt_fits

# counters a replica's engine reports that add up across replicas (the rest are per replica)
SUMMED = (
    "generated_tokens",
    "prompt_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "tokens_per_second",
)


@dataclass(frozen=True)
class Job:
    """One request as a replica receives it (pickled by Ray): the prompt's token ids, its
    settings without the compiled grammar (constraint: its spec instead), its choices, and
    its prefix key, which the router reads (router.py) and the replica ignores."""

    prompt_ids: list[int]
    params: SamplingParams
    n: int
    constraint: ConstraintSpec | None
    prefix: tuple[bytes, ...]


@dataclass(frozen=True)
class ModelCard:
    """engine.model as the app reads it: only the config (vocab_size, ...); the weights stay
    in the replicas."""

    config: object


class _CancelSignal(threading.Event):
    """request.cancelled that also calls back in the app's loop when set (from any thread), so
    that the replica's stream is cancelled at once, with no polling."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__()
        self.loop, self.callbacks = loop, []

    def set(self) -> None:
        super().set()
        for callback in list(self.callbacks):
            self.loop.call_soon_threadsafe(callback)


class RemoteEngine(Engine):
    """An Engine whose requests run in Ray Serve replicas (module docstring).

    A subclass so that the app, and anything added to it, treats it as the text engine it
    stands for; Engine.__init__ is deliberately not called (there is no model, loop or pool
    here), and the loop's methods refuse. card: a replica's describe() (replica.py): the
    model's config, context, KV block size and pool, batch and queue limits. replicas: how many
    run; submit() answers Busy past their max_batch + max_waiting sequences each."""

    def __init__(self, handle, tokenizer, card: dict, replicas: int):
        self.handle, self.tokenizer, self.replicas = handle, tokenizer, replicas
        self.model = ModelCard(card["config"])
        self.context, self.block_size = card["context"], card["block_size"]
        self.pool_tokens, self.max_batch = card["pool_tokens"], card["max_batch"]
        self.max_in_flight = replicas * (card["max_batch"] + card["max_waiting"])
        self.start_seconds = card.get("start_seconds", 0.0)
        self.in_flight = 0  # sequences sent and not finished (the app's loop only)
        self.snapshot: list[dict] = []  # the replicas' last stats (replica_stats)
        self._tasks: set[asyncio.Task] = set()

    # ---- the app's side ----

    def submit(self, request: Request) -> None:
        """Send the request to a replica (from the app's event loop). Raises as Engine.submit
        does: ValueError for a prompt that can never fit, Busy past the replicas' queues."""
        length, count = len(request.prompt_ids), len(request.sequences)
        check_prompt_fits(length, self.context, self.pool_tokens)
        if self.in_flight + count > self.max_in_flight:
            raise Busy(
                f"{self.in_flight} sequences are in flight over {self.replicas} replicas "
                f"(max {self.max_in_flight}); try again later"
            )
        constraint = request.params.constraint
        job = Job(
            request.prompt_ids,
            replace(request.params, constraint=None),
            count,
            None if constraint is None else constraint.spec,
            prefix_key(request.prompt_ids, self.block_size),
        )
        loop = asyncio.get_running_loop()
        request.cancelled = _CancelSignal(loop)
        self.in_flight += count
        task = loop.create_task(self._forward(request, job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _forward(self, request: Request, job: Job) -> None:
        """The replica's events to the request, until "done" or "error"; the error event when the
        replica fails. One retry when it died before sending anything."""
        try:
            for attempt in (1, 2):
                stream = self.handle.options(stream=True).generate.remote(job)
                request.cancelled.callbacks = [stream.cancel]
                if request.cancelled.is_set():
                    stream.cancel()
                started = ended = False
                try:
                    async for events in stream:
                        started = True
                        for event in events:
                            ended = ended or event.kind in ("done", "error")
                            _mirror(request, event)
                            request.emit(event)
                except Exception as error:
                    if request.cancelled.is_set():
                        return
                    if (
                        not started
                        and attempt == 1
                        and isinstance(error, ActorDiedError | ActorUnavailableError)
                    ):
                        continue  # nothing was said yet: another replica answers
                    _fail(request, f"the replica serving this request failed: {error!r}")
                    return
                if not ended and not request.cancelled.is_set():
                    _fail(request, "the replica's stream ended before the request finished")
                return
        finally:
            request.cancelled.callbacks = []
            self.in_flight -= job.n

    def metrics(self) -> dict:
        """The replicas' last reported counters, added up (the summed ones) or from the first."""
        if not self.snapshot:
            return {}
        total = dict(self.snapshot[0])
        for stats in self.snapshot[1:]:
            for name in SUMMED:
                total[name] = total.get(name, 0) + stats.get(name, 0)
        return {name: value for name, value in total.items() if isinstance(value, int | float)}

    async def replica_stats(self, timeout_s: float = 5.0) -> tuple[list[dict], list[str]]:
        """(each answering replica's stats, each failure as text), from a broadcast to them all."""
        try:
            answers = await self.handle.broadcast("stats").results_async(
                timeout_s=timeout_s, return_exceptions=True
            )
        except Exception as error:  # no replica at all, or the broadcast timed out
            return [], [repr(error)]
        stats = sorted((a for a in answers if isinstance(a, dict)), key=lambda s: s["replica"])
        self.snapshot = stats
        return stats, [repr(a) for a in answers if not isinstance(a, dict)]

    # ---- the loop runs in the replicas, never here ----

    def run(self) -> None:
        raise NotImplementedError("a RemoteEngine's loops run in its replicas")

    start = step = run


def _mirror(request: Request, event: Event) -> None:
    """Keep the local request's state as the replica's engine keeps its own: finished choices,
    so that request.finished says what the app expects."""
    if event.kind == "finish":
        request.sequences[event.index].finish_reason = event.finish_reason
    elif event.kind == "error":
        for sequence in request.sequences:
            sequence.finish_reason = sequence.finish_reason or "error"


def _fail(request: Request, message: str) -> None:
    event = Event("error", message=message)
    _mirror(request, event)
    request.emit(event)


def add_cluster_routes(app: FastAPI, engine: RemoteEngine, states=None) -> None:
    """Replace the app's /health and /metrics (create_app's, for one engine) with the replicas':

    GET /health   200 {"status": "ok", "replicas": [{"replica", "pid", "node", running and
                  waiting sequences}, ...], "replica_states": Ray's counts ({"RUNNING": 2})};
                  503 with "status": "unavailable" when no replica answers
    GET /metrics  every engine counter once per replica, labelled replica="ID", and
                  flashformer_replicas (replicas answering)

    states: a function giving Ray's replica states (launch.py: from serve.status()), or None."""
    app.router.routes[:] = [
        r for r in app.router.routes if getattr(r, "path", None) not in ("/health", "/metrics")
    ]

    @app.get("/health")
    async def health():
        stats, failures = await engine.replica_stats()
        replicas = [
            {key: s.get(key) for key in ("replica", "pid", "node", "sequences_running", "sequences_waiting")}
            for s in stats
        ]
        body = {"status": "ok" if stats else "unavailable", "replicas": replicas, "failures": failures}
        if states is not None:
            body["replica_states"] = await asyncio.get_running_loop().run_in_executor(None, states)
        return JSONResponse(body, status_code=200 if stats else 503)

    @app.get("/metrics")
    async def metrics():
        stats, _ = await engine.replica_stats()
        return PlainTextResponse(labelled_prometheus(stats))


def labelled_prometheus(stats: list[dict]) -> str:
    """Prometheus text of several engines' counters: http.status.prometheus's names, help and
    types, one sample per replica with a replica label, and flashformer_replicas."""
    lines = [
        "# HELP flashformer_replicas engine replicas answering",
        "# TYPE flashformer_replicas gauge",
        f"flashformer_replicas {len(stats)}",
    ]
    samples: dict[str, list[str]] = {}  # metric -> its HELP and TYPE lines, then one sample per replica
    for replica in stats:
        label = str(replica["replica"]).replace("\\", "\\\\").replace('"', '\\"')
        numbers = {k: v for k, v in replica.items() if isinstance(v, int | float) and k != "pid"}
        for line in prometheus(numbers).splitlines():
            if line.startswith("#"):
                name = line.split()[2]
                samples.setdefault(name, [])
                if len(samples[name]) < 2:
                    samples[name].append(line)
            else:
                name, value = line.rsplit(" ", 1)
                samples[name].append(f'{name}{{replica="{label}"}} {value}')
    for block in samples.values():
        lines += block
    return "\n".join(lines) + "\n"
