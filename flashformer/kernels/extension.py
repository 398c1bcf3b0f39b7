"""flashformer's C++ CPU kernels: one extension, compiled with torch.utils.cpp_extension at
first use, once per machine (cached in torch's extension folder, TORCH_EXTENSIONS_DIR; about
100 s cold on 2 cores), with a line on stderr before and after the build.

It implements the operators of operators.py (their schemas are Python's, so torch.compile and
the fallbacks see them whether or not the build succeeds) and the class NativeDecoder, a
decoder-only model's whole forward in one call (native_decoder.py, csrc/decoder_cpu.cpp).

Without a compiler (or with FLASHFORMER_QUANTIZED_KERNELS=torch) load() warns once and
registers the operators' fallbacks: PyTorch code, exact and slower. Once loaded, every family
of C++ kernels (the products, the row operations, attention) takes the path FLASHFORMER_CPU_ISA
asks for (kernels/machine.py); kernel_isa() reads or switches it, kernels_ran() says what ran.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import re
import sys
import time
import warnings
from pathlib import Path

import torch

from flashformer.kernels import machine, operators
from flashformer.kernels.machine import KERNEL_ISAS

NAME = "flashformer_cpu_kernels"
_CSRC = Path(__file__).parent / "csrc"


# every source file of csrc/ and its bytes, read once: the build's source list is derived from
# them at import, and load() hashes them to decide a rebuild
_FILES = {
    path: path.read_bytes() for path in sorted(_CSRC.iterdir()) if path.suffix in (".cpp", ".h", ".inc")
}
_INCLUDED = {
    path: [_CSRC / name.decode() for name in re.findall(rb'^#include "([^"]+)"', text, flags=re.MULTILINE)]
    for path, text in _FILES.items()
}  # the files of csrc/ each file includes (#include "name")


def _unit_files(path: Path, seen: set[Path] | None = None) -> set[Path]:
    """A file and every csrc/ file it includes, directly or not."""
    seen = set() if seen is None else seen
    if path not in seen:
        seen.add(path)
        for included in _INCLUDED[path]:
            _unit_files(included, seen)
    return seen


def _translation_units() -> list[Path]:
    """The sources the build compiles, read from the folder: every .cpp that no file of csrc/
    includes (bindings_cpu.cpp includes operators_cpu.cpp and decoder_cpu.cpp, so that one unit
    holds every use of ATen's headers, ~9 s to compile each time a unit includes them). The largest
    unit, counted with what it includes, first: ninja starts them in this order."""
    included = {path for paths in _INCLUDED.values() for path in paths}
    units = [path for path in _FILES if path.suffix == ".cpp" and path not in included]

    def size(unit: Path) -> int:
        return sum(len(_FILES[path]) for path in _unit_files(unit))

    return sorted(units, key=lambda unit: (-size(unit), unit.name))


SOURCES = _translation_units()
# torch hashes only SOURCES to decide a rebuild: the rest of the folder goes into a flag
INCLUDES = [path for path in _FILES if path not in SOURCES]

_loaded_as: str | None = None  # load()'s answer, once it has run


def _loaded(answer: str) -> str:
    global _loaded_as
    _loaded_as = answer
    return answer


@functools.cache
def load() -> str:
    """Make the operators runnable, once per process: "cpp" when the C++ kernels are built (or
    found in the cache) and loaded, "torch" when the PyTorch fallbacks serve instead."""
    if os.environ.get("FLASHFORMER_QUANTIZED_KERNELS") == "torch":
        return _fall_back()
    try:
        _build_and_load()
    except Exception as error:  # any failure to build or load: compiler, ninja, headers, linker
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        warnings.warn(
            f"flashformer: the C++ CPU kernels could not be built ({reason}); "
            "using the slower PyTorch fallbacks",
            stacklevel=2,
        )
        return _fall_back()
    torch.ops.flashformer.quantized_kernel_isa(_isa_index(machine.requested_isa()))
    return _loaded("cpp")


def kernel_isa(request: int | str = -1) -> str:
    """Which code runs the operators: one of KERNEL_ISAS (the C++ kernels) or "torch" (the fallback).
    request (a name or its index) switches the C++ kernels to that code, or the best below it
    this CPU has; "best" switches to the best this CPU has (FLASHFORMER_CPU_ISA chose the path at
    load). Tests compare them: all give the same bits."""
    load()
    isa = torch.ops.flashformer.quantized_kernel_isa(
        _isa_index(request) if isinstance(request, str) else request
    )
    return "torch" if isa < 0 else KERNEL_ISAS[isa]


# csrc/quantized_common.h's Family: the kernels that each follow the ISA switch and record the
# builds they ran
KERNEL_FAMILIES = (
    "int4/int5 products",
    "int8 products",
    "K-quant products",
    "float32 products",
    "quantizing x",
    "row operations",
    "attention",
    "widening KV rows",
    "MXFP4 products",
)


def kernels_ran(reset: bool = False) -> dict[str, set[str]]:
    """Which code each family of C++ kernels ran since the last reset: its name (KERNEL_FAMILIES)
    -> the KERNEL_ISAS whose build it ran. Families that ran nothing are left out; without the C++
    kernels, nothing is. reset=True starts the count again (after reading it). The tests read it
    to show that a path forced by FLASHFORMER_CPU_ISA or kernel_isa runs that ISA's code in every
    family; nothing chooses by the CPU's flags behind the switch."""
    load()
    ran = torch.ops.flashformer.kernels_ran(reset)
    return {
        family: {isa for i, isa in enumerate(KERNEL_ISAS) if bits >> i & 1}
        for family, bits in zip(KERNEL_FAMILIES, ran)
        if bits
    }


def _isa_index(name: str) -> int:
    return len(KERNEL_ISAS) - 1 if name == "best" else KERNEL_ISAS.index(name)


def build_directory() -> Path:
    """Where torch builds and caches the extension (TORCH_EXTENSIONS_DIR/.../NAME), created."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(NAME, verbose=False))


def _build_and_load() -> None:
    """cpp_extension.load under a lock the kernel releases when its holder dies.

    torch's own build lock is a file that exists while a build runs (a FileBaton): a process
    killed mid-build (Ctrl-C during a first import, a test run cut short) leaves it behind, and
    every later load waits on it forever. Every build here takes an flock first, so whoever holds
    the flock knows a baton file it finds is such a leftover and removes it."""
    from torch.utils import cpp_extension

    build = build_directory()
    with open(build / "flashformer.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released at close, or by the kernel if we die
        baton = build / "lock"
        if baton.exists():
            warnings.warn(
                f"flashformer: removing {baton}, left by a kernel build that was killed", stacklevel=3
            )
            baton.unlink(missing_ok=True)
        # -ffp-contract=off: no multiply-add fused behind our back, so the scalar, AVX2 and
        # VNNI kernels perform the same roundings; the ISA is chosen at run time, per CPU, among
        # the builds up to the widest this CPU runs (FF_WIDEST_ISA). The included files' hash is
        # a flag: torch rebuilds when the flags change.
        widest = KERNEL_ISAS.index(machine.widest_kernel_isa())
        flags = ["-O3", "-DNDEBUG", "-fopenmp", "-ffp-contract=off", f"-DFF_WIDEST_ISA={widest}"]
        flags.append(f"-DFF_INCLUDES={_includes_hash()}")
        stamp, built = build / "flashformer.stamp", _build_stamp(flags)
        fresh = not stamp.exists() or stamp.read_text() != built
        library = build / f"{NAME}.so"
        if not fresh and library.exists():
            # built from these sources, flags and torch: loaded as it is, without cpp_extension's
            # check (it runs ninja: 0.26 s of every process's cold start)
            torch.ops.load_library(str(library))
            return
        if fresh:
            print(
                "flashformer: building the C++ kernels, once for this machine (about 100 s on 2 cores) ...",
                file=sys.stderr,
                flush=True,
            )
        started = time.perf_counter()
        cpp_extension.load(
            name=NAME,
            sources=[str(path) for path in SOURCES],
            build_directory=str(build),
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
        if fresh:
            seconds = time.perf_counter() - started
            print(
                f"flashformer: built the C++ kernels in {seconds:.0f} s ({build})",
                file=sys.stderr,
                flush=True,
            )
            stamp.write_text(built)


def cpp_kernels() -> bool:
    """Whether the C++ kernels run here (load() == "cpp"). Under torch.compile it reads what an
    earlier load() found, without loading (tracing a build would break the graph): a compiled
    step whose kernels were not loaded before takes the other paths, and recompiles once they
    are (the answer is guarded as a constant). decoding.compiled() loads them first."""
    if torch.compiler.is_compiling():
        return _loaded_as == "cpp"
    return load() == "cpp"


def _fall_back() -> str:
    operators.register_fallbacks()
    return _loaded("torch")


def _build_stamp(flags: list[str]) -> str:
    """What a build of the extension depends on: the sources, the flags and torch's version."""
    sources = b"".join(_FILES[path] for path in SOURCES)
    return hashlib.sha256(sources + repr((flags, torch.__version__)).encode()).hexdigest()


def _includes_hash() -> str:
    return hashlib.sha256(b"".join(_FILES[path] for path in INCLUDES)).hexdigest()[:16]
