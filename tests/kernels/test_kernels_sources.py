"""kernels.extension's lists of the C++ sources: every file of csrc/ is in one (a header missing
from INCLUDES would not rebuild the kernels when it changes), and only one translation unit, the
operators' glue with the decoder's class, includes ATen's headers (~9 s of the first build each
time a unit includes them)."""

from __future__ import annotations

import re

from flashformer.kernels import extension

ATEN_UNITS = {"bindings_cpu.cpp"}


def included(path, seen=None) -> set[str]:
    """Every header `path` includes, transitively: csrc's own by name, the others as written."""
    seen = set() if seen is None else seen
    for name in re.findall(r'^#include [<"]([^>"]+)[>"]', path.read_text(), re.M):
        local = path.parent / name
        if name not in seen:
            seen.add(name)
            if local.exists():
                included(local, seen)
    return seen


def test_every_source_file_is_listed():
    listed = {path.name for path in extension.SOURCES + extension.INCLUDES}
    on_disk = {path.name for path in (extension.SOURCES[0].parent).iterdir()}
    assert listed == on_disk


def test_only_the_bindings_include_aten():
    for source in extension.SOURCES:
        aten = {name for name in included(source) if name.startswith(("ATen/", "torch/"))}
        assert bool(aten) == (source.name in ATEN_UNITS), (source.name, sorted(aten))


def test_no_switch_falls_to_a_default():
    """The kernels are chosen by table (csrc/packings.h), not by a switch: where a `default:`
    once ran Q6_K's kernels for any packing a switch missed, a missing row now fails to compile
    or fails test_kernels_tables. No switch in csrc/ may take a default branch."""
    defaults = [
        f"{path.name}:{number}"
        for path in sorted(extension.SOURCES[0].parent.iterdir())
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.match(r"\s*default\s*:", line)
    ]
    assert not defaults, f"switches with a default branch: {defaults}"
