"""`flashformer serve`'s threads (cli/serve.py run_beside): the engine's loop stays on the
thread that loaded and warmed the model, the HTTP server runs beside it, and the process
ends cleanly on SIGTERM and with an error when the HTTP server stops on its own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from helpers import tiny_chat_folder

from flashformer.cli.serve import run_beside


class FakeEngine:
    """ModelLoop's run/stop: run() blocks until stop() and records its thread."""

    def __init__(self):
        self.stopped = threading.Event()
        self.ran_on: threading.Thread | None = None

    def run(self) -> None:
        self.ran_on = threading.current_thread()
        while not self.stopped.wait(0.01):
            pass

    def stop(self) -> None:
        self.stopped.set()


class FakeHTTP:
    """uvicorn.Server's run/should_exit: serves until should_exit, or stops by itself after
    `fails_after` seconds (as when its port is taken)."""

    def __init__(self, fails_after: float | None = None):
        self.should_exit = False
        self.fails_after = fails_after
        self.ran_on: threading.Thread | None = None

    def run(self) -> None:
        self.ran_on = threading.current_thread()
        started = time.monotonic()
        while not self.should_exit:
            if self.fails_after is not None and time.monotonic() - started > self.fails_after:
                return
            time.sleep(0.01)


def test_the_engine_runs_on_the_calling_thread_and_sigterm_stops_both():
    engine, web = FakeEngine(), FakeHTTP()
    before = signal.getsignal(signal.SIGTERM)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    assert run_beside(engine, web) is True  # stopped by the signal, as asked
    assert engine.ran_on is threading.main_thread()
    assert web.ran_on is not None and web.ran_on is not threading.main_thread()
    assert web.should_exit
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is given back


def test_an_http_server_that_stops_by_itself_stops_the_engine():
    engine, web = FakeEngine(), FakeHTTP(fails_after=0.2)
    assert run_beside(engine, web) is False
    assert engine.stopped.is_set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_on_a_taken_port_exits_with_an_error(tmp_path):
    folder = tiny_chat_folder(tmp_path / "tiny", max_positions=64)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = [sys.executable, "-m", "flashformer.cli", "serve", str(folder)]
        done = subprocess.run([*command, "--port", str(port)], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert f"the HTTP server on 127.0.0.1:{port} stopped" in done.stderr


def test_serve_ends_cleanly_on_sigterm(tmp_path):
    folder = tiny_chat_folder(tmp_path / "tiny", max_positions=64)
    port = free_port()
    command = [sys.executable, "-m", "flashformer.cli", "serve", str(folder)]
    process = subprocess.Popen(
        [*command, "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            assert process.poll() is None, process.stdout.read()
            time.sleep(0.2)
    process.terminate()
    assert process.wait(timeout=60) == 0, process.stdout.read()
