"""kernels.extension: building and loading the C++ kernels survives a build that was killed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashformer.kernels import extension

pytestmark = pytest.mark.skipif(not extension.cpp_kernels(), reason="the C++ kernels do not build here")

LOAD = "from flashformer.kernels import extension; print(extension.load())"


def built_copy(tmp_path: Path) -> Path:
    """An extensions folder holding a copy of this process's up-to-date build (mtimes kept, so
    ninja has nothing to rebuild): TORCH_EXTENSIONS_DIR for a child process."""
    build = extension.build_directory()
    root = tmp_path / "extensions"
    shutil.copytree(build, root / build.name, ignore=shutil.ignore_patterns("lock", "*.flock"))
    return root


def test_a_killed_builds_lock_file_is_removed_not_waited_on(tmp_path):
    """torch's build lock is a plain file: one left by a process killed mid-build made every later
    import wait forever (a CI run hung in collection on it). Under our flock it is removed."""
    root = built_copy(tmp_path)
    stale = root / extension.NAME / "lock"
    stale.touch()
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root))
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", LOAD], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "cpp"
    assert "left by a kernel build that was killed" in done.stderr
    assert not stale.exists()


def test_two_processes_loading_at_once_both_get_the_kernels(tmp_path):
    """The flock serializes builders: two loads started together both answer "cpp"."""
    root = built_copy(tmp_path)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root))
    children = [
        subprocess.Popen([sys.executable, "-c", LOAD], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    answers = [child.communicate(timeout=240)[0].strip() for child in children]
    assert answers == ["cpp", "cpp"]
    assert [child.returncode for child in children] == [0, 0]


def test_a_build_is_announced_before_and_timed_after(tmp_path, monkeypatch, capsys):
    """A build (a new machine, new sources) says so on stderr before it starts and reports its
    seconds after; a load that finds the build up to date says nothing."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(extension, "build_directory", lambda: tmp_path)
    built = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: built.append(kwargs["name"]))
    extension._build_and_load()
    err = capsys.readouterr().err
    assert "building the C++ kernels, once for this machine" in err
    assert "built the C++ kernels in" in err and built == [extension.NAME]
    extension._build_and_load()
    assert capsys.readouterr().err == "" and len(built) == 2
