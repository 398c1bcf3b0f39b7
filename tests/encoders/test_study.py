"""The encoder study's parts that run in seconds: the pretraining corpus leaves out every file a
task evaluates on, the linear probe fits what a logistic regression can, the baselines are what
they say, the table and the figure come from a payload, and scripts/encoder_study.py merges a
partial rerun into the stored JSON. (The study itself: python scripts/encoder_study.py.)"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers import study_payload

from flashformer.encoders import study
from flashformer.encoders.datasets import PairExample, TaggedExample, TaskData, TextExample
from flashformer.train import corpus

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("encoder_study", ROOT / "scripts" / "encoder_study.py")
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)


def test_the_pretraining_corpus_leaves_out_every_evaluated_file(tmp_path):
    task = TaskData(
        "t",
        "classification",
        train=[TextExample("x", "a", "email/message.py:10")],
        validation=[TextExample("y", "a", "json/decoder.py:3")],
        test=[TextExample("z", "a", "asyncio/tasks.py:7"), TextExample("w", "a", "asyncio/tasks.py:70")],
        labels=["a"],
    )
    tagging = TaskData(
        "g",
        "tagging",
        [],
        [],
        [TaggedExample(["x"], ["NAME"], "ast.py:1")],
        labels=["NAME"],
        tag_scheme="plain",
    )
    held = study.held_out_files({"classification": task, "tagging": tagging})
    assert held == {"json/decoder.py", "asyncio/tasks.py", "ast.py"}
    linked, excluded = study.pretraining_corpus(tmp_path / "corpus", held)
    names = {doc.name for doc in corpus.resolve_corpus([str(tmp_path / "corpus")])}
    assert "email/message.py" in names and not names & held
    assert linked == len(names) == len(corpus.stdlib_corpus()) - 3 and excluded == 3
    study.pretraining_corpus(tmp_path / "corpus", held)  # again: the links are reused


def test_linear_probe_separates_what_a_linear_model_can():
    generator = torch.Generator().manual_seed(0)
    centers = torch.randn(3, 8, generator=generator) * 4
    labels = torch.randint(0, 3, (300,), generator=generator)
    points = centers[labels] + torch.randn(300, 8, generator=generator)
    predicted = study.linear_probe(points[:200], labels[:200], points[200:], 3)
    assert (predicted == labels[200:]).float().mean() > 0.95


def test_baselines_are_what_a_model_that_learned_nothing_scores():
    task = TaskData(
        "c",
        "classification",
        train=[TextExample("a", "x"), TextExample("b", "x"), TextExample("c", "y")],
        validation=[],
        test=[TextExample("d", "x"), TextExample("e", "y"), TextExample("f", "y"), TextExample("g", "y")],
        labels=["x", "y"],
    )
    assert study.baseline("classification", task)["accuracy"] == 0.25
    tags = TaskData(
        "t",
        "tagging",
        train=[TaggedExample(["a", "b", "c"], ["NAME", "NAME", "OP"])],
        validation=[],
        test=[TaggedExample(["d", "e"], ["NAME", "OP"])],
        labels=["NAME", "OP"],
        tag_scheme="plain",
    )
    assert study.baseline("tagging", tags)["entity_f1"] == 0.5
    pairs = TaskData("r", "retrieval", [], [], [PairExample(f"q{i}", f"d{i}") for i in range(20)])
    chance = study.baseline("retrieval", pairs)
    # a random ranking of 20: the document's rank is uniform over 1..20
    assert (
        chance["mrr@10"] == pytest.approx(sum(1 / r for r in range(1, 11)) / 20)
        and chance["recall@10"] == 0.5
    )


def test_table_and_figure_come_from_the_payload(tmp_path):
    text = study.table(study_payload())
    assert (
        "| classification | accuracy | 0.110 | 0.500 (1.0 min) | 0.800 (4.0 min) | 0.700 (2.0 min) | 0.400 (2.0 min) |"
        in text
    )
    assert "| classification | macro_f1 | 0.020 | 0.400 | 0.700 | 0.600 | 0.300 |" in text
    assert "(c) - (d), means over 2 seeds: classification accuracy +0.300." in text
    assert "15.0 min, 4000 steps" in text
    study.plot(study_payload(), tmp_path / "study.png")
    assert (tmp_path / "study.png").stat().st_size > 0


def test_runs_with_several_seeds_show_their_range():
    with_seeds = study_payload()
    run = with_seeds["tasks"]["classification"]["runs"]["c"]
    run["seeds"] = [{"accuracy": 0.65, "macro_f1": 0.5}, {"accuracy": 0.75, "macro_f1": 0.7}]
    assert "| 0.700 (0.650-0.750) |" in study.table(with_seeds)


def test_a_partial_rerun_keeps_the_other_runs():
    old = study_payload(("a", "b", "c", "d"))
    new = study_payload(("b",))
    new["tasks"]["classification"]["runs"]["b"]["metrics"]["accuracy"] = 0.9
    merged = script.merge(old, new)
    runs = merged["tasks"]["classification"]["runs"]
    assert sorted(runs) == ["a", "b", "c", "d"] and runs["b"]["metrics"]["accuracy"] == 0.9
