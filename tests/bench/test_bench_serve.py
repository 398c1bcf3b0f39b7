"""bench serve's workloads and ratios without a server: the system prompt and the chats have
the tokens asked for, and the targets are the ratios of hand-made results."""

from __future__ import annotations

import argparse

import pytest

from flashformer.bench import serve, serve_library, serve_load, serve_report


@pytest.fixture(scope="module")
def tokenizer():
    from flashformer.checkpoints.gguf.packaged_models import smollm2_path
    from flashformer.checkpoints.gguf.tokenizer import read_tokenizer

    return read_tokenizer(smollm2_path())


def arguments(**given) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(["model.gguf", *(f"--{k.replace('_', '-')}={v}" for k, v in given.items())])


def test_the_shared_prompt_and_the_chats_have_their_tokens(tokenizer):
    args = arguments(requests=5, system_tokens=512, chats=2, turns=3, history_tokens=300)
    jobs = serve_load.shared_prefix_jobs(tokenizer, args)
    systems = {messages[0]["content"] for messages, _ in jobs}
    assert len(jobs) == 5 and len(systems) == 1
    assert (
        512 <= len(tokenizer.encode(systems.pop())) <= 540
    )  # the words that make 512 tokens, and a preamble
    chats = serve_load.chats(tokenizer, args)
    assert [len(c) for c in chats] == [3, 3] and chats[0][0] != chats[1][0]
    assert all(len(tokenizer.encode(c[0])) >= 300 for c in chats)
    assert all(len(message.split()) <= 26 for c in chats for message in c[1:])  # short follow-ups


def test_the_targets_are_the_ratios_of_cache_on_and_off():
    def result(ttft, rate):
        return {"ttft_p50_s": ttft, "output_tokens_per_s": rate}

    results = {
        "flashformer (max batch 16)": {
            "shared_prefix": result(0.5, 30.0),
            "multi_turn": {"alone": {"ttft_p50_by_turn_s": [2.0, 0.2, 0.3]}},
        },
        "flashformer (max batch 16, no prefix cache)": {"shared_prefix": result(2.0, 20.0)},
    }
    found = serve.targets(results, 16)
    assert found == {
        "shared prefix: TTFT p50, cache on / off (<= 0.5)": 0.25,
        "shared prefix: output tokens/s, cache on / off (>= 1.25)": 1.5,
        "multi-turn, one chat: turn 2's TTFT / turn 1's (<= 0.15)": pytest.approx(0.1),
    }


def test_unknown_workloads_are_refused_by_name():
    assert serve_load.names("mixed,multi-turn") == ["mixed", "multi-turn"]
    with pytest.raises(ValueError, match="--workloads takes some of mixed, shared-prefix, multi-turn"):
        serve_load.names("mixed,chat")


def test_a_base_models_prompt_is_the_question_or_the_messages_in_order(tokenizer):
    assert serve_load.as_prompt("Summarize: a b c") == "Summarize: a b c"
    args = arguments(requests=2, system_tokens=64)
    messages, _ = serve_load.shared_prefix_jobs(tokenizer, args)[0]
    prompt = serve_load.as_prompt(messages)
    assert prompt == messages[0]["content"] + "\n\n" + messages[1]["content"]
    assert prompt.startswith("You answer questions about this text. ")


def test_the_decode_rate_leaves_each_answers_first_token_out():
    # two answers: 5 tokens from t=1 to t=2 (4 after the first in 1 s), 3 from t=10 to t=10.5
    found = serve_load.summary(2, 1, 0, 8, 12.0, [1.0, 0.5], [0.25] * 6, [(5, 1.0, 2.0), (3, 10.0, 10.5)])
    assert found["decode_tokens_per_s"] == pytest.approx(6 / 1.5)
    assert found["output_tokens_per_s"] == pytest.approx(8 / 12.0)
    assert serve_load.summary(1, 1, 0, 1, 1.0, [0.5], [], [(1, 0.5, 0.5)])["decode_tokens_per_s"] is None


def test_one_clients_decode_is_read_against_the_librarys():
    def alone(decode, output):
        return {"decode_tokens_per_s": decode, "output_tokens_per_s": output, "ttft_p50_s": 0.1,
                "itl_p50_s": 0.005, "itl_p99_s": 0.01}  # fmt: skip

    results = {
        "flashformer (max batch 16)": {"alone": alone(170.0, 120.0), "loaded": alone(300.0, 290.0)},
        serve_library.LIBRARY: {"alone": alone(190.0, 150.0), "decode_tokens_per_s": 200.0},
    }
    found = serve.targets(results, 16)
    assert found["1 client: decode tokens/s / the library's batch-1 decode (>= 0.85)"] == pytest.approx(0.85)
    assert found["1 client: decode tokens/s / the library's on the same questions"] == pytest.approx(
        170 / 190
    )
    assert found["1 client: output tokens/s / the library's on the same questions"] == pytest.approx(0.8)
    lines = serve_report.decode_lines({"servers": results})
    assert "decode 190.0 tokens/s; its batch-1 decode as bench generate measures it: 200.0 tokens/s" in lines
    assert "flashformer (max batch 16) 170.0" in lines
    assert (
        serve_report.decode_lines({"servers": {"flashformer (max batch 16)": {"alone": {}, "loaded": {}}}})
        == ""
    )
