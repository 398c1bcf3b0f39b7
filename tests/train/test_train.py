"""The trainer: it learns, it resumes exactly, it survives Ctrl-C, and two
processes under torchrun equal one process with the same global batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flashformer.checkpoints import checkpoint as ckpt
from flashformer.checkpoints.loading import export_hf
from flashformer.model.presets import preset
from flashformer.train.config import TrainConfig
from flashformer.train.trainer import Trainer, learning_rate

SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n",
    "import os\nprint(os.path.join('a', 'b'))\n",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        (folder / f"file{i}.py").write_text(SNIPPETS[i % 4] * (3 + i % 5) + f"# file {i}\n")
    return folder


def tiny_config(corpus, **changes) -> TrainConfig:
    values = dict(
        data=[str(corpus)],
        tokenizer="byte",
        seq_len=32,
        batch_size=8,
        max_steps=12,
        lr=3e-3,
        warmup_steps=2,
        eval_every=6,
        eval_batches=2,
        log_every=2,
        save_every=6,
        sample_tokens=20,
        val_fraction=0.1,
    )
    values.update(changes)
    return TrainConfig(**values)


def tiny_model(**changes):
    return preset(
        "gpt2-tiny", **dict(dict(n_layers=2, d_model=32, n_heads=2, d_ff=64, max_seq_len=64), **changes)
    )


def weights_of(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(folder) / ckpt.WEIGHTS))


def test_learning_rate_warms_up_then_decays_to_min():
    config = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert learning_rate(0, config) == pytest.approx(0.1)
    assert learning_rate(9, config) == pytest.approx(1.0)
    assert learning_rate(60, config) == pytest.approx(0.55)
    assert learning_rate(110, config) == pytest.approx(0.1)


def test_a_short_run_learns_and_leaves_its_files(corpus, tmp_path):
    summary = Trainer(
        tiny_model(), tiny_config(corpus, max_steps=60, eval_every=20, lr=1e-2), tmp_path, show_progress=False
    ).fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 3 and val[-1] < val[0] - 0.5, val
    assert summary["val_bits_per_byte"] < summary["unigram_bits_per_byte"]
    assert (tmp_path / "loss.png").stat().st_size > 0
    folder = Path(summary["checkpoint"])
    ckpt.verify_checkpoint(folder)
    assert json.loads((folder / "config.json").read_text())["model"]["vocab_size"] == 256 + 103


def test_resume_reaches_the_same_weights_bitwise(corpus, tmp_path):
    # dropout on, so the restored RNG streams matter as much as the data position
    model = tiny_model(dropout=0.1, attention_dropout=0.1)
    straight = Trainer(
        model, tiny_config(corpus, deterministic=True), tmp_path / "a", show_progress=False
    ).fit()
    first = Trainer(model, tiny_config(corpus, deterministic=True), tmp_path / "b", show_progress=False)
    first.fit(until_step=7)  # stop early, as an interrupted run would...
    resumed = Trainer(
        model, tiny_config(corpus, deterministic=True), tmp_path / "b", resume=True, show_progress=False
    )
    assert resumed.step == 7
    end = resumed.fit()  # ...and finish from its checkpoint
    a, b = weights_of(straight["checkpoint"]), weights_of(end["checkpoint"])
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_resume_refuses_a_damaged_or_different_checkpoint(corpus, tmp_path):
    Trainer(tiny_model(), tiny_config(corpus, max_steps=6), tmp_path, show_progress=False).fit()
    with pytest.raises(ckpt.CheckpointError, match=r"n_layers 2 != 3"):
        Trainer(tiny_model(n_layers=3), tiny_config(corpus), tmp_path, resume=True, show_progress=False)
    weights = ckpt.list_checkpoints(tmp_path)[-1] / ckpt.WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ckpt.CheckpointError, match=r"model.safetensors is truncated"):
        Trainer(tiny_model(), tiny_config(corpus), tmp_path, resume=True, show_progress=False)


def test_a_fresh_run_in_a_used_folder_moves_the_earlier_run_aside(corpus, tmp_path):
    Trainer(tiny_model(), tiny_config(corpus, max_steps=6), tmp_path, show_progress=False).fit()
    earlier = weights_of(ckpt.list_checkpoints(tmp_path)[-1])
    summary = Trainer(
        tiny_model(), tiny_config(corpus, max_steps=4, save_every=2), tmp_path, show_progress=False
    ).fit()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step-0000002", "step-0000004"]
    assert Path(summary["checkpoint"]).name == "step-0000004"
    kept = ckpt.list_checkpoints(tmp_path / "previous-1")
    assert kept[-1].name == "step-0000006" and (tmp_path / "previous-1" / "metrics.jsonl").is_file()
    assert all(torch.equal(earlier[k], v) for k, v in weights_of(kept[-1]).items())
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 4


def test_a_trained_model_exports_to_transformers(corpus, tmp_path):
    import transformers

    import flashformer

    summary = Trainer(tiny_model(), tiny_config(corpus, max_steps=4), tmp_path, show_progress=False).fit()
    folder = export_hf(tmp_path, tmp_path / "hf")
    ours, tokenizer = flashformer.load(folder)
    theirs = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    trained, _ = flashformer.load(summary["checkpoint"])
    ids = torch.tensor([tokenizer.encode("def add(a, b):\n    return a + b\n")])
    with torch.no_grad():
        expected = trained(ids).logits
        torch.testing.assert_close(ours(ids).logits, expected, rtol=0, atol=0)
        torch.testing.assert_close(theirs(ids).logits, expected, rtol=1e-5, atol=1e-5)
    export_hf(tmp_path, tmp_path / "hf")  # exporting again replaces the folder whole
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert not list(tmp_path.glob(".tmp-*")) and not list(tmp_path.glob(".old-*"))


@pytest.mark.parametrize("name", ["bert-tiny", "t5-tiny"])
def test_encoder_and_encoder_decoder_objectives_train(corpus, tmp_path, name):
    model = preset(
        name,
        n_layers=1,
        d_model=32,
        n_heads=2,
        d_ff=64,
        max_seq_len=64,
        **({"head_dim": 16} if name == "t5-tiny" else {}),
    )
    summary = Trainer(
        model, tiny_config(corpus, max_steps=4, eval_every=2), tmp_path, show_progress=False
    ).fit()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert all(torch.isfinite(torch.tensor(val))) and val[-1] < val[0]
    assert summary["checkpoint"]


def run_cli(args, **kwargs):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "flashformer.cli", *args], env=env, capture_output=True, text=True, **kwargs
    )


COMMON = [
    "--preset",
    "gpt2-tiny",
    "--no-progress",
    "--train.tokenizer",
    "byte",
    "--train.seq_len",
    "32",
    "--train.eval_every",
    "4",
    "--train.eval_batches",
    "1",
    "--train.save_every",
    "4",
    "--train.lr",
    "3e-3",
    "--model.n_layers",
    "2",
    "--model.d_model",
    "32",
    "--model.n_heads",
    "2",
    "--model.d_ff",
    "64",
    "--model.dropout",
    "0",
    "--model.attention_dropout",
    "0",
    "--train.val_fraction",
    "0.1",
]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_equal_one_with_the_same_global_batch(corpus, tmp_path, strategy):
    single = run_cli(
        [
            "train",
            *COMMON,
            "--data",
            str(corpus),
            "--out",
            str(tmp_path / "one"),
            "--max-steps",
            "4",
            "--train.batch_size",
            "8",
        ]
    )
    assert single.returncode == 0, single.stderr[-2000:]
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "flashformer.cli",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    double = subprocess.run(
        [
            *torchrun,
            "train",
            *COMMON,
            "--data",
            str(corpus),
            "--out",
            str(tmp_path / "two"),
            "--max-steps",
            "4",
            "--train.batch_size",
            "4",
            "--train.distributed",
            strategy,
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert double.returncode == 0, double.stderr[-3000:]
    one = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    two = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in one] == [r["step"] for r in two]
    for a, b in zip(one, two):
        for key in ("loss", "val_loss"):
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-5, (key, a, b)
    a = weights_of(ckpt.list_checkpoints(tmp_path / "one")[-1])
    b = weights_of(ckpt.list_checkpoints(tmp_path / "two")[-1])
    for name in a:
        assert (a[name] - b[name]).abs().max() <= 1e-5, name


def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(corpus, tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flashformer.cli",
            "train",
            *COMMON,
            "--data",
            str(corpus),
            "--out",
            str(tmp_path),
            "--max-steps",
            "100000",
            "--train.save_every",
            "100000",
            "--train.eval_every",
            "100000",
            "--train.log_every",
            "1",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (tmp_path / "metrics.jsonl").exists():
        time.sleep(0.2)
    time.sleep(1.0)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err[-2000:]
    folders = ckpt.list_checkpoints(tmp_path)
    assert len(folders) == 1 and "checkpoint:" in out
    ckpt.verify_checkpoint(folders[0])
    assert ckpt.load_trainer_state(folders[0])["step"] > 0
