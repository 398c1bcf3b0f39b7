"""FLASHFORMER_CPU_ISA (flashformer/kernels/machine.py): the quantized kernels' path chosen by the
environment when they load, and a bad value refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.kernel_paths import kernel_paths

from flashformer.kernels import extension, machine
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


def test_aten_capabilities_are_what_the_cpu_runs():
    """PyTorch's capabilities this CPU runs, and the ISA the kernels are built up to, agree with
    the C++ kernels' own reading of CPUID (GCC's __builtin_cpu_supports): AVX2 where ours run
    AVX2, AVX-512 where ours run VNNI; every path of ours maps to one of them, clamped."""
    capabilities = machine.aten_capabilities()
    assert capabilities[0] == "default" and capabilities == machine.ATEN_CAPABILITIES[: len(capabilities)]
    assert machine.aten_capability("best") is None
    for isa in machine.KERNEL_ISAS:
        assert machine.aten_capability(isa) in capabilities
    assert machine.aten_capability("scalar") == "default"
    if load_kernels() == "cpp":
        previous = kernel_isa()
        best = kernel_isa("best")
        kernel_isa(previous)
        assert ("avx2" in capabilities) == (best != "scalar")
        if best in ("avx512-vnni", "amx-int8"):
            assert "avx512" in capabilities
        # the kernels are built up to the widest this CPU runs, and run up to what was built
        widest = machine.widest_kernel_isa()
        assert machine.KERNEL_ISAS.index(best) <= machine.KERNEL_ISAS.index(widest)
        assert (best in ("avx512-vnni", "amx-int8")) == (widest in ("avx512-vnni", "amx-int8"))


def test_the_isa_request_moves_pytorchs_own_kernels():
    """FLASHFORMER_CPU_ISA in a fresh process sets ATen's capability when flashformer is imported,
    before ATen's first operation: the widest path asked for gets the widest capability the CPU
    has, scalar gets ATen's default; an ATEN_CPU_CAPABILITY the user set is left as it is. When
    an operation ran before flashformer was imported, ATen has chosen: a warning says so."""
    first_op = "torch.randn(64).exp().sum()"
    widest = machine.aten_capabilities()[-1]
    cases = [  # (variables, ATen's capability, the script, whether it warns)
        ({"FLASHFORMER_CPU_ISA": "amx-int8"}, widest, f"import flashformer, torch; {first_op}", False),
        ({"FLASHFORMER_CPU_ISA": "scalar"}, "default", f"import flashformer, torch; {first_op}", False),
        (
            {"FLASHFORMER_CPU_ISA": "amx-int8", "ATEN_CPU_CAPABILITY": "default"},
            "default",
            "import flashformer, torch",
            False,
        ),
        ({"FLASHFORMER_CPU_ISA": "scalar"}, widest, f"import torch; {first_op}; import flashformer", True),
    ]
    for variables, expected, script, warns in cases:
        env = {k: v for k, v in os.environ.items() if k not in ("FLASHFORMER_CPU_ISA", "ATEN_CPU_CAPABILITY")}
        env.update(variables, PYTHONPATH=str(Path(__file__).parents[2]))
        done = subprocess.run(
            [sys.executable, "-c", script + "; print(torch.backends.cpu.get_cpu_capability())"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split()[-1] == expected.upper(), (variables, done.stderr[-2000:])
        assert ("chosen before flashformer was imported" in done.stderr) == warns, (
            variables,
            done.stderr[-2000:],
        )


def expected_builds(isa: str) -> dict[str, set[str]]:
    """The builds each family runs on path `isa`: its own, where the family has one; AVX2's code
    serves every vector ISA for the float products, x's quantizing and the cache's widening; on
    AMX the products of few rows (and of float activations) run VNNI's, as do the row operations
    and attention."""
    vector = isa if isa == "scalar" else "avx2"
    own = {isa} if isa != "amx-int8" else {"avx512-vnni"}
    expected = {family: own for family in extension.KERNEL_FAMILIES}
    for family in ("float32 products", "quantizing x", "widening KV rows"):
        expected[family] = {vector}
    if isa == "amx-int8":
        for family in ("int4/int5 products", "int8 products", "K-quant products"):
            expected[family] = {"avx512-vnni", "amx-int8"}
        expected["quantizing x"] = {"avx2", "amx-int8"}
    return expected


@pytest.mark.skipif(load_kernels() != "cpp", reason="the C++ kernels are not built here")
def test_every_family_of_kernels_runs_the_path_asked_for():
    """Each path this CPU runs, and scalar: every family of kernels (the products, the row
    operations, attention, ...) runs that path's build, none another (GCC's target_clones chose
    the AVX-512 build of the row operations and attention by the CPU's flags whatever the switch)."""
    from helpers.kernel_families import run_every_family
    from helpers.kernel_paths import on_path

    for isa in ("scalar", *kernel_paths()):
        with on_path(isa):
            extension.kernels_ran(reset=True)
            run_every_family()
            ran = extension.kernels_ran(reset=True)
        assert ran == expected_builds(isa), isa


@pytest.mark.skipif(load_kernels() != "cpp", reason="the C++ kernels are not built here")
def test_forced_avx2_runs_avx2_code_in_every_family():
    """FLASHFORMER_CPU_ISA=avx2 in a fresh process (scalar on a CPU without AVX2): every family of
    kernels runs AVX2's build and nothing wider, and PyTorch's own kernels run AVX2's too."""
    forced = "avx2" if "avx2" in machine.aten_capabilities() else "scalar"
    script = (
        "import json, sys, torch; sys.path.insert(0, 'tests'); "
        "from helpers.kernel_families import run_every_family; "
        "from flashformer.kernels import extension; run_every_family(); "
        "print(json.dumps({f: sorted(i) for f, i in extension.kernels_ran().items()})); "
        "print(torch.backends.cpu.get_cpu_capability())"
    )
    root = Path(__file__).parents[2]
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env.update(FLASHFORMER_CPU_ISA="avx2", PYTHONPATH=str(root))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=root, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ran, capability = done.stdout.strip().splitlines()[-2:]
    assert json.loads(ran) == {f: sorted(i) for f, i in expected_builds(forced).items()}
    assert capability == machine.aten_capability(forced).upper()
