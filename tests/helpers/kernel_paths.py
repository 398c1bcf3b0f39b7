"""The quantized kernels' code paths in tests: each vector path this CPU runs (AVX2, and AVX-512
VNNI and AMX where it has them), so that a reference test checks every path in the same run."""

from __future__ import annotations

import contextlib

from flashformer.kernels.quantized import kernel_isa, load_kernels

VECTOR_ISAS = ("avx2", "avx512-vnni", "amx-int8")


def kernel_paths() -> list[str]:
    """The paths a reference test runs on: the vector ISAs this CPU has, or the one path there
    is ("scalar" on a CPU without AVX2, "torch" without the C++ kernels)."""
    if load_kernels() != "cpp":
        return ["torch"]
    previous = kernel_isa()
    try:
        paths = [isa for isa in VECTOR_ISAS if kernel_isa(isa) == isa]
    finally:
        kernel_isa(previous)
    return paths or ["scalar"]


@contextlib.contextmanager
def on_path(isa: str):
    """The C++ kernels on `isa` inside the block (a no-op for "torch"), the earlier path after."""
    if isa == "torch":
        yield
        return
    previous = kernel_isa()
    try:
        assert kernel_isa(isa) == isa, f"this CPU does not run {isa}"
        yield
    finally:
        kernel_isa(previous)
