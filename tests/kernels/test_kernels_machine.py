"""FLASHFORMER_CPU_ISA (flashformer/kernels/machine.py): the quantized kernels' path chosen by the
environment when they load, and a bad value refused by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashformer.kernels import machine
from flashformer.kernels.quantized import kernel_isa, load_kernels


def test_requested_isa_reads_the_variable(monkeypatch):
    monkeypatch.delenv(machine.ISA_VARIABLE, raising=False)
    assert machine.requested_isa() == "best"
    monkeypatch.setenv(machine.ISA_VARIABLE, " AVX2 ")
    assert machine.requested_isa() == "avx2"
    assert machine.machine_info()["kernel_isa_request"] == " AVX2 "
    monkeypatch.setenv(machine.ISA_VARIABLE, "avx512")
    with pytest.raises(ValueError, match=r"FLASHFORMER_CPU_ISA: expected one of .*'avx2'.*got 'avx512'"):
        machine.requested_isa()


@pytest.mark.skipif(load_kernels() != "cpp", reason="the C++ kernels are not built here")
def test_forced_avx2_path_in_a_fresh_process():
    """FLASHFORMER_CPU_ISA=avx2 on this CPU: the kernels report AVX2 (or scalar on a CPU without it)
    and give AVX2's bits, which the reference tests check on every path."""
    previous = kernel_isa()
    expected = kernel_isa("avx2")
    kernel_isa(previous)
    script = "from flashformer.kernels.quantized import kernel_isa; print(kernel_isa())"
    env = dict(os.environ, FLASHFORMER_CPU_ISA="avx2", PYTHONPATH=str(Path(__file__).parents[2]))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == expected
