"""The loop that owns a model: what the text engine and the embedding engine share.

The server's threads hand requests to `submit`, which checks them and puts
them in an inbox; one thread (the loop) moves whatever arrived into the
engine's waiting queue and runs one `step`, again and again, sleeping only
when there is nothing to do. Only the loop touches the model, so a step
never races a request; the waiting count is kept under a lock so that
`submit` can refuse with Busy (503) past `max_waiting` instead of queueing
without bound. A step that raises fails every request it holds, with the
error, rather than leaving clients waiting forever.

`start` runs the loop in a thread of its own; `run` runs it in the calling thread
until `stop`. `flashformer serve` uses `run` on the thread that loaded the
model, with the HTTP server in another thread: GNU OpenMP (torch's) keeps a
pool of workers for every thread that ever ran a parallel region, and once the
pools' threads outnumber the cores its idle workers spin 1,000 times instead of
300,000 before they sleep. The decode step, when it was compiled, was a few
hundred short parallel regions, and on 2 cores a loop thread of its own made
SmolLM2's step 19-25 ms instead of 6 ms (docs/benchmarks.md, "The thread that
runs the step").
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque


class Busy(RuntimeError):
    """The waiting queue is full (the server answers 503)."""


class ModelLoop:
    """The inbox, the waiting count and the thread; subclasses say what a request brings
    (`_accept`), whether work remains (`_has_work`), what one iteration does (`step`) and
    how every held request fails (`_fail_all`)."""

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self._inbox: queue.Queue = queue.Queue()
        self._waiting_count = 0  # items submitted and not yet running (read from other threads)
        self._count_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress: deque[tuple[float, int]] = deque(maxlen=4096)  # (time, items done)

    def _note_progress(self, count: int) -> None:
        """Record `count` items (tokens, inputs) done now, for the rate /metrics reports."""
        self._progress.append((time.monotonic(), count))

    def _rate(self, window_s: float = 10.0) -> float:
        """Items per second over the last window_s seconds (0 until two records fall in it)."""
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._progress) if now - t <= window_s]
        span = now - recent[0][0] if len(recent) > 1 else 0.0
        return sum(n for _, n in recent[1:]) / span if span > 0 else 0.0

    def _enqueue(self, request, items: int) -> None:
        """Count `items` more waiting (Busy past max_waiting) and hand the request to the loop."""
        with self._count_lock:
            if self._waiting_count + items > self.max_waiting:
                raise Busy(f"{self._waiting_count} are waiting (max {self.max_waiting}); try again later")
            self._waiting_count += items
        self._inbox.put(request)

    def _count_waiting(self, change: int) -> None:
        with self._count_lock:
            self._waiting_count += change

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="flashformer-engine", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """The loop in the calling thread, until stop() (from another thread) or an exception."""
        self._run()

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                request = self._inbox.get(timeout=None if not self._has_work() else 0.0)
            except queue.Empty:
                request = None
            while request is not None:
                self._accept(request)
                try:
                    request = self._inbox.get_nowait()
                except queue.Empty:
                    request = None
            if self._stop.is_set():
                break
            try:
                self.step()
            except Exception as error:  # a failing step must not leave clients waiting forever
                self._fail_all(f"the engine failed: {error!r}")
                self._count_waiting(-self._waiting_count)

    # ---- what an engine provides ----

    def _accept(self, request) -> None:
        raise NotImplementedError

    def _has_work(self) -> bool:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def _fail_all(self, message: str) -> None:
        raise NotImplementedError
