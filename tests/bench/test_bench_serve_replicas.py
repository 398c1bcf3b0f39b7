"""bench serve --replicas' pieces (bench/serve_replicas.py): the replicas' command, the prefix
cache's hit rate read from /metrics (one server's, or every replica's added up), the targets."""

from __future__ import annotations

import pytest

from flashformer.bench.serve_replicas import counters_of, hit_rate, replica_targets, replicas_command
from flashformer.serve.http.status import prometheus


def test_the_replicas_share_the_single_servers_threads():
    ours = ["python", "-m", "flashformer.cli", "serve", "m.gguf", "--threads", "2", "--max-batch", "16"]
    assert replicas_command(ours, 2, 2) == [
        *ours[:5],
        "--max-batch",
        "16",
        "--replicas",
        "2",
        "--threads",
        "1",
    ]
    assert replicas_command(ours, 4, 2)[-1] == "1"  # never fewer than one


def test_the_hit_rate_adds_up_every_replicas_counters():
    cluster = pytest.importorskip("flashformer.serve.cluster.remote", reason="needs ray[serve]")
    replicas = [
        {"replica": "a", "prefix_cache_hits": 300, "prefix_cache_queries": 1000, "steps": 5},
        {"replica": "b", "prefix_cache_hits": 100, "prefix_cache_queries": 600, "steps": 7},
    ]
    assert counters_of(cluster.labelled_prometheus(replicas)) == (400, 1600)
    one = prometheus({"prefix_cache_hits": 30, "prefix_cache_queries": 40})  # a single server's
    assert counters_of(one) == (30, 40)
    assert counters_of("llama_server_tokens 3\n") is None
    assert hit_rate((400, 1600), (1000, 2400)) == 600 / 800
    assert hit_rate((400, 1600), (400, 1600)) is None and hit_rate(None, (1, 2)) is None


def test_the_targets_compare_the_replicas_with_the_one_server():
    def workload(rate, ttft, hits):
        return {"output_tokens_per_s": rate, "ttft_p50_s": ttft, "prefix_hit_rate": hits}

    single = {"multi_turn": {"loaded": workload(100.0, 0.5, 0.80)}}
    replicated = {
        "multi_turn": {"loaded": workload(95.0, 0.55, 0.78)},
        "kill_drill": {"hung": 0, "replicas_back_s": 7.5},
    }
    found = replica_targets(single, replicated)
    assert found["multi-turn: output tokens/s, replicas / one server (>= 0.9)"] == 95.0 / 100.0
    assert found["multi-turn: TTFT p50, replicas / one server (<= 1.2)"] == 0.55 / 0.5
    assert abs(found["multi-turn: prefix-cache hit rate, replicas - one server, points (>= -5)"] + 2) < 1e-9
    assert found["killed replica: hung requests (0)"] == 0
    assert found["killed replica: seconds until the replicas are back (<= 30)"] == 7.5
    assert not any(k.startswith("shared prefix") for k in found)  # a workload one of them did not run
