"""The tables drawn from several stored runs (docs/benchmarks.md's summaries, README.md's
headline): each cell against figures worked out by hand from a small payload."""

from __future__ import annotations

from flashformer.bench import kv_cache, serve_report, turns


def rates(best: float, median: float, worst: float) -> dict:
    return {"best": best, "median": median, "worst": worst}


def test_turns_summary_gives_ratios_and_whether_each_target_is_met():
    payload = {
        "summary": {
            "flashformer": {"decode": rates(300.0, 270.0, 200.0), "prompt": rates(900.0, 810.0, 700.0)},
            "llama.cpp": {"decode": rates(100.0, 90.0, 80.0), "prompt": rates(500.0, 450.0, 400.0)},
        }
    }
    text = turns.summary_table([("tiny.gguf", "AVX2", payload, 1.3, 2.0)])
    # decode 300 / 100 = 3.00 (medians 270 / 90 = 3.00), met; prompt 900 / 500 = 1.80 (1.80), not met;
    # our medians over our bests: 270 / 300 = 0.90, 810 / 900 = 0.90
    row = (
        "| tiny.gguf | AVX2 | 300.0 / 270.0 against 100.0 / 90.0 | **3.00** (3.00) | 1.3: met "
        "| 900 / 810 against 500 / 450 | 1.80 (1.80) | 2: not met | 0.90, 0.90 | - |"
    )
    assert row in text.splitlines()  # no process measured its peak RSS: "-"


def test_turns_memory_is_the_file_the_cache_and_the_rest():
    def process(peak):
        return {"peak_rss_bytes": peak, "file_bytes": 100_000_000, "kv_bytes": 10_000_000}

    payload = {"runs": {"flashformer": [process(400_000_000), process(420_000_000)]}}
    # peaks 400 and 420 MB; what they hold: 100 + 10 MB; the most beyond it: 420 - 110 = 310 MB
    assert turns.memory(payload) == {
        "peak_min": 400_000_000,
        "peak_max": 420_000_000,
        "file": 100_000_000,
        "kv": 10_000_000,
        "overhead_max": 310_000_000,
    }
    assert turns.memory_line(payload) == "400-420 MB: file 100 + KV 10 + 310"
    assert turns.memory({"runs": {"flashformer": [{"decode": 1.0}]}}) is None


def served(ours_name: str, ours: tuple, theirs: tuple, clients: int) -> dict:
    def run(tokens_per_s, ttft, itl_p99):
        return {
            "loaded": {
                "output_tokens_per_s": tokens_per_s,
                "ttft_p50_s": ttft,
                "itl_p99_s": itl_p99,
                "clients": clients,
            }
        }

    return {
        "servers": {
            ours_name: run(*ours),
            "flashformer (one at a time)": run(1.0, 9.0, 9.0),
            "llama-server (-np 1)": run(*theirs),
        }
    }


def test_versus_table_puts_the_batching_server_beside_llama_server():
    one = served("flashformer (max batch 1)", (120.0, 0.1, 0.011), (60.0, 0.2, 0.017), 1)
    many = served("flashformer (max batch 16)", (200.0, 0.3, 0.25), (50.0, 0.9, 1.3), 16)
    text = serve_report.versus_table([("tiny, native", one, many)])
    assert "| file, path | 1 client: tokens/s ours / theirs | ITL p99 ms | 16 clients: tokens/s |" in text
    assert (
        "| tiny, native | 120.0 / 60.0 (**2.00x**) | 11 / 17 | 200.0 / 50.0 (**4.00x**) | 300 / 900 | 250 / 1300 |"
        in text
    )


def test_kld_table_reads_each_program_s_runs_by_name():
    ours, theirs = kv_cache.KLD_COLUMNS[1][1], kv_cache.KLD_COLUMNS[0][1]
    unrotated, exact = kv_cache.KLD_COLUMNS[4][1], kv_cache.KLD_COLUMNS[5][1]
    run = lambda kld, error=0.0, top=0.0: {"mean_kld": kld, "kld_error": error, "same_top_percent": top}  # noqa: E731
    payload = {
        "types": {
            "q8_0": {
                ours: run(0.004, 0.0001, 96.5),
                theirs: run(0.005, 0.0002),
                unrotated: run(0.006),
                exact: run(0.0002),
            },
            "f16": {exact: run(0.000001)},
        }
    }
    lines = kv_cache.kld_table(payload).splitlines()
    assert (
        lines[2]
        == "| q8_0 | 0.005000 ± 0.000200 | 0.004000 ± 0.000100 | 0.80 | 96.50 % | 0.006000 | 0.000200 |"
    )
    assert lines[3] == "| f16 | - | - | - | - | - | 0.000001 |"
