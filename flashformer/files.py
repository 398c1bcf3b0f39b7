"""Files and folders that are either whole or absent.

Everything flashformer writes that a later run trusts (checkpoints, token
files, tokenizers, metrics, benchmark results, exported models) is written
beside its final place, flushed to disk, then renamed into place: a crash, a
kill -9 or Ctrl-C at any moment leaves the old file (or none), never half of
a new one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_writer(path: str | Path, mode: str = "w") -> Iterator:
    """Open a temporary file beside `path` for writing; when the block ends
    without an error it is fsynced and renamed to `path`, otherwise deleted."""
    with atomic_path(path) as tmp:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` for a writer that opens the file itself
    (gguf.GGUFWriter); when the block ends without an error the file is
    fsynced and renamed to `path`, otherwise deleted."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_atomic(path: str | Path, content: str | bytes) -> Path:
    """Write text or bytes to `path` whole or not at all."""
    with atomic_writer(path, "wb" if isinstance(content, bytes) else "w") as f:
        f.write(content)
    return Path(path)


def write_json(path: str | Path, payload, indent: int | None = 2) -> Path:
    return write_atomic(path, json.dumps(payload, indent=indent))


def publish_folder(tmp: Path, final: Path) -> None:
    """Make the complete folder `tmp` appear as `final` at once: every file and
    the folder fsynced, then renamed into place (an existing `final` is moved
    aside first and deleted after), then the parent fsynced."""
    for path in tmp.iterdir():
        if path.is_file():
            fsync_file(path)
    fsync_dir(tmp)
    if final.exists():
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


def remove_folder(folder: Path) -> None:
    """Delete a folder so that it is whole or absent at every moment: renamed
    out of sight first (one atomic step), then deleted file by file. A kill
    during the deletion leaves a hidden `.old-*` folder, never a listed one
    with files missing."""
    folder = Path(folder)
    old = folder.parent / f".old-{folder.name}-{os.getpid()}"
    os.replace(folder, old)
    fsync_dir(folder.parent)
    shutil.rmtree(old)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
