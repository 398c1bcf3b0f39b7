"""llama.cpp's programs as the benchmarks' peers, without them: the llama-server commands bench
serve builds, the refusal of a missing binary before any work, a server that dies at start,
llama-bench's JSON read from a recorded run, and the ratios against it. With the binaries built
(FLASHFORMER_LLAMA_CPP_DIR, else /work/llama.cpp/build-native), slow tests run them for real."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

import pytest

from flashformer.bench import generate_model, serve, serve_load, turns
from flashformer.bench.llama_cpp_binaries import llama_bench_command, parse_llama_bench, run_llama_bench
from flashformer.bench.serve_peers import free_port, start

# `llama-bench -m SmolLM2-135M-Instruct.Q4_1.gguf -t 2 -p 512 -n 128 -r 3 -o json` of llama.cpp
# 0c1e570 (vendored by llama-cpp-python 0.3.36) built for AVX-512, on a 2-core Xeon shared with
# other jobs (load 15-20: hence the low rates), the fields it prints cut to those read and a few;
# pp512 from a run with OpenMP's default wait, tg128 from one with OMP_WAIT_POLICY=passive
RECORDED = """[
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "Intel(R) Xeon(R) Processor",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_threads": 2,
    "repack": true,
    "n_prompt": 512,
    "n_gen": 0,
    "n_depth": 0,
    "test_time": "2026-12-02T06:07:52Z",
    "avg_ns": 24542883134,
    "stddev_ns": 204545098,
    "avg_ts": 20.862408,
    "stddev_ts": 0.173335,
    "samples_ns": [ 24371401873, 24769280546, 24487966983 ],
    "samples_ts": [ 21.0082, 20.6708, 20.9082 ]
  },
  {
    "build_commit": "0c1e570",
    "build_number": 1,
    "cpu_info": "Intel(R) Xeon(R) Processor",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "model_type": "llama 256M Q4_1",
    "model_size": 96576768,
    "model_n_params": 134515008,
    "n_threads": 2,
    "repack": true,
    "n_prompt": 0,
    "n_gen": 128,
    "n_depth": 0,
    "avg_ts": 42.476148,
    "stddev_ts": 7.237325,
    "samples_ts": [ 46.894, 34.1239, 46.4106 ]
  }
]"""


def built() -> Path | None:
    """The folder of a llama.cpp build with both programs, or None."""
    folder = Path(os.environ.get("FLASHFORMER_LLAMA_CPP_DIR", "/work/llama.cpp/build-native"))
    folder = folder / "bin" if (folder / "bin").is_dir() else folder
    found = all((folder / name).is_file() for name in ("llama-server", "llama-bench"))
    return folder if found else None


def executable_file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def serve_arguments(*given: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(["model.gguf", *given])


def test_llama_server_runs_with_one_slot_a_client_its_cache_on_and_off(tmp_path):
    binary = executable_file(tmp_path, "llama-server")
    args = serve_arguments("--llama-server", str(binary), "--clients", "16", "--threads", "2")
    found = serve.servers("model.gguf", args)
    assert not any("llama-cpp-python" in name for name in found)  # the unbatched server is left out
    cached, uncached = found["llama-server (-np 16)"], found["llama-server (-np 16, no prompt cache)"]
    assert cached.command == [
        str(binary.resolve()), "-m", "model.gguf", "-t", "2", "-np", "16", "-c", str(16 * 2048),
        "--host", "127.0.0.1", "--port", "{port}", "--no-webui",
    ]  # fmt: skip
    assert uncached.command == cached.command + ["--no-cache-prompt", "--cache-ram", "0"]
    assert cached.workloads == {"mixed", "shared-prefix", "multi-turn"}
    assert uncached.workloads == {"shared-prefix", "multi-turn"}  # caching's workloads only
    assert cached.ready_path == uncached.ready_path == "/health"


def test_a_missing_or_unusable_binary_is_refused_before_any_work(tmp_path):
    with pytest.raises(FileNotFoundError, match="--llama-server: no file at '/nowhere/llama-server'"):
        serve.run("model.gguf", serve_arguments("--llama-server", "/nowhere/llama-server"))
    plain = tmp_path / "llama-server"
    plain.write_text("")
    with pytest.raises(ValueError, match="is not executable"):
        serve.run("model.gguf", serve_arguments("--llama-server", str(plain)))
    config = {"question": "Hi", "new_tokens": 4, "rounds": 1, "llama_cpp_dirs": [str(tmp_path)]}
    with pytest.raises(FileNotFoundError, match="--llama-cpp-dir: no file at .*llama-bench"):
        generate_model.run("model.gguf", config, tmp_path / "out", 2, timeout_s=1)


def test_a_server_that_exits_at_start_is_reported_with_its_output():
    command = [sys.executable, "-c", "import sys; print('error: unknown argument: -np'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"exited \(3\): error: unknown argument: -np"):
        start(command, f"http://127.0.0.1:{free_port()}/health", timeout_s=30)


def test_llama_bench_json_is_read_test_by_test():
    found = parse_llama_bench(RECORDED)
    for name in ("pp512", "tg128"):
        test = found[name]
        assert len(test["samples"]) == 3
        # llama-bench's avg_ts is the mean of its repetitions' tokens/s
        assert test["tokens_per_s"] == pytest.approx(statistics.mean(test["samples"]), rel=1e-3)
        assert test["stddev"] == pytest.approx(statistics.stdev(test["samples"]), rel=1e-2, abs=1e-3)
    assert found["pp512"]["tokens_per_s"] == 20.862408 and found["tg128"]["samples"][1] == 34.1239
    assert found["threads"] == 2 and found["backends"] == "CPU" and found["build"] == "0c1e570 (1)"
    with pytest.raises(ValueError, match="llama-bench's output is not JSON"):
        parse_llama_bench("main: error: failed to load model")


def test_llama_bench_runs_the_issue_s_tests():
    command = llama_bench_command(Path("/b/llama-bench"), "m.gguf", 2)
    assert command == [
        "/b/llama-bench",
        "-m",
        "m.gguf",
        "-t",
        "2",
        "-p",
        "512",
        "-n",
        "128",
        "-r",
        "3",
        "-o",
        "json",
    ]


def test_our_rates_are_given_as_ratios_of_llama_bench_s():
    bench = {"pp512": {"tokens_per_s": 400.0, "stddev": 4.0}, "tg128": {"tokens_per_s": 80.0, "stddev": 1.0}}
    point = {
        "decode_tokens_per_s": {"flashformer": 100.0, "flashformer+compile": 50.0},  # the default path's
        "prompt_tokens_per_s": {"flashformer": 1000.0},
        "llama_bench": {"build-native": bench, "build-avx2": {"error": "exit code 1: illegal instruction"}},
    }
    assert generate_model.llama_bench_ratios(point) == {
        "build-native": {"decode / tg128": 1.25, "prompt / pp512": 2.5}
    }
    assert generate_model.build_name("/work/llama.cpp/build-avx2/bin") == "build-avx2"
    best = generate_model.best_run({**bench, "tg128": {"tokens_per_s": 70.0}}, bench)
    assert best["tg128"]["tokens_per_s"] == 80.0 and len(best["runs"]) == 2


def test_the_ratios_against_llama_server_are_the_speed_issue_s():
    def result(rate, ttft, itl_p99):
        return {"output_tokens_per_s": rate, "ttft_p50_s": ttft, "itl_p99_s": itl_p99}

    ours = {"alone": result(60.0, 0.1, 0.02), "loaded": result(150.0, 0.5, 0.2)}
    theirs = {"alone": result(50.0, 0.1, 0.025), "loaded": result(100.0, 0.4, 0.25)}
    found = serve.targets({"flashformer (max batch 16)": ours, "llama-server (-np 16)": theirs}, 16)
    assert found == {
        "1 client: output tokens/s / llama-server's (>= 1.0)": pytest.approx(1.2),
        "1 client: ITL p99 / llama-server's (<= 1.2)": pytest.approx(0.8),
        "16 clients: output tokens/s / llama-server's (>= 1.5)": pytest.approx(1.5),
        "16 clients: TTFT p50 / llama-server's (<= 1)": pytest.approx(1.25),
        "16 clients: ITL p99 / llama-server's (<= 1)": pytest.approx(0.8),
    }


@pytest.mark.slow
@pytest.mark.skipif(built() is None, reason="llama.cpp's llama-bench and llama-server are not built")
def test_the_real_llama_bench_on_smollm2():
    from flashformer.checkpoints.gguf.packaged_models import smollm2_path

    found = run_llama_bench(built(), str(smollm2_path()), 2)
    assert "error" not in found, found
    assert found["pp512"]["tokens_per_s"] > found["tg128"]["tokens_per_s"] > 1


@pytest.mark.slow
@pytest.mark.skipif(built() is None, reason="llama.cpp's llama-bench and llama-server are not built")
def test_the_real_llama_server_streams_with_usage():
    from flashformer.checkpoints.gguf.packaged_models import smollm2_path

    args = serve_arguments("--llama-server", str(built() / "llama-server"), "--clients", "2")
    server = serve.servers(str(smollm2_path()), args)["llama-server (-np 2)"]
    port = free_port()
    process = start(
        [part.replace("{port}", str(port)) for part in server.command], f"http://127.0.0.1:{port}/health"
    )
    try:
        url = f"http://127.0.0.1:{port}/v1"
        found = asyncio.run(
            serve_load.drive(url, "any", [("Say hello.", 8), ("Count to three.", 8)], 2, "bench")
        )
    finally:
        process.terminate()
        process.wait(timeout=60)
    assert found["errors"] == 0 and found["ttft_p50_s"] is not None
    assert 2 <= found["output_tokens"] <= 16  # counted from the streams' usage: at most 8 each


def test_fresh_processes_in_turns_are_tabled_as_best_median_and_range():
    runs = {
        "flashformer": [{"decode": d, "prompt": 10 * d} for d in (100.0, 90.0, 80.0)],
        "llama.cpp": [{"decode": d, "prompt": 5 * d} for d in (50.0, 40.0, 45.0)],
    }
    summary = {
        name: {
            kind: {"best": max(r[kind] for r in found), "median": sorted(r[kind] for r in found)[1],
                   "worst": min(r[kind] for r in found)}
            for kind in ("decode", "prompt")
        }
        for name, found in runs.items()
    }  # fmt: skip
    payload = {"config": {"file": "/m/x.gguf", "threads": 2, "isa": None, "llama_bench": "l/build-native/bin/llama-bench"},
               "runs": runs, "summary": summary}  # fmt: skip
    text = turns.table(payload)
    assert "x.gguf, 2 threads, our kernels' path best, llama.cpp: llama-bench of build-native" in text
    assert "3 fresh processes each" in text
    decode = next(line for line in text.splitlines() if line.startswith("| decode"))
    # best / best 100 / 50, median / median 90 / 45, our median / our best 90 / 100
    assert "| 100.0 / 90.0 (80.0-100.0) | 50.0 / 45.0 (40.0-50.0) | 2.00 | 2.00 | 0.90 |" in decode
