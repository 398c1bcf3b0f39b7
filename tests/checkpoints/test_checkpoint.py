"""Checkpoints are whole or absent, and a damaged one is named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from flashformer.checkpoints import checkpoint as ckpt


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))


def save(run_dir, step, model, keep_last=3):
    state = {"step": step, "rng": torch.get_rng_state(), "sampler": {"epoch": 0, "position": step}}
    return ckpt.save_checkpoint(run_dir, step, model.state_dict(), state, {"config.json": "{}"}, keep_last)


def test_round_trip_and_keep_last(tmp_path):
    model = small_model()
    for step in (10, 20, 30, 40):
        save(tmp_path, step, model, keep_last=2)
    folders = ckpt.list_checkpoints(tmp_path)
    assert [f.name for f in folders] == ["step-0000030", "step-0000040"]
    ckpt.verify_checkpoint(folders[-1])
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    ckpt.load_weights(folders[-1], other)
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert torch.equal(a, b)
    state = ckpt.load_trainer_state(folders[-1])
    assert state["step"] == 40 and state["sampler"]["position"] == 40


def test_corrupt_truncated_and_mismatched_checkpoints_are_named(tmp_path):
    folder = save(tmp_path, 1, small_model())
    weights = folder / ckpt.WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match=r"model.safetensors is corrupt"):
        ckpt.verify_checkpoint(folder)
    weights.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(ckpt.CheckpointError, match=r"model.safetensors is truncated"):
        ckpt.verify_checkpoint(folder)
    with pytest.raises(ckpt.CheckpointError, match=r"model.safetensors cannot be read"):
        ckpt.load_weights(folder, small_model())
    good = save(tmp_path / "b", 1, small_model())
    wider = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 4))
    with pytest.raises(ckpt.CheckpointError, match=r"tensor '0\.(weight|bias)' has shape \(16"):
        ckpt.load_weights(good, wider)
    (good / ckpt.MANIFEST).unlink()
    with pytest.raises(ckpt.CheckpointError, match="has no manifest.json"):
        ckpt.verify_checkpoint(good)


WRITER = """
import sys, torch
from flashformer.checkpoints import checkpoint as ckpt
weights = {f"w{i}": torch.randn(1024, 1024) for i in range(24)}  # ~100 MB per checkpoint
step = 0
while True:
    step += 1
    ckpt.save_checkpoint(sys.argv[1], step, weights, {"step": step}, {"config.json": "{}"}, keep_last=2)
    print(step, flush=True)
"""


def test_kill_during_a_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout.readline().strip() == "1"  # one checkpoint is complete
        time.sleep(0.3)  # now well inside a later write
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.wait()
    folders = ckpt.list_checkpoints(tmp_path)
    assert folders, "no complete checkpoint survived"
    for folder in folders:
        ckpt.verify_checkpoint(folder)
        assert ckpt.load_trainer_state(folder)["step"] == int(folder.name[5:])
    save(tmp_path, 10_000, small_model())  # the next writer clears what the killed one left
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_an_interrupted_deletion_of_an_old_checkpoint_leaves_no_listed_half(tmp_path, monkeypatch):
    model = small_model()
    save(tmp_path, 1, model, keep_last=1)

    def interrupted_rmtree(path, *args, **kwargs):
        first = sorted(p for p in path.iterdir() if p.is_file())[0]
        first.unlink()  # one file gone, then the process is stopped
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.shutil, "rmtree", interrupted_rmtree)
    from flashformer import files

    monkeypatch.setattr(files.shutil, "rmtree", interrupted_rmtree)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 2, model, keep_last=1)
    monkeypatch.undo()
    for folder in ckpt.list_checkpoints(tmp_path):
        ckpt.verify_checkpoint(folder)
    assert [f.name for f in ckpt.list_checkpoints(tmp_path)] == ["step-0000002"]
    save(tmp_path, 3, model, keep_last=1)  # the leftover is cleared by the next writer
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".old-"))]
