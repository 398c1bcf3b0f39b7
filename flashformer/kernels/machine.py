"""What machine this is, as every benchmark records it: the CPU, its cores and the vector
instructions PyTorch found (kernels choose their path from the same flags), the threads, torch's
version and the GPU if any."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
