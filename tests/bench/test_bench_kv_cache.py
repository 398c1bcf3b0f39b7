"""`bench generate --cache-types` (bench/kv_cache.py): the types parsed, the worker's measurement on
SmolLM2 (each type's bytes per token and speed), llama-bench's JSON read, the table and figure."""

from __future__ import annotations

import json
import stat

import pytest

from flashformer.bench import kv_cache
from flashformer.checkpoints.gguf.packaged_models import smollm2_path


def test_types_are_parsed_as_keys_slash_values():
    assert kv_cache.parse_types("f16, q8_0,q8_0/q4_0") == [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "q4_0")]
    with pytest.raises(ValueError, match=r"--cache-types: expected one of .* got 'q5_0'"):
        kv_cache.parse_types("f16,q8_0/q5_0")


def test_the_worker_fills_each_type_s_cache_and_times_decoding(tmp_path):
    point = {
        "model": str(smollm2_path()),
        "types": [("f16", "f16"), ("q8_0", "q4_0")],
        "context": 96,
        "new_tokens": 4,
        "rounds": 1,
        "threads": None,
        "quantize": "gguf",
    }
    result = kv_cache.timing_worker(point)
    # SmolLM2: 30 layers x 3 KV heads x 64 values, keys and values
    assert result["kv_bytes_per_token"] == {"f16": 30 * 3 * 2 * 128, "q8_0/q4_0": 30 * 3 * (68 + 36)}
    assert all(rate > 0 for rate in result["tokens_per_s"].values()) and result["same_tokens"]["f16"]
    payload = {
        "model": point["model"],
        "config": {**point, "threads": 2},
        "types": {
            "f16": {**row(100.0, 23040, 1.0, 1.0), "peer_tokens_per_s": 50.0, "peer_speed_ratio": 1.0},
            "q8_0/q4_0": {**row(104.0, 9360, 0.41, 1.04), "peer_tokens_per_s": 20.0, "peer_speed_ratio": 0.4},
        },
    }
    table = kv_cache.table(payload)
    assert "| q8_0/q4_0 | 9360 | 0.41x | 104.0 (90.0-104.0) | 1.04x | 20.0 | 0.40x | yes |" in table
    kv_cache.plot(payload, tmp_path / "kv.png")
    assert (tmp_path / "kv.png").stat().st_size > 0


def row(rate, size, bytes_ratio, speed_ratio) -> dict:
    return {
        "tokens_per_s": rate,
        "tokens_per_s_range": [90.0, rate],
        "kv_bytes_per_token": size,
        "kv_bytes_ratio": bytes_ratio,
        "speed_ratio": speed_ratio,
        "same_tokens": True,
    }


def test_llama_bench_s_json_is_read(tmp_path):
    binary = tmp_path / "llama-bench"
    rows = [{"n_prompt": 0, "n_gen": 64, "n_depth": 4096, "avg_ts": 42.5}]
    binary.write_text(f"#!/bin/sh\necho '{json.dumps(rows)}'\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    assert kv_cache.llama_bench(binary, "m.gguf", ("q8_0", "q4_0"), 4096, 64, 2) == 42.5
    binary.write_text("#!/bin/sh\nexit 1\n")
    assert kv_cache.llama_bench(binary, "m.gguf", ("q8_0", "q4_0"), 4096, 64, 2) is None
