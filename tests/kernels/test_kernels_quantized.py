"""Weight-only quantized kernels (flashformer/kernels/quantized.py) against independent references:
gguf's quantizer and dequantizer, and float64 products of the dequantized weights."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from helpers.int8_blocks import quantize_activations
from helpers.kernel_paths import kernel_paths, on_path
from torch import nn

from flashformer.checkpoints.gguf.packaged_models import smollm2_path
from flashformer.kernels import layouts
from flashformer.kernels.cpu import cpu_decode_step_options
from flashformer.kernels.operators import OPERATORS
from flashformer.kernels.quantized import (
    KERNEL_ISAS,
    QuantizedEmbedding,
    QuantizedLinear,
    kernel_isa,
    load_kernels,
)

SOURCES = ("int8", "int4", "Q4_0", "Q4_1", "Q8_0")  # from a float weight, or GGUF blocks


@pytest.fixture(scope="module", autouse=True)
def kernels():
    return load_kernels()


def make_linear(source: str, weight: torch.Tensor, bias=None, activations="int8"):
    """(module, float64 reference weight): GGUF sources dequantized by gguf, float ones from the
    quantization rule written out here."""
    if source in ("Q4_0", "Q4_1", "Q8_0"):
        qtype = getattr(gguf.GGMLQuantizationType, source)
        raw = gguf_quantize(weight.numpy(), qtype)
        ref = torch.from_numpy(gguf_dequantize(raw, qtype)).double()
        return QuantizedLinear.from_gguf_blocks(
            source, raw, tuple(weight.shape), bias=bias, activations=activations
        ), ref
    lin = QuantizedLinear.from_float(weight, source, bias=bias, activations=activations)
    if source == "int4":  # quantized as gguf's Q4_1 (test_int4_quantization_is_gguf_q4_1)
        raw = gguf_quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_1)
        return lin, torch.from_numpy(gguf_dequantize(raw, gguf.GGMLQuantizationType.Q4_1)).double()
    scale = weight.abs().amax(dim=1, keepdim=True) / 127  # int8 per row
    return lin, (torch.round(weight / scale).clamp(-127, 127) * scale).double()


def check_close(y: torch.Tensor, x64: torch.Tensor, w64: torch.Tensor, bias=None):
    """y against x64 @ w64^T (+ bias) in float64, to float32 rounding: each error bounded by
    3e-6 times the sum of the products' magnitudes (about 50 float32 ulps; the kernels add
    at most 48 block sums)."""
    ref = x64 @ w64.t()
    if bias is not None:
        ref = ref + bias.double()
    bound = 3e-6 * (x64.abs() @ w64.abs().t()) + 1e-30
    excess = ((y.double() - ref).abs() / bound).max().item()
    assert excess <= 1, f"error {excess:.2f}x the float32 bound"


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("shape", [(37, 64), (576, 576), (192, 576), (1536, 576), (576, 1536)])
def test_linear_matches_float64_reference(source, shape):
    """On every vector path this CPU runs (AVX2 and AVX-512 VNNI), in this one run."""
    torch.manual_seed(hash((source, shape)) % 1000)
    weight = torch.randn(shape) * 0.05
    bias = torch.randn(shape[0])
    for activations in ("int8", "float32"):
        for b in (None, bias):
            lin, w64 = make_linear(source, weight, b, activations)
            for rows in (1, 3, 16):
                x = torch.randn(rows, shape[1])
                x64 = quantize_activations(x) if activations == "int8" else x.double()
                for isa in kernel_paths():
                    with on_path(isa):
                        check_close(lin(x), x64, w64, b)


def test_int8_activations_stay_close_to_float_ones():
    torch.manual_seed(0)
    lin = QuantizedLinear.from_float(torch.randn(576, 1536) * 0.05, "int4")
    x = torch.randn(8, 1536)
    exact = x.double() @ lin.dequantize().double().t()
    relative = (lin(x).double() - exact).norm() / exact.norm()
    assert relative < 1e-2  # int8 blocks of 32: about 0.5% for Gaussian x (step d / 2 = amax / 254)


def test_int8_rows_not_a_multiple_of_32():
    torch.manual_seed(1)
    weight, bias = torch.randn(37, 50), torch.randn(37)
    for activations in ("int8", "float32"):
        lin, w64 = make_linear("int8", weight, bias, activations)
        x = torch.randn(5, 50)
        x64 = quantize_activations(x) if activations == "int8" else x.double()
        check_close(lin(x), x64, w64, bias)
        assert lin(x.view(5, 1, 50)).shape == (5, 1, 37)


@pytest.fixture(scope="module")
def smollm2():
    """The file's tensors by name, and its Q8_0 embedding (the tied head) dequantized by gguf."""
    tensors = {t.name: t for t in gguf.GGUFReader(str(smollm2_path())).tensors}
    embedding = tensors["token_embd.weight"]
    return tensors, torch.from_numpy(gguf_dequantize(embedding.data, embedding.tensor_type))


def torch_shape(tensor) -> tuple[int, int]:
    return int(tensor.shape[1]), int(tensor.shape[0])  # GGUF's ne is (in, out)


def test_repack_of_smollm2_blocks_is_bit_exact(smollm2):
    tensors, embedding = smollm2
    names = (
        "blk.0.attn_q.weight",
        "blk.0.attn_k.weight",
        "blk.7.ffn_down.weight",
        "blk.29.ffn_gate.weight",
        "token_embd.weight",
    )
    for name in names:
        tensor = tensors[name]
        expected = (
            embedding
            if name == "token_embd.weight"
            else torch.from_numpy(gguf_dequantize(tensor.data, tensor.tensor_type))
        )
        lin = QuantizedLinear.from_gguf_blocks(tensor.tensor_type.name, tensor.data, torch_shape(tensor))
        assert torch.equal(lin.dequantize(), expected), name
        emb = QuantizedEmbedding.from_gguf_blocks(tensor.tensor_type.name, tensor.data, torch_shape(tensor))
        ids = torch.tensor([[0, 3, 5], [expected.shape[0] - 1, 2, 1]])
        assert torch.equal(emb(ids), expected[ids]), name


def test_repack_of_q4_0_is_bit_exact():
    torch.manual_seed(2)
    weight = torch.randn(13, 96)
    weight[0, :32] = 0  # a block of zeros: d = 0
    raw = gguf_quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_0)
    expected = torch.from_numpy(gguf_dequantize(raw, gguf.GGMLQuantizationType.Q4_0))
    assert torch.equal(QuantizedLinear.from_gguf_blocks("Q4_0", raw, (13, 96)).dequantize(), expected)
    assert torch.equal(QuantizedEmbedding.from_gguf_blocks("Q4_0", raw, (13, 96))(torch.arange(13)), expected)


def test_int4_quantization_is_gguf_q4_1():
    torch.manual_seed(3)
    weight = torch.randn(21, 128) * torch.logspace(-4, 2, 21)[:, None]
    weight[1, :32] = 0.25  # a constant block: d = 0
    weight[2, 32:64] = torch.linspace(-1, 1, 32)  # values on the rounding boundaries
    d, m, nibbles = layouts.quantize_q4_1(weight)
    ours = torch.cat(
        (d.view(torch.uint8).view(21, 4, 2), m.view(torch.uint8).view(21, 4, 2), nibbles), dim=-1
    )
    expected = gguf_quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_1)
    assert np.array_equal(ours.reshape(21, -1).numpy(), expected)


def test_smollm2_head_at_one_row(smollm2):
    tensors, embedding = smollm2
    emb = QuantizedEmbedding.from_gguf_blocks(
        "Q8_0", tensors["token_embd.weight"].data, tuple(embedding.shape)
    )
    w64 = embedding.double()  # (49152, 576)
    x = emb(torch.tensor([[42]]))[0] * 3  # (1, 576): an embedding row as the hidden state
    for activations in ("int8", "float32"):
        head = QuantizedLinear.from_embedding(emb, activations)
        assert head.qweight.data_ptr() == emb.qweight.data_ptr()  # the same bytes, not a copy
        x64 = quantize_activations(x) if activations == "int8" else x.double()
        check_close(head(x), x64, w64)


@pytest.mark.parametrize("source", SOURCES)
def test_batch_invariance(source):
    torch.manual_seed(4)
    x = torch.randn(16, 576)
    for activations in ("int8", "float32"):
        lin, _ = make_linear(source, torch.randn(200, 576), torch.randn(200), activations)
        alone = lin(x[:1])
        for rows in (2, 5, 16):
            assert torch.equal(lin(x[:rows])[:1], alone), (activations, rows)
        assert torch.equal(lin(x)[7], lin(x[7:8])[0])


@pytest.mark.skipif(
    "amx-int8" not in kernel_paths(), reason="this CPU (or its kernel) gives no AMX int8 tiles"
)
@pytest.mark.parametrize("source", SOURCES)
def test_amx_tiles_match_the_reference_and_the_scalar_bits(source):
    """AMX's path (quantized_amx.inc: int8 activations, 16 x rows and more) at every tile shape: a
    full tile of x rows, a full one and a partial one, two full ones and a partial one; 200 output
    rows (a last partial unit of 16)."""
    torch.manual_seed(6)
    weight, bias = torch.randn(200, 576) * 0.05, torch.randn(200)
    lin, w64 = make_linear(source, weight, bias, "int8")
    for rows in (16, 19, 40):
        x = torch.randn(rows, 576)
        with on_path("amx-int8"):
            amx = lin(x)
        check_close(amx, quantize_activations(x), w64, bias)
        with on_path("scalar"):
            assert torch.equal(amx, lin(x)), rows


@pytest.mark.skipif(load_kernels() != "cpp", reason="the C++ kernels are not built here")
@pytest.mark.parametrize("source", SOURCES)
def test_every_isa_gives_the_scalar_bits(source):
    """Scalar, AVX2 and VNNI kernels (those this CPU has) at every tile of x rows: the same bits."""
    previous = kernel_isa()
    isas = [isa for isa in KERNEL_ISAS if kernel_isa(isa) == isa]
    kernel_isa(previous)
    if len(isas) < 2:
        pytest.skip("this CPU has only the scalar kernels")
    torch.manual_seed(5)
    x = torch.randn(11, 320)  # 11 rows: a full VNNI tile of 8 and a tail of 3; AVX2's 4 + 4 + 3
    prompt = torch.randn(19, 320)  # a prompt: AVX2's panel (16 rows and more), 4 tiles of 4 and 3
    # 42 output rows: int4's 6 groups of 8, the last partial, make 3 pairs for VNNI's two-group
    # pass; 50: 7 groups, the odd last one alone
    for activations, out_features in itertools.product(("int8", "float32"), (42, 50)):
        lin, _ = make_linear(source, torch.randn(out_features, 320), torch.randn(out_features), activations)
        results = {}
        try:
            for isa in isas:
                assert kernel_isa(isa) == isa
                results[isa] = (lin(x), lin(x[:1]), lin(prompt))
        finally:
            kernel_isa(previous)
        for isa in isas[1:]:
            assert torch.equal(results[isa][0], results["scalar"][0]), (activations, out_features, isa)
            assert torch.equal(results[isa][1], results["scalar"][1]), (activations, out_features, isa)
            assert torch.equal(results[isa][2], results["scalar"][2]), (activations, out_features, isa)
        assert torch.equal(results["scalar"][1][0], results["scalar"][0][0]), (activations, out_features)


def test_fallback_matches_reference():
    torch.manual_seed(6)
    for source in SOURCES:
        weight, bias = torch.randn(1030, 64), torch.randn(1030)  # more rows than one fallback tile
        lin, w64 = make_linear(source, weight, bias)
        x = torch.randn(3, 64)
        y = OPERATORS[f"{lin.fmt}_linear"].fallback(x, lin.qweight, lin.scales, lin.bias, 1030, True)
        check_close(y, x.double(), w64, bias)


def test_failed_build_falls_back_with_one_warning(tmp_path):
    """A fresh extension folder and a compiler that does not exist: one warning, then exact results."""
    script = textwrap.dedent("""
        import warnings
        import torch
        from flashformer.kernels.quantized import QuantizedLinear, kernel_isa
        torch.manual_seed(0)
        w, x = torch.randn(10, 64), torch.randn(2, 64)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = QuantizedLinear.from_float(w, "int4")
            b = QuantizedLinear.from_float(w, "int8")
            ys = [a(x), b(x)]
        assert len(caught) == 1 and "could not be built" in str(caught[0].message), [str(c.message) for c in caught]
        assert kernel_isa() == "torch"
        for lin, y in zip((a, b), ys):
            ref = x.double() @ lin.dequantize().double().t()
            assert (y - ref).abs().max() < 1e-5, (y - ref).abs().max()
        print("ok")
    """)
    env = dict(
        os.environ,
        CXX=str(tmp_path / "no-such-compiler"),
        TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"),
        PYTHONPATH=str(Path(__file__).parents[2]),
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


class TinyDecoder(nn.Module):
    """Embedding -> int4 projection -> int8 projection -> tied Q8_0 head: the quantized pieces of a step."""

    def __init__(self):
        super().__init__()
        raw = gguf_quantize(np.random.randn(100, 64).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        self.embed = QuantizedEmbedding.from_gguf_blocks("Q8_0", raw, (100, 64))
        self.up = QuantizedLinear.from_float(nn.Linear(64, 96), "int4")
        self.down = QuantizedLinear.from_float(nn.Linear(96, 64), "int8", activations="float32")
        self.head = QuantizedLinear.from_embedding(self.embed)

    def forward(self, ids):
        h = self.embed(ids)  # (B, L, 64)
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(h)  # (B, L, 100)


def test_compiles_as_one_graph():
    torch.manual_seed(7)
    model = TinyDecoder()
    compiled = torch.compile(model, fullgraph=True, options=cpu_decode_step_options())
    ids = torch.tensor([[1, 5, 99], [0, 2, 3]])
    with torch.no_grad():
        assert torch.equal(compiled(ids), model(ids))


def test_bad_inputs_raise_value_errors():
    lin = QuantizedLinear.from_float(torch.randn(8, 64), "int4")
    with pytest.raises(ValueError, match=r"x: .*float32.*torch.float64.*\(2, 64\)"):
        lin(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x: expected shape \(\.\.\., 64\).*\(2, 48\)"):
        lin(torch.randn(2, 48))
    with pytest.raises(ValueError, match=r"weight: int4 needs in_features a multiple of 32.*\(8, 48\)"):
        QuantizedLinear.from_float(torch.randn(8, 48), "int4")
    with pytest.raises(ValueError, match=r"shape: in_features must be a multiple of 32.*\(8, 40\)"):
        QuantizedLinear.from_gguf_blocks("Q4_1", np.zeros(100, np.uint8), (8, 40))
    with pytest.raises(
        ValueError, match=r"raw_uint8_blocks: a Q4_1 tensor of shape \(8, 64\) takes 320 bytes"
    ):
        QuantizedLinear.from_gguf_blocks("Q4_1", np.zeros(100, np.uint8), (8, 64))
    with pytest.raises(ValueError, match=r"type_name: expected one of .*'Q2_K'"):
        QuantizedLinear.from_gguf_blocks("Q2_K", np.zeros(100, np.uint8), (8, 64))
    with pytest.raises(ValueError, match=r"mode: expected one of .*'int3'"):
        QuantizedLinear.from_float(torch.randn(8, 64), "int3")
    with pytest.raises(ValueError, match=r"weight: expected a 2-D float tensor.*\(64,\)"):
        QuantizedLinear.from_float(torch.randn(64), "int8")
    with pytest.raises(ValueError, match=r"bias: expected a float tensor of shape \(8,\), got \(9,\)"):
        QuantizedLinear.from_float(torch.randn(8, 64), "int8", bias=torch.randn(9))
    with pytest.raises(ValueError, match=r"ids: expected an integer tensor, got torch.float32"):
        QuantizedEmbedding.from_float(torch.randn(8, 64), "int8")(torch.zeros(3))


def test_backward_gives_the_input_its_gradient_and_the_weight_none():
    """A LoRA adapter trained beside a quantized base needs x's gradient. With float32 activations
    the layer is exactly linear in x, so the gradient must give the forward's own differences:
    <grad, y(x + d) - y(x)> = <x.grad, d> for any d (no dequantizer involved in the check)."""
    lin = QuantizedLinear.from_float(torch.randn(8, 64), "int4", activations="float32")
    x = torch.randn(2, 3, 64, requires_grad=True)
    grad, d = torch.randn(2, 3, 8), torch.randn(2, 3, 64)
    lin(x).backward(grad)
    with torch.no_grad():  # inference: the kernel alone, no graph
        step = lin(x + d) - lin(x)
        assert lin(x).grad_fn is None
    assert (grad * step).sum().item() == pytest.approx((x.grad * d).sum().item(), rel=1e-4)
    assert not any(t.requires_grad for t in lin.buffers())


def test_modules_describe_themselves():
    lin = QuantizedLinear.from_float(nn.Linear(64, 10), "int4")
    assert (lin.in_features, lin.out_features, lin.fmt) == (64, 10, "int4")
    assert lin(torch.randn(0, 3, 64)).shape == (0, 3, 10)
    assert "activations=int8" in repr(lin) and lin.bias is not None
    assert set(lin.state_dict()) == {"qweight", "scales", "bias"}


def test_cat_stacks_rows():
    torch.manual_seed(8)
    parts = [QuantizedLinear.from_float(nn.Linear(64, n, bias=n != 8), "int4") for n in (16, 8, 6)]
    fused = QuantizedLinear.cat(parts)
    x = torch.randn(3, 64)
    assert fused.out_features == 30
    for y, lin in zip(torch.split(fused(x), [16, 8, 6], dim=-1), parts):
        assert torch.equal(y, lin(x))
    with pytest.raises(ValueError, match=r"linears\[0\]: out_features=6 is not a multiple of 8"):
        QuantizedLinear.cat(parts[::-1])
    with pytest.raises(ValueError, match=r"linears\[1\]: in_features=32.* does not match"):
        QuantizedLinear.cat([parts[0], QuantizedLinear.from_float(torch.randn(8, 32), "int8")])
    mixed = QuantizedLinear.cat([parts[0], QuantizedLinear.from_float(torch.randn(8, 64), "int8")])
    assert [part.fmt for part in mixed.parts] == ["int4", "int8"]  # formats apart: joined, not fused


def test_dtype_casts_leave_the_packed_buffers_alone():
    torch.manual_seed(9)
    model = nn.Sequential(
        QuantizedLinear.from_float(nn.Linear(64, 8), "int4"),
        QuantizedLinear.from_float(nn.Linear(8, 8), "int8"),
    )
    x = torch.randn(2, 64)
    before = model(x)
    dtypes = [b.dtype for b in model.buffers()]
    model.half().float().to(torch.bfloat16)
    assert [b.dtype for b in model.buffers()] == dtypes
    assert torch.equal(model(x), before)


def test_state_dict_round_trip_and_pickle(tmp_path):
    torch.manual_seed(10)
    lin = QuantizedLinear.from_float(nn.Linear(64, 12), "int4")
    again = QuantizedLinear(
        64, 12, "int4", torch.empty_like(lin.qweight), torch.empty_like(lin.scales), torch.empty(12)
    )
    again.load_state_dict(lin.state_dict())
    x = torch.randn(2, 64)
    assert torch.equal(again(x), lin(x))
    torch.save(lin, tmp_path / "lin.pt")
    assert torch.equal(torch.load(tmp_path / "lin.pt", weights_only=False)(x), lin(x))
