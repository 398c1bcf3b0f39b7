"""`bench serve --long-context` (bench/long_context.py): a real run through fresh servers on a tiny
Gemma 3 file (two sliding-window layers in three), whose window group keeps the KV bytes per token
below every-layer-every-key; the types' bytes in ggml's ratio; llama-server's KV lines read; the
table and figure."""

from __future__ import annotations

import argparse

import pytest
from helpers.gguf import new_decoder_metadata, new_decoder_tensors, tiny_new_decoder, write_gguf

from flashformer.bench import long_context


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    model = tiny_new_decoder("gemma3")
    path = tmp_path_factory.mktemp("long-context") / "tiny-gemma3.gguf"
    return write_gguf(
        path, "gemma3", new_decoder_metadata(model, "gemma3"), new_decoder_tensors(model, "gemma3")
    )


def test_a_long_prompt_per_type_through_fresh_servers(tiny_gemma3, tmp_path):
    args = argparse.Namespace(
        long_context=200,
        max_tokens=8,
        cache_types="f16,q8_0",
        threads=1,
        quantize=None,
        llama_server=None,
        timeout=300,
        out=tmp_path,
    )
    payload = long_context.run(str(tiny_gemma3), args)
    f16, q8 = payload["types"]["f16"]["flashformer"], payload["types"]["q8_0"]["flashformer"]
    assert payload["config"]["prompt_tokens"] == 200
    for found in (f16, q8):
        assert found["window_blocks"] > 0  # the sliding layers had a pool of their own
        assert 0 < found["kv_bytes_peak"] < found["kv_bytes_if_every_key_kept"]
        assert found["ttft_s"] > 0 and found["decode_tokens_per_s"] > 0 and found["rss_peak"] > 0
        assert found["completion_tokens"] == 8  # eos ignored: every token asked for
    # a q8_0 row of 32 values is 34 bytes, an f16 one 64: the same blocks held, in that ratio
    assert q8["kv_bytes_peak"] / f16["kv_bytes_peak"] == pytest.approx(34 / 64)
    assert "| f16 |" in long_context.table(payload)
    long_context.plot(payload, tmp_path / "long-context.png")
    assert (tmp_path / "long-context.png").stat().st_size > 0


def test_llama_server_kv_lines_are_summed():
    log = (
        "llama_kv_cache:        CPU KV buffer size =    96.00 MiB\n"
        "llama_kv_cache: size =   96.00 MiB ( 32768 cells,   3 layers,  1/1 seqs), K (f16):   48.00 MiB\n"
        "llama_kv_cache: size =   15.00 MiB (  1024 cells,  15 layers,  1/1 seqs), K (f16):    7.50 MiB\n"
    )
    assert [float(m) for m in long_context.LLAMA_KV_SIZE.findall(log)] == [96.0, 15.0]
