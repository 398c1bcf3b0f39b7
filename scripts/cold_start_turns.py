"""Process start to first token against a bare `import torch`, fresh processes in turns (issue
61: "within 0.5 s of a bare import torch"). The contenders, each its own process:

    import torch                 python -c "import torch": the floor every PyTorch program stands on
    generate                     flashformer generate FILE --quantize gguf --prompt Hi --max-new-tokens 1 --greedy
    chat                         flashformer chat FILE --quantize gguf --max-new-tokens 1 --greedy, "Hi" on stdin
    serve                        flashformer serve FILE --quantize gguf --threads 2, to its first 200 on /health

    python scripts/cold_start_turns.py $SMOLLM2 --runs 5 --base /tmp/ff-base \\
        --out docs/figures/cold-start/smollm2.json

Each is timed from its spawn to its exit (serve: to /health's 200, then stopped: what a user
waits for), with the CPU seconds the process used (user + system; on a shared machine the wall
time follows the load, the CPU time much less) and the load average before it. --base DIR runs
the flashformer commands once more from the package under DIR (`git archive COMMIT flashformer |
tar -x -C DIR`), in the same turns: before and after on the same machine. The processes run in
an empty temporary folder (a package in the working folder would come before PYTHONPATH), with
Python's compiled modules kept as an installed package keeps them, and the C++ kernels already
built (run a command once before).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLASHFORMER = [sys.executable, "-m", "flashformer.cli"]


def contenders(path: str) -> dict[str, tuple[list[str], bool]]:
    """name -> (command, whether it runs flashformer); serve's port is filled in per run."""
    load = ["--quantize", "gguf"]
    return {
        "import torch": ([sys.executable, "-c", "import torch"], False),
        "generate": ([*FLASHFORMER, "generate", path, *load, "--prompt", "Hi", "--max-new-tokens", "1", "--greedy"], True),
        "chat": ([*FLASHFORMER, "chat", path, *load, "--max-new-tokens", "1", "--greedy"], True),
        "serve": ([*FLASHFORMER, "serve", path, *load, "--threads", "2", "--no-webui", "--port"], True),
    }  # fmt: skip


def one_run(name: str, command: list[str], tree: Path, folder: str, timeout_s: float) -> dict:
    """One fresh process: its wall and CPU seconds to exit (serve: to /health), or {"error": ...}."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = str(tree)
    port = None
    if name == "serve":
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        command = [*command, str(port)]
    with tempfile.TemporaryFile() as errors:
        started = time.perf_counter()
        process = subprocess.Popen(command, cwd=folder, env=env, stdin=subprocess.PIPE,
                                   stdout=subprocess.DEVNULL, stderr=errors, start_new_session=True)  # fmt: skip
        process.stdin.write(b"Hi\n" if name == "chat" else b"")
        process.stdin.close()
        if port is not None:
            result = _until_healthy(process, port, started, timeout_s)
            os.killpg(process.pid, signal.SIGINT)
            process.wait(60)
        else:
            result = _until_exit(process, started, timeout_s)
        if "error" not in result and port is None and process.returncode != 0:
            errors.seek(0)
            tail = errors.read().decode(errors="replace").strip().splitlines()[-1:] or [""]
            result = {"error": f"exit code {process.returncode}: {tail[0][:200]}"}
    return result


def _until_exit(process: subprocess.Popen, started: float, timeout_s: float) -> dict:
    deadline = started + timeout_s
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid:
            seconds = time.perf_counter() - started
            process.returncode = os.waitstatus_to_exitcode(status)
            return {"seconds": seconds, "cpu_s": usage.ru_utime + usage.ru_stime}
        if time.perf_counter() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return {"error": f"timed out after {timeout_s:.0f} s"}
        time.sleep(0.002)


def _until_healthy(process: subprocess.Popen, port: int, started: float, timeout_s: float) -> dict:
    while time.perf_counter() - started < timeout_s:
        if process.poll() is not None:
            return {"error": f"the server exited ({process.returncode}) before /health answered"}
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as answer:
                if answer.status == 200:
                    seconds = time.perf_counter() - started
                    return {"seconds": seconds, "cpu_s": _cpu_seconds(process.pid)}
        except OSError:
            time.sleep(0.01)
    return {"error": f"/health did not answer within {timeout_s:.0f} s"}


def _cpu_seconds(pid: int) -> float:
    """User + system seconds of a running process, all its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


PHASES_KEY = "generate phases (main thread CPU s)"
# `generate` in a fresh process with its phases stamped in the main thread's CPU time (thread_time:
# on a shared machine the wall time between two stamps is mostly other processes' turns)
PHASES = """
import builtins, json, sys, time
marks = [("interpreter up", time.thread_time())]
import flashformer.cli.commands as commands
marks.append(("import flashformer.cli.commands", time.thread_time()))
build = commands.build_parser
def build_parser(*args):
    parser = build(*args)
    marks.append(("the command's module imported", time.thread_time()))
    import flashformer.cli.arguments as arguments
    load = arguments.load
    def timed_load(*args, **kwargs):
        model = load(*args, **kwargs)
        marks.append(("model and tokenizer loaded", time.thread_time()))
        return model
    arguments.load = timed_load
    return parser
commands.build_parser = build_parser
printed = builtins.print
def stamped_print(*args, **kwargs):
    printed(*args, **kwargs)
    marks.append(("printed", time.thread_time()))
builtins.print = stamped_print
commands.main(sys.argv[1:])
marks = [m for m in marks if m[0] != "printed"] + [("first token printed", [m for m in marks if m[0] == "printed"][1][1])]
sys.stderr.write("PHASES " + json.dumps(marks) + "\\n")
"""


def phases(path: str, tree: Path, folder: str) -> dict[str, float]:
    """The main thread's CPU seconds of each phase of `generate` (see PHASES), and their total."""
    command, _ = contenders(path)["generate"]
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run([sys.executable, "-c", PHASES, *command[3:]], cwd=folder, capture_output=True,
                          text=True, env={**env, "PYTHONPATH": str(tree)}, check=True)  # fmt: skip
    marks = json.loads(next(line for line in done.stderr.splitlines() if line.startswith("PHASES "))[7:])
    spans = {name: end - start for (_, start), (name, end) in zip(marks, marks[1:])}
    return {"interpreter up": marks[0][1], **spans, "total": marks[-1][1]}


def run(path: str, runs: int, base: Path | None, timeout_s: float) -> dict:
    """`runs` turns; in each, every (contender, tree) once, the order rotated turn by turn."""
    trees = {"this": ROOT, **({"base": base} if base else {})}
    programs = contenders(path)
    order = [(name, tree) for name, (_, ours) in programs.items() for tree in (trees if ours else ["this"])]
    found: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as folder:
        for turn in range(runs):
            shift = turn % len(order)
            for name, tree in order[shift:] + order[:shift]:
                load = os.getloadavg()[0]
                result = one_run(name, programs[name][0], trees[tree], folder, timeout_s)
                key = name if not programs[name][1] else f"{name} ({tree})"
                found.setdefault(key, []).append({**result, "load_average": load})
                print(key, result, f"load {load:.1f}", flush=True)
            for tree in trees:  # the phases, once a turn for each tree, and a bare import torch's
                split = {"tree": tree, **phases(path, trees[tree], folder)}
                found.setdefault(PHASES_KEY, []).append({**split, "load_average": os.getloadavg()[0]})
            alone = subprocess.run([sys.executable, "-c", "import time, torch; print(time.thread_time())"],
                                   cwd=folder, capture_output=True, text=True, check=True)  # fmt: skip
            split = {"tree": "import torch", "total": float(alone.stdout)}
            found[PHASES_KEY].append({**split, "load_average": os.getloadavg()[0]})
    return {
        "config": {
            "file": str(path),
            "runs": runs,
            "base": str(base) if base else None,
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
        },  # fmt: skip
        "runs": found,
        "summary": {key: summarize(results) for key, results in found.items() if key != PHASES_KEY},
    }


def summarize(results: list[dict]) -> dict:
    seconds = sorted(r["seconds"] for r in results if "seconds" in r)
    cpu = sorted(r["cpu_s"] for r in results if "cpu_s" in r)
    if not seconds:
        return {"errors": len(results)}
    return {"best": seconds[0], "median": statistics.median(seconds), "worst": seconds[-1],
            "cpu_best": cpu[0], "cpu_median": statistics.median(cpu),
            "load_average": [min(r["load_average"] for r in results), max(r["load_average"] for r in results)]}  # fmt: skip


def phase_medians(payload: dict) -> dict[str, dict[str, float]]:
    """tree -> phase -> the median over the turns of its main-thread CPU seconds."""
    splits = payload["runs"].get(PHASES_KEY, [])
    medians = {}
    for tree in dict.fromkeys(split["tree"] for split in splits):
        mine = [split for split in splits if split["tree"] == tree]
        names = [key for key in mine[0] if key not in ("tree", "load_average")]
        medians[tree] = {name: statistics.median(split[name] for split in mine) for name in names}
    return medians


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", help="a GGUF file (SmolLM2-135M-Instruct Q4_1 for issue 61's figure)")
    parser.add_argument("--runs", type=int, default=5, help="turns (fresh processes of each contender)")
    parser.add_argument("--base", type=Path, help="a folder holding another tree's flashformer/ to compare")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one process may take")
    parser.add_argument("--out", type=Path, help="write the JSON here")
    args = parser.parse_args(argv)
    if args.base is not None and not (args.base / "flashformer" / "__init__.py").is_file():
        parser.error(f"--base {args.base}: no flashformer/__init__.py inside")
    payload = run(args.file, args.runs, args.base, args.timeout)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(payload, indent=1) + "\n")
    for tree, spans in phase_medians(payload).items():
        print(f"generate, {tree}: " + ", ".join(f"{name} {value:.3f}" for name, value in spans.items()))
    for key, s in payload["summary"].items():
        if "best" in s:
            print(f"{key:18s} best {s['best']:.2f} median {s['median']:.2f} ({s['best']:.2f}-{s['worst']:.2f}) s,"
                  f" CPU median {s['cpu_median']:.2f} s")  # fmt: skip
    return payload


if __name__ == "__main__":
    main()
