"""CPU matmul paths: where the same numbers come faster from another arrangement.

The model code calls `linear(x, weight, bias)` (or builds a `Linear`) and
reads as if it were F.linear. Underneath, on the CPU:

- bf16/fp16 autocast on a CPU without bf16/fp16 matrix units: the product of
  the low-precision operands is computed by a float32 GEMM (`_LowPrecisionLinear`),
  because oneDNN's emulated low-precision GEMMs there run 4-100x slower.
- float32 inference on a few rows (decoding): the product is arranged so that
  MKL runs it threaded (`_few_rows_linear`).

The same hardware question decides the dtype attention computes in
(`attention_compute_dtype`), so that a model's matmuls and its attention follow
one policy. `cpu_decode_step_options()` are the inductor options a compiled
decode step gets on the CPU. The measurements behind each choice are in
docs/benchmarks.md ("CPU matmul paths").
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LOW_PRECISION = (torch.bfloat16, torch.float16)


def cpu_has_matrix_units(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` natively: bf16 with AVX-512 BF16 or
    AMX, fp16 with AMX-FP16. Without them oneDNN widens every element in
    software, and a float32 GEMM of the same values is faster."""
    cpu = torch.cpu
    if dtype == torch.bfloat16:
        return _asks(cpu, "_is_avx512_bf16_supported") or _asks(cpu, "_is_amx_tile_supported")
    if dtype == torch.float16:
        return _asks(cpu, "_is_amx_fp16_supported")
    return True


def _asks(module, name: str) -> bool:
    """A feature query of torch.cpu, False where this torch build lacks it."""
    query = getattr(module, name, None)
    return bool(query()) if query is not None else False


def _emulated_dtypes() -> frozenset[torch.dtype]:
    """Read once, at import. FLASHFORMER_NATIVE_LOW_PRECISION_MATMUL=1 keeps the
    native low-precision kernels everywhere, =0 emulates them everywhere (to
    measure the difference); unset, the CPU's features decide."""
    setting = os.environ.get("FLASHFORMER_NATIVE_LOW_PRECISION_MATMUL")
    if setting == "1":
        return frozenset()
    if setting == "0":
        return frozenset(LOW_PRECISION)
    return frozenset(dtype for dtype in LOW_PRECISION if not cpu_has_matrix_units(dtype))


# The low-precision dtypes whose CPU matmuls are computed in float32 (tests set it
# to force one path, so that the same code is tested on every CPU).
EMULATED_LOW_PRECISION: frozenset[torch.dtype] = _emulated_dtypes()


def attention_compute_dtype(q: Tensor) -> torch.dtype:
    """The dtype `attention(backend="auto")` computes in: float32 for bf16/fp16
    on a CPU that emulates them (a widening, exact), else q's own. Float32 SDPA
    is then the fastest exact path; the output returns to q's dtype."""
    if q.device.type == "cpu" and q.dtype in EMULATED_LOW_PRECISION:
        return torch.float32
    return q.dtype


class _LowPrecisionLinear(torch.autograd.Function):
    """x @ W^T + b in bf16/fp16 semantics, computed by a float32 GEMM.

    The operands are rounded to the low precision first, exactly as autocast
    rounds them. A product of two bf16 (or fp16) numbers is exact in float32,
    and a bf16 GEMM accumulates in float32, so this computes the same numbers
    as a native low-precision GEMM, up to the order of summation; the output
    and the gradients are rounded back to the low precision as autocast's
    would be. What is saved for the backward pass stays in low precision.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
        x_low, weight_low = x.to(dtype), weight.to(dtype)
        bias32 = None if bias is None else bias.to(dtype).float()
        out = F.linear(x_low.float(), weight_low.float(), bias32)  # float32 GEMM of low-precision values
        ctx.save_for_backward(x_low, weight_low)
        ctx.dtype, ctx.x_dtype, ctx.has_bias = dtype, x.dtype, bias is not None
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x_low, weight_low = ctx.saved_tensors
        grad = grad_out.to(ctx.dtype).float()  # (*, out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad @ weight_low.float()).to(ctx.dtype).to(ctx.x_dtype)  # (*, in)
        if ctx.needs_input_grad[1]:
            grad_2d, x_2d = grad.reshape(-1, grad.shape[-1]), x_low.reshape(-1, x_low.shape[-1]).float()
            grad_w = (grad_2d.T @ x_2d).to(ctx.dtype).float()  # (out, in)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.dtype).float()
        return grad_x, grad_w, grad_b, None


FEW_ROWS = 128  # up to here (rows of x) the arrangement below beat F.linear; from 256 on it did not
ROW_BLOCKS = 16  # one-row products: W's rows in this many blocks, one bmm


def _few_rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x @ W^T + b for a few rows of x (decoding), on the CPU, without autograd.

    A decode step multiplies 1 to B rows by every weight matrix, so its time
    is the time to stream the weights from memory. For so few rows MKL runs
    F.linear's x @ W^T on one thread, well below the memory's bandwidth. Here:
    - 1 row: W's rows are cut into ROW_BLOCKS contiguous blocks and the
      products run as one bmm, which torch spreads over its threads (and whose
      blocks torch.compile's generated kernels follow). 2 to 16 blocks measured
      alike; 16 leaves room for more threads.
    - 2 to FEW_ROWS rows: out^T = W @ x^T, the same product with W as the left
      operand, which MKL runs as a threaded GEMM. The gain shrinks with the
      rows and is gone at 256.
    The sums are the same up to their order (float32 rounding).
    """
    rows, n_in = x.numel() // x.shape[-1], x.shape[-1]
    n_out = weight.shape[0]
    x2 = x.reshape(rows, n_in)  # (M, in)
    if rows == 1 and n_out >= 2 * ROW_BLOCKS:
        split = n_out - n_out % ROW_BLOCKS
        blocks = weight[:split].view(ROW_BLOCKS, split // ROW_BLOCKS, n_in)  # (blocks, out / blocks, in)
        out = torch.bmm(x2.expand(ROW_BLOCKS, 1, n_in), blocks.transpose(1, 2)).view(1, split)
        if split < n_out:
            out = torch.cat([out, x2 @ weight[split:].t()], dim=1)  # (1, out)
        if bias is not None:
            out += bias
    elif bias is not None:
        out = torch.addmm(bias[:, None], weight, x2.t()).t().contiguous()  # (M, out)
    else:
        out = torch.mm(weight, x2.t()).t().contiguous()  # (M, out)
    return out.view(*x.shape[:-1], n_out)


def _is_cpu_float32_inference(x: Tensor, weight: Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.is_contiguous()
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, with two CPU exceptions: under autocast to bf16/fp16 on a CPU
    that emulates them, the same numbers come from a float32 GEMM; and in
    float32 inference on a few rows (decoding), a faster arrangement of the
    same product (_few_rows_linear)."""
    if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        if dtype in EMULATED_LOW_PRECISION:
            with torch.autocast("cpu", enabled=False):
                return _LowPrecisionLinear.apply(x, weight, bias, dtype)
    elif 0 < x.numel() <= FEW_ROWS * x.shape[-1] and _is_cpu_float32_inference(x, weight):
        return _few_rows_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear through `linear`: same parameters, same results, the CPU paths above."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


# Inductor options for a decode step on the CPU. Such a step multiplies one
# row (or a few) by every weight matrix, so its time is the time to stream the
# weights; these remove what inductor adds around that.
CPU_DECODE_STEP_OPTIONS = {
    # Store every intermediate instead of recomputing it inside the loop that
    # reads it. By default inductor inlines a LayerNorm into the matrix-vector
    # product after it and normalizes the input again for each of the 2304 or
    # 3072 output rows, which more than halves that product's streaming speed.
    "realize_opcount_threshold": 1,
    # The code that calls the kernels in C++ instead of Python: its per-step
    # overhead was about a tenth of a GPT-2-small step. Costs compile time.
    "cpp_wrapper": True,
}


def cpu_decode_step_options() -> dict:
    """CPU_DECODE_STEP_OPTIONS and the vector width inductor generates code for, named.

    Inductor picks that width from ATEN_CPU_CAPABILITY (AVX2 forced on an AVX-512 CPU: 256
    bits), but its on-disk FX graph cache does not key on it: a process forced to AVX2 found
    the graph an AVX-512 process had cached, code written for 16-lane loops, and compiled it
    with AVX2's 8-lane vectors; half of each loop's indices were never computed and the
    step died on inductor's bounds check ("index out of bounds: 0 <= tmp7 < 65536", Gemma 3's
    embedding lookup; without that check it would have read garbage). cpp.simdlen is part of
    the cache key, and set to the width inductor would pick anyway it changes no code."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return {**CPU_DECODE_STEP_OPTIONS, "cpp.simdlen": pick_vec_isa().bit_width()}
