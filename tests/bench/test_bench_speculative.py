"""`bench generate --prompt-lookup N` (bench/speculative.py): llama-lookup's output read from a
recorded run, the worker's measurement on SmolLM2 (both contenders, the same tokens), the
summary's best and range, and the tables."""

from __future__ import annotations

import stat

import pytest

from flashformer.bench import speculative
from flashformer.checkpoints.gguf.packaged_models import smollm2_path

# the lines llama-lookup (llama.cpp 0c1e570, vendored by llama-cpp-python 0.3.36) prints at its end,
# from a run on SmolLM2 Q4_1 with --spec-draft-n-max 10 on this machine
RECORDED = """0.00.893.390 I encoded    7 tokens in    0.075 seconds, speed:  548.517 t/s
0.00.893.395 I decoded   34 tokens in    0.326 seconds, speed:  104.329 t/s
0.00.893.396 I
0.00.893.396 I n_draft      = 10
0.00.893.397 I n_predict    = 34
0.00.893.397 I n_drafted    = 30
0.00.893.401 I n_accept     = 30
0.00.893.402 I accept       = 100.000%
"""


def fake_binary(tmp_path, output: str, code: int = 0):
    path = tmp_path / "llama-lookup"
    path.write_text(f"#!/bin/sh\ncat >&2 <<'EOF'\n{output}EOF\nexit {code}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_llama_cpp_s_output_is_read(tmp_path):
    found = speculative.llama_speculative(fake_binary(tmp_path, RECORDED), "m.gguf", "hello", 32, 10, 2)
    assert found == {
        "tokens_per_s": 104.329,
        "decoded": 34,
        "prompt_tokens": 7,
        "drafted": 30,
        "accepted": 30,
    }
    failed = speculative.llama_speculative(
        fake_binary(tmp_path, "error: invalid argument: --x\n", 1), "m", "p", 8, 2, 2
    )
    assert "error" in failed and "--x" in failed["error"]
    assert speculative.peer_binary(str(tmp_path), draft=False) == (tmp_path / "llama-lookup").resolve()
    with pytest.raises(FileNotFoundError, match="--llama-cpp-dir"):
        speculative.peer_binary(str(tmp_path), draft=True)  # no llama-speculative there


def test_the_worker_times_plain_and_lookup_with_the_same_tokens():
    point = {
        "model": str(smollm2_path()),
        "new_tokens": 6,
        "rounds": 1,
        "threads": None,
        "quantize": "gguf",
        "prompt_lookup": 4,
    }
    result = speculative.timing_worker(point)
    assert set(result["workloads"]) == set(speculative.WORKLOADS)
    for found in result["workloads"].values():
        assert (
            found["same_tokens"] and found["plain_tokens_per_s"] > 0 and found["speculative_tokens_per_s"] > 0
        )
        assert found["accepted"] <= found["drafted"] and found["prompt_tokens"] > 20
    slower = {
        name: {**w, "speculative_tokens_per_s": w["speculative_tokens_per_s"] / 2}
        for name, w in result["workloads"].items()
    }
    peers = [{name: {"tokens_per_s": 10.0} for name in speculative.WORKLOADS}]
    summary = speculative.summarize([result, {"workloads": slower}, {"error": "timed out"}], peers)
    for name, entry in summary.items():
        ours = result["workloads"][name]["speculative_tokens_per_s"]
        assert entry["speculative_tokens_per_s"] == {"best": ours, "min": ours / 2}
        assert entry["speculative / peer"] == pytest.approx(ours / 10.0)
    table = speculative.table({"summary": summary, "point": point})
    assert table.count("\n") == 1 + len(speculative.WORKLOADS) and "| edit-code | yes |" in table
    assert "prompt lookup tok/s" in table and "llama-lookup tok/s" in table


def test_a_draft_model_is_timed_against_plain_decoding():
    """--draft: the same worker with SmolLM2's own Q4_1 blocks drafting for its float32 model."""
    point = {
        "model": str(smollm2_path()),
        "new_tokens": 24,  # past DraftLength's first probe, whatever the timed costs say
        "rounds": 1,
        "threads": None,
        "quantize": None,
        "prompt_lookup": 3,
        "draft": str(smollm2_path()),
        "draft_quantize": "gguf",
    }
    result = speculative.timing_worker(point)
    for found in result["workloads"].values():
        assert found["same_tokens"] and 0 <= found["accepted"] <= found["drafted"]
    assert sum(found["drafted"] for found in result["workloads"].values()) > 0
    assert "llama-speculative" in speculative.table(
        {"summary": speculative.summarize([result], []), "point": point}
    )


def test_the_served_pass_reports_each_contender_s_best_server_and_its_range():
    config = {"processes": 1, "serve_clients": [1], "new_tokens": 4, "quantize": "gguf", "prompt_lookup": 4}
    served = speculative.serve_run(str(smollm2_path()), config, threads=2)
    for label in ("plain", "speculative"):
        run = served[1][label]
        assert run["errors"] == 0 and run["output_tokens"] == 6 * 4  # 6 requests of 4 tokens
        assert run["runs_tokens_per_s"] == [run["output_tokens_per_s"]]
    two = {"output_tokens_per_s": 300.0, "runs_tokens_per_s": [250.0, 300.0], "itl_p50_s": 0.004}
    one = {"output_tokens_per_s": 200.0, "itl_p50_s": 0.005}  # a run of one server (before the ranges)
    table = speculative.served_table(
        {"served": {"1": {"plain": one, "speculative": two, "speculative / plain": 1.5}}}
    )
    assert table.splitlines()[-1] == "| 1 | 200.0 | 300.0 (250.0-300.0) | 1.50x | 5.0 / 4.0 |"
