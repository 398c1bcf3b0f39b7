"""Checkpoint folders that are either whole or absent.

A checkpoint is a folder `step-0000100/` holding the model's weights
(safetensors), the trainer's state (optimizer, scheduler, RNG, data position;
a torch file readable with weights_only=True), config.json, the tokenizer,
and a manifest with the size and SHA-256 of every file. It is written into a
temporary folder, every file and the folder fsynced, then renamed into place:
a crash, a kill -9 or Ctrl-C at any moment leaves either the complete new
checkpoint or none, never a half-written one, and earlier checkpoints are
untouched. Loading checks the manifest first and names the file at fault.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from flashformer.files import publish_folder, remove_folder

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
TRAINER_STATE = "trainer_state.pt"
PREFIX = "step-"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, truncated or does not fit."""


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:07d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temporary folders excluded)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [
        p for p in run_dir.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[5:].isdigit()
    ]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def save_checkpoint(
    run_dir: Path,
    step: int,
    weights: dict[str, torch.Tensor],
    trainer_state: dict,
    extra_files: dict[str, str],
    keep_last: int = 3,
) -> Path:
    """Write a checkpoint atomically; keep only the newest `keep_last`."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / checkpoint_name(step)
    for pattern in (".tmp-*", ".old-*"):  # from a writer that was killed
        for leftover in run_dir.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)
    tmp = run_dir / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp / WEIGHTS))
    torch.save(trainer_state, tmp / TRAINER_STATE)
    for name, text in extra_files.items():
        (tmp / name).write_text(text)
    manifest = {name: _describe(tmp / name) for name in sorted(os.listdir(tmp))}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": manifest}, indent=1))
    publish_folder(tmp, final)  # the same step saved again (e.g. after a resume) is replaced whole
    for stale in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        remove_folder(stale)  # hidden first: a kill mid-deletion leaves no listed half-folder
    return final


def verify_checkpoint(folder: Path) -> dict:
    """Check every file against the manifest; returns the manifest."""
    folder = Path(folder)
    manifest_path = folder / MANIFEST
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} does not exist")
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {folder} has no {MANIFEST}: it is incomplete or not a checkpoint")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{manifest_path} is corrupt: {error}") from None
    for name, expected in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        actual = _describe(path)
        if actual["bytes"] != expected["bytes"]:
            raise CheckpointError(
                f"checkpoint file {path} is truncated or altered: {actual['bytes']} bytes, "
                f"the manifest says {expected['bytes']}"
            )
        if actual["sha256"] != expected["sha256"]:
            raise CheckpointError(
                f"checkpoint file {path} is corrupt: its SHA-256 differs from the manifest's"
            )
    return manifest


def load_weights(folder: Path, model: torch.nn.Module, names: set[str] | None = None) -> None:
    """Load model.safetensors into `model`, naming any tensor that does not fit. names: the
    tensors the checkpoint holds when not all of the model's (a LoRA run's: its adapter's)."""
    path = Path(folder) / WEIGHTS
    try:
        weights = load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {error}") from None
    expected = {k: v for k, v in model.state_dict().items() if names is None or k in names}
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint file {path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, tensor in weights.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"checkpoint file {path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(expected[name].shape)}"
            )
    model.load_state_dict(weights, strict=names is None)


def load_trainer_state(folder: Path) -> dict:
    path = Path(folder) / TRAINER_STATE
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a corrupt pickle can raise almost anything
        raise CheckpointError(f"checkpoint file {path} cannot be read: {error}") from None


def _describe(path: Path) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}
