"""What machine this is, as every benchmark records it: the CPU, its cores, its vector
instructions (the flags the kernel reports, and the level PyTorch chose: kernels choose their path
from the same flags), the threads, torch's version and the GPU if any; and which code path the
C++ kernels were asked to take.

FLASHFORMER_CPU_ISA (scalar, avx2, avx512-vnni, amx-int8 or best; unset: best) picks the path of
every C++ kernel when they load (kernels/extension.py): `FLASHFORMER_CPU_ISA=avx2` on an AVX-512
machine runs what a CPU without AVX-512 runs (the products, the row operations, attention), to
compare with a llama.cpp built for AVX2 alone. A path the CPU lacks falls to the best below it.
PyTorch's own kernels follow ATEN_CPU_CAPABILITY (default, avx2, avx512), which ATen reads once,
at its first operation, and trusts without asking the CPU (a capability the CPU lacks dies with
SIGILL): follow_isa_request() sets it from FLASHFORMER_CPU_ISA when flashformer is imported,
clamped to what the CPU has, so one variable moves both (docs/architecture.md, "Instruction sets")."""

from __future__ import annotations

import functools
import os
import platform
import time
import warnings
from pathlib import Path

import torch

# what changes how threads wait and which kernels run, recorded when set: OpenMP's spin-waiting
# (llama.cpp's and PyTorch's threads) decides the speed of both on a machine shared with others
ENVIRONMENT = (
    "OMP_WAIT_POLICY",
    "GOMP_SPINCOUNT",
    "OMP_NUM_THREADS",
    "ATEN_CPU_CAPABILITY",
    "FLASHFORMER_CPU_ISA",
)
# the x86 flags that decide which kernels run (ours, PyTorch's, llama.cpp's)
VECTOR_FLAGS = ("avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
                "avx512_vnni", "avx512_bf16", "avx512vbmi", "amx_tile", "amx_int8", "amx_bf16")  # fmt: skip

ISA_VARIABLE = "FLASHFORMER_CPU_ISA"
# the C++ kernels' code paths, by request number ("amx-int8": AMX's tiles for the K-quants' many-row
# products, VNNI's kernels for the rest)
KERNEL_ISAS = ("scalar", "avx2", "avx512-vnni", "amx-int8")
ATEN_VARIABLE = "ATEN_CPU_CAPABILITY"
# PyTorch's own code paths (ATEN_CPU_CAPABILITY), narrowest first, and the one each of ours matches
ATEN_CAPABILITIES = ("default", "avx2", "avx512")
ATEN_CAPABILITY_OF = {"scalar": "default", "avx2": "avx2", "avx512-vnni": "avx512", "amx-int8": "avx512"}


def process_seconds() -> float:
    """Seconds since this process started (Linux: its start time in /proc/self/stat, in clock
    ticks after boot), else since this module was imported: a command's cold start, imports and
    loading included."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()


def requested_isa() -> str:
    """The quantized kernels' path FLASHFORMER_CPU_ISA asks for, read now: one of KERNEL_ISAS,
    or "best" (also when unset or empty)."""
    value = os.environ.get(ISA_VARIABLE, "").strip().lower() or "best"
    if value not in (*KERNEL_ISAS, "best"):
        raise ValueError(f"{ISA_VARIABLE}: expected one of {(*KERNEL_ISAS, 'best')}, got {value!r}")
    return value


@functools.cache
def aten_capabilities() -> tuple[str, ...]:
    """The ATEN_CPU_CAPABILITY values this CPU runs, narrowest first, asked of the CPU itself
    (CPUID, through PyTorch's cpuinfo, as its dispatch and inductor ask it) and not of
    /proc/cpuinfo, which an emulator fills with its host's flags. Asking does not fix ATen's
    own choice (that happens at its first operation)."""
    found = ["default"]
    if torch.cpu._is_avx2_supported():
        found.append("avx2")
        if torch.cpu._is_avx512_supported():
            found.append("avx512")
    return tuple(found)


@functools.cache
def widest_kernel_isa() -> str:
    """The widest of KERNEL_ISAS this CPU runs, asked of CPUID as aten_capabilities() asks it: the
    C++ kernels are built up to it (extension.py), so a CPU without AVX-512 compiles none of the
    AVX-512 and AMX kernels. AVX2's are built on every x86 CPU (the C++ side stops at what the
    CPU runs, whatever was built)."""
    if not (
        torch.cpu._is_avx2_supported() and torch.cpu._is_avx512_supported() and torch.cpu._is_vnni_supported()
    ):
        return "avx2"
    return "amx-int8" if torch.cpu._is_amx_tile_supported() else "avx512-vnni"


def aten_capability(isa: str) -> str | None:
    """The ATEN_CPU_CAPABILITY matching our path `isa` (one of KERNEL_ISAS, or "best": None, ATen's
    own choice), clamped to the widest this CPU runs."""
    if isa == "best":
        return None
    wanted, runs = ATEN_CAPABILITIES.index(ATEN_CAPABILITY_OF[isa]), aten_capabilities()
    return runs[min(wanted, len(runs) - 1)]


def follow_isa_request() -> str | None:
    """Set ATEN_CPU_CAPABILITY from FLASHFORMER_CPU_ISA (clamped to the CPU: aten_capability), so
    that PyTorch's kernels and torch.compile's code take the path ours take; the value set, or
    None. `import flashformer` calls it (flashformer/__init__.py): before ATen's first
    operation, which reads the variable once (`import torch` runs none). A variable the user set
    is left alone, as is an unknown request (load() refuses it by name). If ATen chose before
    (an operation ran before flashformer was imported), a warning says to set both."""
    try:
        wanted = aten_capability(requested_isa())
    except ValueError:
        return None
    if wanted is None or ATEN_VARIABLE in os.environ:
        return None
    os.environ[ATEN_VARIABLE] = wanted
    chosen = torch.backends.cpu.get_cpu_capability().lower()  # ATen's, fixed from here on
    if chosen != wanted:
        warnings.warn(
            f"{ISA_VARIABLE}={requested_isa()}: PyTorch's own kernels run {chosen}, chosen before flashformer "
            f"was imported; set {ATEN_VARIABLE}={wanted} too, before Python starts",
            stacklevel=2,
        )
    return wanted


def machine_info() -> dict:
    cpu, flags = platform.processor() or platform.machine(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                present = set(line.split(":", 1)[1].split())
                flags = [flag for flag in VECTOR_FLAGS if flag in present]
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_flags": flags,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "kernel_isa_request": os.environ.get(ISA_VARIABLE) or "best",
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "environment": {name: os.environ[name] for name in ENVIRONMENT if name in os.environ},
    }
