"""A cheap start (flashformer/startup.py): the package's re-exports imported at their first read,
and the garbage collector paused while start-up allocates. What a fresh interpreter has imported
is read from its sys.modules; nothing here is timed (the figures: docs/benchmarks.md, "Cold
start")."""

from __future__ import annotations

import ast
import gc
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import flashformer
from flashformer.startup import paused_gc

ROOT = Path(__file__).resolve().parent.parent


def modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running `code`."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def test_import_flashformer_imports_no_torch_and_no_room():
    loaded = modules_after("import flashformer; assert flashformer.__version__")
    assert "torch" not in loaded
    assert {m for m in loaded if m.startswith("flashformer.")} == {"flashformer.startup"}


def test_every_export_is_its_modules_object():
    for name in flashformer.__all__:
        module = importlib.import_module(flashformer._exports[name])
        assert getattr(flashformer, name) is getattr(module, name), name
    assert set(dir(flashformer)) >= set(flashformer.__all__)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        flashformer.no_such_name  # noqa: B018


def test_the_lazy_table_names_what_the_type_checking_imports_name():
    """The table the package reads at run time and the imports type checkers and the room order's
    test read (tests/test_layout.py) are two lists of the same names from the same modules."""
    imported = {}
    for node in ast.walk(ast.parse((ROOT / "flashformer" / "__init__.py").read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module != "flashformer.startup"
            and node.module != "typing"
        ):
            imported |= {alias.name: node.module for alias in node.names}
    assert imported == flashformer._exports
    assert set(imported) == set(flashformer.__all__)


def test_attention_stays_the_function_when_its_room_is_imported_first():
    # importing the subpackage flashformer.attention binds it on the package; the name is the function's
    code = (
        "import flashformer, flashformer.attention.paged\n"
        "from flashformer.attention.api import attention\n"
        "assert flashformer.attention is attention, flashformer.attention\n"
        "from flashformer import attention as again\n"
        "assert again is attention"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_a_room_re_export_and_its_submodules_import_as_before():
    code = (
        "import flashformer.encoders as room\n"
        "from flashformer.encoders import metrics, read_task\n"
        "from flashformer.encoders.datasets import read_task as defined\n"
        "assert read_task is defined and room.read_task is defined\n"
        "assert metrics.__name__ == 'flashformer.encoders.metrics'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_paused_gc_pauses_and_restores_the_collector():
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():  # nested: the inner one leaves the outer's pause alone
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), paused_gc():
        raise KeyError("an error inside")
    assert gc.isenabled()


def test_paused_gc_leaves_a_collector_the_caller_paused_paused():
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_paused_gc_freeze_moves_what_lives_out_of_the_collectors_view():
    code = (
        "import gc\n"
        "from flashformer.startup import paused_gc\n"
        "kept = []\n"
        "with paused_gc(freeze=True):\n"
        "    kept += [[i] for i in range(1000)]\n"
        "assert gc.isenabled() and gc.get_freeze_count() >= 1000, gc.get_freeze_count()"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
