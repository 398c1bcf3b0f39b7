"""Driving a serving Engine in-process, as its loop would: every request submitted at once, the
engine stepped until each is done, and what each one's client was told."""

from __future__ import annotations

from flashformer.serve.engine import Engine
from flashformer.serve.request import Event, Request, SamplingParams


def run_requests(engine: Engine, jobs: list[tuple[list[int], SamplingParams]]) -> list[dict]:
    """jobs: (prompt ids, settings), one choice each -> per request its generated "tokens", and
    from its events the "text", the "logprobs" (token, logprob, top) and the "finish" reason."""
    found = [{"text": "", "logprobs": [], "finish": None} for _ in jobs]
    done = [False] * len(jobs)
    requests = []
    for i, (prompt, params) in enumerate(jobs):

        def emit(event: Event, i=i):
            if event.kind == "delta":
                found[i]["text"] += event.text
                found[i]["logprobs"] += [(e.token, e.logprob, e.top) for e in event.logprobs]
            elif event.kind == "finish":
                found[i]["finish"] = event.finish_reason
            elif event.kind == "done":
                done[i] = True

        request = Request(prompt, params, 1, emit)
        engine.submit(request)
        requests.append(request)
    while engine._inbox.qsize():
        engine.waiting.extend(engine._inbox.get().sequences)
    while not all(done):
        engine.step()
    for entry, request in zip(found, requests):
        entry["tokens"] = request.sequences[0].generated
    return found
