"""The CPU matmul paths of flashformer.kernels.cpu against float64
references, and the hardware policy that picks them."""

from __future__ import annotations

import pytest
import torch

from flashformer.kernels import cpu, machine
from flashformer.kernels.cpu import linear

# ---- the float32 inference path for a few rows (decoding) ----


@pytest.mark.parametrize(
    "shape, out_features",
    [
        ((1, 48), 64),  # one row: W's rows in ROW_BLOCKS blocks
        ((1, 1, 48), 41),  # remainder rows past the blocks
        ((1, 48), 3),  # too few outputs to split
        ((8, 1, 48), 40),  # several rows: out^T = W @ x^T
        ((2, 64, 48), 40),  # FEW_ROWS rows
    ],
)
@pytest.mark.parametrize("with_bias", [True, False])
def test_few_rows_linear_against_float64(shape, out_features, with_bias, monkeypatch):
    """Without autograd `linear` computes a few rows of float32 x @ W^T + b
    another way (faster on CPUs); it must be the same product."""
    calls, few_rows = [], cpu._few_rows_linear
    monkeypatch.setattr(cpu, "_few_rows_linear", lambda *a: calls.append(1) or few_rows(*a))
    x, weight = torch.randn(*shape), torch.randn(out_features, shape[-1])
    bias = torch.randn(out_features) if with_bias else None
    with torch.no_grad():
        out = linear(x, weight, bias)
    assert calls == [1]
    assert out.shape == (*shape[:-1], out_features) and out.is_contiguous()
    exact = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    assert (out.double() - exact).abs().max().item() < 1e-5 * exact.abs().max().item()


def test_few_rows_linear_is_not_used_for_training_or_many_rows(monkeypatch):
    """With autograd, beyond FEW_ROWS rows, in another dtype and under
    autocast, `linear` is F.linear (or the autocast emulation)."""
    monkeypatch.setattr(cpu, "_few_rows_linear", lambda *a: pytest.fail("few-rows path taken"))
    weight = torch.randn(40, 48, requires_grad=True)
    linear(torch.randn(3, 48), weight).sum().backward()
    assert weight.grad is not None
    with torch.no_grad():
        linear(torch.randn(cpu.FEW_ROWS + 1, 48), weight)
        linear(torch.randn(3, 48, dtype=torch.float64), weight.double())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert linear(torch.randn(3, 48), weight).dtype == torch.bfloat16


# ---- low precision ----


@pytest.mark.parametrize("emulated", [True, False], ids=["emulated", "native"])
def test_low_precision_linear_computes_what_autocast_means(emulated, monkeypatch):
    """Under CPU bf16 autocast `linear` returns bf16, and its numbers are the
    float64 product of the bf16-rounded operands, rounded once to bf16: the
    float32 emulation and the native kernel alike (each forced, on any CPU)."""
    monkeypatch.setattr(
        cpu, "EMULATED_LOW_PRECISION", frozenset(cpu.LOW_PRECISION) if emulated else frozenset()
    )
    emulation = cpu._LowPrecisionLinear.apply
    calls = []
    monkeypatch.setattr(cpu._LowPrecisionLinear, "apply", lambda *a: calls.append(1) or emulation(*a))
    x = torch.randn(4, 33, 48, requires_grad=True)
    weight = torch.randn(40, 48, requires_grad=True)
    bias = torch.randn(40, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear(x, weight, bias)
    assert out.dtype == torch.bfloat16
    rounded = [t.detach().bfloat16().double() for t in (x, weight, bias)]
    exact = rounded[0] @ rounded[1].T + rounded[2]
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()  # within bf16 rounding

    grad_out = torch.randn_like(out, dtype=torch.float32)
    out.backward(grad_out)
    g = grad_out.bfloat16().double()
    expected_x, expected_w = g @ rounded[1], g.reshape(-1, 40).T @ rounded[0].reshape(-1, 48)
    for got, expected in ((x.grad, expected_x), (weight.grad, expected_w), (bias.grad, g.sum((0, 1)))):
        assert got.dtype == torch.float32
        assert ((got.double() - expected).abs() <= expected.abs() * 2**-7 + 1e-3).all()
    assert calls == ([1] if emulated else [])


# ---- the policy: which dtypes are emulated, and what attention computes in ----


@pytest.mark.parametrize(
    "units, setting, emulated",
    [
        ({torch.bfloat16: True, torch.float16: True}, None, set()),  # AMX / AVX-512 BF16 + AMX-FP16
        ({torch.bfloat16: True, torch.float16: False}, None, {torch.float16}),  # AVX-512 BF16 (Zen 4)
        ({torch.bfloat16: False, torch.float16: False}, None, {torch.bfloat16, torch.float16}),  # AVX2
        ({torch.bfloat16: False, torch.float16: False}, "1", set()),
        ({torch.bfloat16: True, torch.float16: True}, "0", {torch.bfloat16, torch.float16}),
    ],
)
def test_emulation_follows_the_cpu_features_and_the_switch(units, setting, emulated, monkeypatch):
    """A CPU with bf16 matrix units keeps the native kernels; one without them emulates;
    FLASHFORMER_NATIVE_LOW_PRECISION_MATMUL overrides both ways."""
    monkeypatch.setattr(cpu, "cpu_has_matrix_units", lambda dtype: units[dtype])
    if setting is None:
        monkeypatch.delenv("FLASHFORMER_NATIVE_LOW_PRECISION_MATMUL", raising=False)
    else:
        monkeypatch.setenv("FLASHFORMER_NATIVE_LOW_PRECISION_MATMUL", setting)
    assert cpu._emulated_dtypes() == emulated


def test_the_cpu_features_are_read_from_torch():
    """The feature queries exist in this torch build (a rename would otherwise
    silently report no bf16 units and emulate on every CPU)."""
    assert callable(torch.cpu._is_avx512_bf16_supported)
    assert callable(torch.cpu._is_amx_tile_supported)
    assert callable(torch.cpu._is_amx_fp16_supported)
    assert cpu.cpu_has_matrix_units(torch.float32)


@pytest.mark.parametrize("emulated", [True, False])
def test_attention_computes_in_float32_where_bf16_is_emulated(emulated, monkeypatch):
    """backend="auto" widens bf16 to float32 on a CPU that emulates bf16 (the
    result then matches float32 attention rounded once), and keeps bf16 where
    the CPU has the units; either way the output is bf16."""
    import flashformer

    monkeypatch.setattr(
        cpu, "EMULATED_LOW_PRECISION", frozenset(cpu.LOW_PRECISION) if emulated else frozenset()
    )
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 33, 16).bfloat16() for _ in range(3))
    assert cpu.attention_compute_dtype(q) == (torch.float32 if emulated else torch.bfloat16)
    out = flashformer.attention(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    exact = flashformer.attention(q.double(), k.double(), v.double(), causal=True, backend="eager")
    error = (out.double() - exact).abs()
    if emulated:  # float32 arithmetic, then one rounding to bf16
        assert (error <= exact.abs() * 2**-8 + 1e-6).all()
    else:  # bf16 arithmetic: within twice the eager backend's own bf16 error (flash-attn's rule)
        eager = flashformer.attention(q, k, v, causal=True, backend="eager")
        assert error.max() <= 2 * (eager.double() - exact).abs().max() + 1e-3


def test_the_cpu_decode_step_options_are_inductor_options():
    """A torch upgrade that renames one of them must fail here, not in a user's first compile=True."""
    import torch._inductor.config

    assert set(cpu.cpu_decode_step_options()) <= set(torch._inductor.config.get_config_copy())


# A decode step's first kernel in miniature: token -> (group, row) of a packed int8 table, a
# gather, a scale and an RMS norm; loops of int64 indices, whose width follows the vector ISA.
ISA_PROBE = """
import sys, torch
from flashformer.kernels.cpu import cpu_decode_step_options
torch.manual_seed(0)
table = torch.randint(-100, 100, (4096, 20, 4, 32), dtype=torch.int8)
scales = torch.rand(4096, 20, 4).half()
def step(tokens):
    group, row = tokens // 4, tokens % 4
    x = (table[group, :, row].float() * scales[group, :, row].float()[..., None]).flatten(1)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
tokens = torch.randint(0, 4 * 4096, (16,))
got = torch.compile(step, dynamic=False, options=cpu_decode_step_options())(tokens)
torch.testing.assert_close(got, step(tokens))
print(cpu_decode_step_options()["cpp.simdlen"])
"""


def test_a_compiled_step_cached_for_one_vector_isa_is_not_reused_for_another(tmp_path):
    """Inductor's FX graph cache does not key on ATEN_CPU_CAPABILITY: a process forced to AVX2
    reused the graph an AVX-512 process had cached and died in it (kernels.cpu.
    cpu_decode_step_options). Every vector width this CPU has, widest first, then the others,
    compile the same step into one shared cache; each must compute what eager does. Only the
    capabilities the CPU has are asked for: ATen trusts the variable, and one the CPU lacks dies
    with SIGILL in its first kernel."""
    import os
    import subprocess
    import sys

    capabilities = machine.aten_capabilities()  # narrowest first
    widths = {}
    for capability in (capabilities[-1], *capabilities[:-1], capabilities[-1]):
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
        done = subprocess.run(
            [sys.executable, "-c", ISA_PROBE], env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"ATEN_CPU_CAPABILITY={capability}: {done.stderr[-2000:]}"
        widths[capability] = int(done.stdout.split()[-1])
    # one width per capability
    assert widths == {name: {"default": 0, "avx2": 256, "avx512": 512}[name] for name in capabilities}


@pytest.mark.skipif(
    not __import__("flashformer.kernels.extension", fromlist=["x"]).cpp_kernels(),
    reason="the C++ CPU kernels could not be built here",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_auto_decode_steps_reach_the_cpu_kernel(dtype, monkeypatch):
    """In auto, a bf16 decode step widened on a CPU that emulates bf16 runs the C++ kernel on
    float32 keys; a float16 cache read by float32 queries runs it on the cache as it is."""
    import importlib

    import flashformer

    kernel = importlib.import_module("flashformer.attention.cpu_kernel")
    seen, run = [], kernel.cpu_attention
    monkeypatch.setattr(kernel, "cpu_attention", lambda q, k, *a: seen.append(k.dtype) or run(q, k, *a))
    monkeypatch.setattr(cpu, "EMULATED_LOW_PRECISION", frozenset(cpu.LOW_PRECISION))
    k, v = (torch.randn(2, 2, 40, 16).to(dtype) for _ in range(2))
    q = torch.randn(2, 4, 1, 16)
    with torch.no_grad():
        out = flashformer.attention(q.to(dtype) if dtype == torch.bfloat16 else q, k, v, causal=True)
    assert seen == [torch.float32 if dtype == torch.bfloat16 else torch.float16]
    assert out.dtype == (dtype if dtype == torch.bfloat16 else torch.float32)
