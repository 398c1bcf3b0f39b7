"""Each alternative to the Transformer trains with `flashformer train`'s trainer, objective and
checkpoints, loads back from its run folder and generates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flashformer.checkpoints.loading import load
from flashformer.model.presets import preset
from flashformer.train.config import TrainConfig
from flashformer.train.trainer import Trainer

ALTERNATIVES = {
    "lstm": lambda: preset("lstm-tiny", d_model=32),
    "gru": lambda: preset("gru-tiny", d_model=32),
    "ssm": lambda: preset("mamba-tiny", d_model=32, ssm_state=4),
    "linear": lambda: preset("gpt2-tiny", d_model=32, n_heads=2, d_ff=64, attention_kind="linear"),
    "sparse": lambda: preset(
        "gpt2-tiny",
        d_model=32,
        n_heads=2,
        d_ff=64,
        layer_types=("sliding_attention",) * 2,
        sliding_window=8,
        global_tokens=2,
    ),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    for i in range(12):
        (folder / f"file{i}.py").write_text("def add(a, b):\n    return a + b\n" * (3 + i % 5) + f"# {i}\n")
    return folder


@pytest.mark.parametrize("name", sorted(ALTERNATIVES))
def test_each_alternative_trains_loads_and_generates(corpus, tmp_path, name):
    config = TrainConfig(
        data=[str(corpus)],
        tokenizer="byte",
        seq_len=16,
        batch_size=4,
        max_steps=4,
        lr=1e-2,
        warmup_steps=1,
        eval_every=2,
        eval_batches=1,
        log_every=2,
        save_every=4,
        sample_tokens=8,
        val_fraction=0.1,
    )
    summary = Trainer(ALTERNATIVES[name](), config, tmp_path, show_progress=False).fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 2 and val[-1] < val[0], val
    assert "val_bits_per_byte" in summary and summary["sample"]  # scored and sampled as a decoder
    model, tokenizer = load(Path(summary["checkpoint"]))
    expected = ALTERNATIVES[name]()
    for field in ("arch", "attention_kind", "layer_types", "global_tokens", "ssm_state"):
        assert getattr(model.config, field) == getattr(expected, field), field
    prompt = torch.tensor([tokenizer.encode("def ")])
    ids = model.generate(prompt, max_new_tokens=6)
    assert ids.shape == (1, prompt.shape[1] + 6)
