"""What machine this is, as every benchmark records it: the CPU, its cores, its vector
instructions (the flags the kernel reports, and the level PyTorch chose: kernels choose their path
from the same flags), the threads, torch's version and the GPU if any; and which code path the
quantized kernels were asked to take.

FLASHFORMER_CPU_ISA (scalar, avx2, avx512-vnni, amx-int8 or best; unset: best) picks the quantized C++
kernels' path when they load (kernels/extension.py): `FLASHFORMER_CPU_ISA=avx2` on an AVX-512
machine runs the 256-bit AVX2 kernels, what a CPU without AVX-512 runs, to compare with a
llama.cpp built for AVX2 alone. A path the CPU lacks falls to the best below it. PyTorch's own
kernels and torch.compile's code follow ATEN_CPU_CAPABILITY (avx2, avx512, default) instead:
set both for a whole program on AVX2."""

from __future__ import annotations

import os
import platform
import time
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
