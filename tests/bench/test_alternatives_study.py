"""The alternatives study: its tiny version end to end (the same seed, the same numbers), the
decoding state it reports against the KV cache's size from the config, the crossovers against a
curve whose crossing is known, and the width matching."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from flashformer.bench import alternatives, alternatives_report, alternatives_speed
from flashformer.model.models import build
from flashformer.train import synthetic


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    for i in range(4):
        (folder / f"f{i}.py").write_text(
            "".join(f"def f{i}_{j}(x):\n    return x * {j}\n" for j in range(40))
        )
    return folder


def tiny(corpus, **changes):
    return dataclasses.replace(
        alternatives.TINY,
        data=(str(corpus),),
        seeds=(0,),
        tasks=("recall",),
        families=("transformer", "gru"),
        **changes,
    )


def test_the_same_seed_gives_the_same_numbers(corpus, tmp_path):
    study = tiny(corpus)
    first = alternatives.run(study, tmp_path / "a", log=lambda text: None)
    second = alternatives.run(study, tmp_path / "b", log=lambda text: None)
    assert alternatives.deterministic_part(first) == alternatives.deterministic_part(second)
    run = first["corpus"]["transformer"]["runs"][0]
    assert run["tokens"] == study.corpus_steps * study.batch_size * study.corpus_seq_len
    assert 0 < run["val_bits_per_byte"] < 9 and run["minutes"] > 0
    recall = first["tasks"]["recall"]["transformer"]["runs"][0]
    assert 0 <= recall["accuracy"] <= 1 and sum(recall["counts"].values()) == study.eval_examples * 8
    assert [p["n"] for p in first["decode"]["transformer"]] == list(study.decode_ns)
    assert first["decode"]["gru"][0]["state_bytes"] == first["decode"]["gru"][1]["state_bytes"]  # flat in n
    text = alternatives_report.table(first)
    assert (
        "| **transformer** | 32 / 32 |" in text
        and "| **gru** |" in text
        and "Accuracy against distance d, recall" in text
    )
    alternatives_report.plot(first, tmp_path / "study.png")
    assert (tmp_path / "study.png").stat().st_size > 0


def test_decoding_state_is_the_kv_cache_the_config_implies():
    config = alternatives.transformer_config(64, 2, 256).replace(vocab_size=synthetic.VOCAB_SIZE)
    found = alternatives_speed.decode_worker({"config": config.to_dict(), "n": 40, "new_tokens": 4})
    # keys and values: layers x 2 x (batch 1) x kv heads x (n + new) x head_dim float32
    expected = config.n_layers * 2 * config.n_heads * (40 + 4) * (64 // config.n_heads) * 4
    assert found["state_bytes"] == expected and found["decode_tokens_per_s"] > 0


def test_tensor_bytes_counts_each_storage_once_and_no_weights():
    shared = torch.zeros(10)
    state = {
        "a": shared,
        "b": [shared[:5], torch.zeros(3, dtype=torch.float64)],
        "model": torch.nn.Linear(4, 4),
    }
    assert alternatives_speed.tensor_bytes(state) == 40 + 24


def test_crossovers_find_a_known_crossing():
    ns = [512, 2048, 8192]
    points = {"a": [{"n": n, "decode_tokens_per_s": 1000.0 * 512 / n} for n in ns]}  # falls as 1/n
    payload = {"decode": points, "train_speed": {}}
    points["b"] = [
        {"n": n, "decode_tokens_per_s": 125.0 * math.sqrt(2)} for n in ns
    ]  # 1/n meets it at 2048 * sqrt 2
    (found,) = [c for c in alternatives_report.crossovers(payload) if c["metric"] == "decode tokens/s"]
    assert found["n"] == round(2048 * 2**0.5) and found["between"] == [2048, 8192] and found["after"] == "b"


def test_matched_width_is_the_nearest_parameter_count():
    family = alternatives.FAMILIES["transformer"]
    target = build(family.config(96, 2, 1024).replace(vocab_size=500)).num_parameters() + 10
    assert alternatives.matched_width(family, 500, 2, target) == (96, target - 10)


def test_unknown_family_is_refused_before_training():
    with pytest.raises(ValueError, match=r"unknown families \['mamba9'\]"):
        dataclasses.replace(alternatives.TINY, families=("mamba9",)).family_names()
