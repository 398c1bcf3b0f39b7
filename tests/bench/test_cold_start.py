"""bench/cold_start.py without llama.cpp: a fresh process's seconds and peak RSS (checked against
what the child allocates), a failing one reported, llama-simple refused before any work when
missing, and the turns' summary and the targets it feeds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from flashformer.bench import cold_start, generate_model


def test_a_fresh_process_is_timed_with_its_peak_rss():
    held = 200 * 2**20
    found = cold_start.timed(
        [sys.executable, "-c", f"b = bytearray({held}); import time; time.sleep(0.2)"], 60
    )
    assert found["seconds"] >= 0.2
    assert held < found["max_rss"] < held + 60 * 2**20  # the bytes it touched, and the interpreter


def test_a_program_may_keep_its_compiled_modules(monkeypatch):
    """What an installed package has: the timed program runs without PYTHONDONTWRITEBYTECODE."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    check = "import sys; sys.exit(3 if sys.dont_write_bytecode else 0)"
    assert "seconds" in cold_start.timed([sys.executable, "-c", check], 60)


def test_a_failing_or_hanging_process_is_an_error_not_a_time():
    found = cold_start.timed(
        [sys.executable, "-c", "import sys; print('no model', file=sys.stderr); sys.exit(3)"], 60
    )
    assert found == {"error": "exit code 3: no model"}
    assert cold_start.timed([sys.executable, "-c", "import time; time.sleep(30)"], 0.3) == {
        "error": "timed out after 0 s"
    }


def test_llama_simple_is_refused_when_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="--llama-cpp-dir"):
        cold_start.commands("m.gguf", str(tmp_path))


def test_turns_alternate_and_the_targets_read_their_summary(tmp_path, monkeypatch):
    simple = tmp_path / "bin" / "llama-simple"
    simple.parent.mkdir()
    simple.write_text("#!/bin/sh\nexit 0\n")
    simple.chmod(0o755)
    order = []

    def fake(command, timeout_s):
        name = "llama.cpp" if command[0] == str(simple) else "flashformer"
        order.append(name)
        return {"seconds": {"flashformer": 3.0, "llama.cpp": 1.5}[name] + len(order) / 100, "max_rss": 10**9}

    monkeypatch.setattr(cold_start, "timed", fake)
    found = cold_start.run("m.gguf", str(tmp_path), 2)
    assert order == ["flashformer", "llama.cpp", "llama.cpp", "flashformer"]
    assert found["summary"]["flashformer"]["best"] == pytest.approx(3.01)
    assert found["summary"]["llama.cpp"]["best"] == pytest.approx(1.52)
    point = {"cold_starts": found, "memory": {"file_bytes": 10**9, "rss_before_load": 3 * 10**8,
             "status": {"after_first_token": {"VmRSS": 14 * 10**8}}},
             "decode_tokens_per_s": {"flashformer": 4.4}, "achieved_gb_s": {"flashformer": 20.0},
             "bandwidth_gb_s": 25.0, "llama_bench": {"build-native": {"tg128": {"tokens_per_s": 4.0}}}}  # fmt: skip
    targets = generate_model.targets(point)
    assert targets["load to first token, ours / llama.cpp's (best)"] == (
        pytest.approx(3.01 / 1.52),
        1.5,
        True,
    )
    assert targets["RSS the model holds after its first token / the file"] == (pytest.approx(1.1), 1.1, True)
    assert targets["decode / tg128 of build-native"] == (pytest.approx(1.1), 1.1, False)
    assert targets["decode GB/s / the bandwidth measured"] == (pytest.approx(0.8), 0.75, False)
    assert generate_model.targets({k: v for k, v in point.items() if k != "cold_starts"}) == {}
    assert Path(found["commands"]["llama.cpp"].split()[0]) == simple.resolve()
