"""The servers `bench serve` measures, as commands, and how one is started and waited for.

flashformer's own server (batching, its prefix cache on and off, one request at a time) and
its peers on the same GGUF file, with the same threads:

- llama.cpp's own server, `llama-server` (--llama-server PATH): continuous batching over
  `-np N` parallel slots, each slot a context of its own (`-c` is their sum, so N * CTX).
  Its prompt cache (a slot keeps its last prompt's KV and reuses the common prefix of the
  next one, `cache_prompt`, on by default, plus a RAM cache of idle slots' prompts) is the
  peer of our prefix cache; `--no-cache-prompt --cache-ram 0` turns both off. It is ready
  when `/health` answers 200 (503 while the model loads). In streams it sends usage in a
  last chunk when asked (`stream_options.include_usage`), as OpenAI does.
- llama-cpp-python's server (`python -m llama_cpp.server`): one request at a time whatever
  the load, so it is named unbatched and runs only when no llama-server is given.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import NamedTuple

from flashformer.bench.llama_cpp_binaries import executable, llama_server_command

# tokens of one llama-server slot: the longest request of the workloads (a 1000-token first
# message, three turns of questions and answers, the chat template) with room to spare
SLOT_CONTEXT = 2048


class Server(NamedTuple):
    """A server to measure: its command (with "{port}" where the port goes), the workloads it
    runs, and the path under its root that answers 200 once it is ready."""

    command: list[str]
    workloads: set[str]
    ready_path: str = "/v1/models"


def llama_cpp_python_command(model: str, threads: int) -> list[str]:
    """llama-cpp-python's OpenAI server on MODEL (one request at a time)."""
    return [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port", "{port}",
            "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "4096",
            "--api_key", "bench"]  # fmt: skip


def peers(model: str, args, chosen: set[str]) -> dict[str, Server]:
    """name -> Server of the peers asked for: llama-server (its prompt cache on, and off for
    the workloads that measure caching) or, without it, llama-cpp-python's server."""
    cached = chosen - {"mixed"}
    threads = args.threads or 2
    if args.llama_server:
        binary = executable(args.llama_server, "--llama-server")
        slots, context = args.clients, args.llama_server_context
        name = f"llama-server (-np {slots})"
        return {
            name: Server(llama_server_command(binary, model, threads, slots, context), chosen, "/health"),
            f"{name[:-1]}, no prompt cache)": Server(
                llama_server_command(binary, model, threads, slots, context, cache=False), cached, "/health"
            ),
        }
    import importlib.util

    if args.no_llama_cpp or not Path(model).is_file() or importlib.util.find_spec("llama_cpp") is None:
        return {}
    return {
        "llama-cpp-python server (unbatched)": Server(
            llama_cpp_python_command(model, threads), chosen & {"mixed"}
        )
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# How long a server may take to answer /health: both load the model and listen (seconds; nothing
# is compiled), much more than that only on a machine loaded by others.
START_TIMEOUT_S = 600


def start(command: list[str], ready_url: str, timeout_s: float = START_TIMEOUT_S) -> subprocess.Popen:
    """Start the server and wait until ready_url answers 200; RuntimeError with the end of its
    output if it exits first (a bad flag, a file it cannot load) or never answers."""
    # the server's output goes to a file: a pipe nobody reads fills up and blocks a chatty server
    log = tempfile.TemporaryFile(mode="w+")
    try:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    except OSError as error:
        raise RuntimeError(f"{command[0]} could not start: {error}") from None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            output = " ".join(log.read()[-500:].split())  # one line, its end
            raise RuntimeError(f"{Path(command[0]).name} exited ({process.returncode}): {output}")
        try:
            ready = urllib.request.Request(ready_url, headers={"Authorization": "Bearer bench"})
            with urllib.request.urlopen(ready, timeout=2) as reply:
                if reply.status == 200:
                    return process
        except OSError:  # refused while it starts, 503 while it loads
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{Path(command[0]).name} did not answer {ready_url} within {timeout_s} s")


def kernel_path(quantize: str | None) -> str | None:
    """The code our quantized kernels run on this CPU (the server's process chooses the same way);
    None for a float model."""
    if not quantize:
        return None
    from flashformer.kernels.quantized import kernel_isa

    return kernel_isa()


def peer_targets(ours: dict, theirs: dict, clients: int) -> dict:
    """The speed issue's ratios against llama-server: one client alone, and `clients` in flight."""
    if "loaded" not in ours or "loaded" not in theirs:
        return {}
    alone, peer_alone, loaded, peer_loaded = ours["alone"], theirs["alone"], ours["loaded"], theirs["loaded"]

    def ratio(a, b):
        return None if a is None or not b else a / b

    return {
        "1 client: output tokens/s / llama-server's (>= 1.0)": ratio(
            alone["output_tokens_per_s"], peer_alone["output_tokens_per_s"]
        ),
        "1 client: ITL p99 / llama-server's (<= 1.2)": ratio(alone["itl_p99_s"], peer_alone["itl_p99_s"]),
        f"{clients} clients: output tokens/s / llama-server's (>= 1.5)": ratio(
            loaded["output_tokens_per_s"], peer_loaded["output_tokens_per_s"]
        ),
        f"{clients} clients: TTFT p50 / llama-server's (<= 1)": ratio(
            loaded["ttft_p50_s"], peer_loaded["ttft_p50_s"]
        ),
        f"{clients} clients: ITL p99 / llama-server's (<= 1)": ratio(
            loaded["itl_p99_s"], peer_loaded["itl_p99_s"]
        ),
    }
