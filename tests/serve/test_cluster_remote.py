"""RemoteEngine (serve/cluster/remote.py) against a stand-in for Ray Serve's handle: what the app
sees when a replica answers, dies before or after its first event, or the client goes away, and
the limits it checks before sending anything."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray.serve", reason="the [cluster] extra (ray[serve]) is not installed")

from ray.exceptions import ActorDiedError  # noqa: E402
from ray.serve.exceptions import RequestCancelledError  # noqa: E402

from flashformer.serve.cluster.remote import RemoteEngine  # noqa: E402
from flashformer.serve.engine import Busy  # noqa: E402
from flashformer.serve.request import Event, Request, SamplingParams  # noqa: E402

CARD = {"config": None, "context": 64, "block_size": 4, "pool_tokens": 48, "max_batch": 2, "max_waiting": 1}


class Stream:
    """A replica's stream: yields its lists of events, or raises `fails` after `after` of them;
    with `wait`, then waits until cancelled."""

    def __init__(self, batches, fails=None, after=0, wait=False):
        self.batches, self.fails, self.after, self.wait = batches, fails, after, wait
        self.cancelled = asyncio.Event()

    def cancel(self):
        self.cancelled.set()

    async def __aiter__(self):
        for i, batch in enumerate(self.batches):
            if self.fails is not None and i == self.after:
                raise self.fails
            yield batch
        if self.fails is not None and self.after >= len(self.batches):
            raise self.fails
        if self.wait:
            await self.cancelled.wait()
            raise RequestCancelledError()  # as Ray's stream does when cancelled


class Handle:
    """handle.options(stream=True).generate.remote(job): the next of `streams`, each job kept."""

    def __init__(self, *streams):
        self.streams, self.jobs = list(streams), []
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, job):
        self.jobs.append(job)
        return self.streams.pop(0)


ANSWER = [[Event("delta", 0, "Hi")], [Event("finish", 0, finish_reason="stop"), Event("done", usage={})]]


def serve(handle, prompt=None, cancel_after=None) -> tuple[list[Event], Request, RemoteEngine]:
    """Submit one request as the app does and collect what it is told."""
    engine = RemoteEngine(handle, tokenizer=None, card=CARD, replicas=2)

    async def run():
        told = []
        request = Request(prompt or list(range(10)), SamplingParams(max_tokens=4), 1, told.append)
        engine.submit(request)
        if cancel_after is not None:
            await asyncio.sleep(cancel_after)
            request.cancel()
        await asyncio.gather(*engine._tasks)
        return told, request

    told, request = asyncio.run(run())
    return told, request, engine


def test_the_replicas_events_reach_the_request_and_its_key_travels_with_it():
    handle = Handle(Stream(ANSWER))
    told, request, engine = serve(handle)
    assert [e.kind for e in told] == ["delta", "finish", "done"] and request.finished
    job = handle.jobs[0]
    assert job.prompt_ids == list(range(10)) and len(job.prefix) == 2  # two full blocks of 4
    assert job.params.constraint is None and engine.in_flight == 0


def test_a_replica_dead_before_its_first_event_is_retried_once():
    handle = Handle(Stream(ANSWER, fails=ActorDiedError(), after=0), Stream(ANSWER))
    told, request, _ = serve(handle)
    assert len(handle.jobs) == 2 and [e.kind for e in told] == ["delta", "finish", "done"]


def test_a_replica_dead_mid_stream_ends_the_request_with_an_error():
    handle = Handle(Stream(ANSWER, fails=ActorDiedError(), after=1), Stream(ANSWER))
    told, request, engine = serve(handle)
    assert len(handle.jobs) == 1  # it had spoken: no retry, the client is told
    assert [e.kind for e in told] == ["delta", "error"] and "ActorDiedError" in told[-1].message
    assert request.finished and engine.in_flight == 0


def test_a_stream_that_ends_early_is_an_error_not_a_wait():
    told, request, _ = serve(Handle(Stream(ANSWER[:1])))
    assert [e.kind for e in told] == ["delta", "error"] and request.finished


def test_a_request_cancelled_by_its_client_cancels_the_replicas_stream():
    stream = Stream(ANSWER[:1], wait=True)
    told, request, engine = serve(Handle(stream), cancel_after=0.05)
    assert stream.cancelled.is_set() and [e.kind for e in told] == ["delta"] and engine.in_flight == 0


def test_what_can_never_fit_and_what_is_too_much_are_refused_before_sending():
    handle = Handle()
    engine = RemoteEngine(handle, tokenizer=None, card=CARD, replicas=2)
    with pytest.raises(ValueError, match="context is 64"):
        engine.submit(Request(list(range(64)), SamplingParams(max_tokens=1), 1, print))
    with pytest.raises(ValueError, match="KV pool holds 48"):
        engine.submit(Request(list(range(50)), SamplingParams(max_tokens=1), 1, print))
    engine.in_flight = engine.max_in_flight  # 2 replicas x (2 + 1)
    with pytest.raises(Busy, match="max 6"):
        engine.submit(Request([1, 2], SamplingParams(max_tokens=1), 1, print))
    assert handle.jobs == []
