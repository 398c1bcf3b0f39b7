"""What machine this is, as every benchmark records it: the CPU, its cores, its vector
instructions (the flags the kernel reports, and the level PyTorch chose: kernels choose their path
from the same flags), the threads, torch's version and the GPU if any."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

# what changes how threads wait and which kernels run, recorded when set: OpenMP's spin-waiting
# (llama.cpp's and PyTorch's threads) decides the speed of both on a machine shared with others
ENVIRONMENT = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "ATEN_CPU_CAPABILITY")
# the x86 flags that decide which kernels run (ours, PyTorch's, llama.cpp's)
VECTOR_FLAGS = ("avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
                "avx512_vnni", "avx512_bf16", "avx512vbmi", "amx_tile", "amx_int8", "amx_bf16")  # fmt: skip


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
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "environment": {name: os.environ[name] for name in ENVIRONMENT if name in os.environ},
    }
