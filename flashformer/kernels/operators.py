"""flashformer's C++ operators, one row each in OPERATORS: the name, the schema, the fake (its
output's shapes, so torch.compile traces it), the PyTorch fallback that runs it where the C++
extension could not be built, and the code paths (machine.KERNEL_ISAS) quantized_kernel_isa
switches it between. The schemas are Python's: they exist whether or not the build succeeds, and
the C++ sources (csrc/) only implement them. Adding an operator is a row here and its C++.

    linear on a packed layout   int4_linear, int8_linear, int5_linear (csrc/quantized_cpu.cpp),
                                q4_k_linear, q5_k_linear, q6_k_linear (csrc/kquants_cpu.cpp): one
                                per row of layouts.LAYOUTS; used by quantized.QuantizedLinear
    quantized_kernel_isa        which code the ISA switch runs (extension.kernel_isa)
    kernels_ran                 which ISAs' code each family of kernels ran (extension.kernels_ran)
    packings                    the C++ table of packings (csrc/packings.h; native_decoder.packings)
    int8_residual               x's rounding error under int8 blocks: the int8x2 activations'
                                second x row (quantized.QuantizedLinear)
    paged_attention_cpu, attention_cpu   attention of a batch over a paged or a static KV cache
                                (csrc/paged_attention_cpu.cpp; attention/cpu_kernel.py calls them)

The native decoder (csrc/decoder_cpu.cpp) is a class, not an operator: its Python side is
native_decoder.py. extension.py builds and loads the C++ library, and registers the fallbacks
below when it cannot.

The fallbacks of the linears dequantize the weight FALLBACK_TILE_ROWS rows at a time (never
whole) and multiply in float32, whatever int8_activations asks: exact, slower, and not
batch-invariant. The attention operators have none: their callers ask extension.cpp_kernels()
first and take another backend without them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from flashformer.kernels.layouts import LAYOUTS, Layout

LIBRARY = torch.library.Library("flashformer", "FRAGMENT")
FALLBACK_TILE_ROWS = 1024  # output rows dequantized at a time by the linears' fallback
# the ISA switch's paths each family of kernels has: the linears run AMX's tiles for many x rows
# with int8 activations (quantized_amx.inc, kquants_amx.inc), VNNI's kernels otherwise; attention
# runs AVX-512's build on both (and widens q8_0 / q4_0 keys with AVX2's code on every vector ISA)
_LINEAR_ISAS = ("scalar", "avx2", "avx512-vnni", "amx-int8")
_ATTENTION_ISAS = ("scalar", "avx2", "avx512-vnni")


@dataclass(frozen=True)
class Operator:
    """One C++ operator, as Python declares it."""

    name: str
    schema: str  # "(arguments) -> results"
    fake: Callable | None  # its output's shapes, for torch.compile (None: it takes no tensors)
    fallback: Callable | None  # its PyTorch kernel without the extension (None: callers check first)
    isas: tuple[str, ...]  # the paths of the ISA switch it has (machine.KERNEL_ISAS)
    fallback_key: str = "CPU"  # the dispatch key the fallback registers under
    trainable: bool = True  # False: a backward raises (the linears' weights are integer buffers)


# ---- what the rows share ----


def no_backward(ctx, grad):
    raise RuntimeError(
        "flashformer's quantized linear layers have no backward pass: their weights are integer "
        "buffers. Train or fine-tune the float model, then quantize it."
    )


def tiled_linear(
    layout: Layout, x: Tensor, qweight: Tensor, scales: Tensor | None, bias, out_features: int
) -> Tensor:
    """x (M, K) @ W^T + bias with W, a `layout` weight, dequantized FALLBACK_TILE_ROWS rows at a
    time: a tile of groups with their scales (per block, per row, or none: the blocks hold them)."""
    out = x.new_empty(x.shape[0], out_features)  # (M, N)
    rows = layout.group_rows
    groups_per_tile = FALLBACK_TILE_ROWS // rows
    for g0 in range(0, qweight.shape[0], groups_per_tile):
        g1 = min(g0 + groups_per_tile, qweight.shape[0])
        if scales is None or scales.dim() != 1:
            tile_scales = None if scales is None else scales[g0:g1]
        else:
            tile_scales = scales[g0 * rows : g1 * rows]  # per row
        weight = layout.dequantize(qweight[g0:g1], tile_scales)  # (rows of the tile, K)
        n0, n1 = g0 * rows, min(g1 * rows, out_features)
        out[:, n0:n1] = x @ weight[: n1 - n0].t()
    return out if bias is None else out + bias


def _linear_out(x: Tensor, out_features: int) -> Tensor:
    return x.new_empty(x.shape[0], out_features)  # (M, N)


def _linear(layout: Layout) -> Operator:
    """A layout's linear: x (M, K) float32 -> (M, N). The K-quants' blocks hold their own scales."""
    if layout.in_place:
        return Operator(
            layout.op,
            "(Tensor x, Tensor blocks, Tensor? bias, int out_features, bool int8_activations) -> Tensor",
            lambda x, blocks, bias, out_features, int8_activations: _linear_out(x, out_features),
            lambda x, blocks, bias, out_features, int8_activations: tiled_linear(
                layout, x, blocks, None, bias, out_features
            ),
            _LINEAR_ISAS,
            trainable=False,
        )
    return Operator(
        layout.op,
        "(Tensor x, Tensor qweight, Tensor scales, Tensor? bias, int out_features, bool int8_activations) -> Tensor",
        lambda x, qweight, scales, bias, out_features, int8_activations: _linear_out(x, out_features),
        lambda x, qweight, scales, bias, out_features, int8_activations: tiled_linear(
            layout, x, qweight, scales, bias, out_features
        ),
        _LINEAR_ISAS,
        trainable=False,
    )


def _paged_attention_fake(
    q, k_pool, v_pool, block_tables, seq_lens, q_starts, scale, softcap, causal, alibi, padding, *window
):
    return q.new_empty(*q.shape[:2], v_pool.shape[3]), q.new_empty(q.shape[:2])  # (T, Hq, Dv), (T, Hq)


def _attention_fake(q, k, v, scale, softcap, causal, alibi, padding, *window):
    batch, q_heads, q_len, _ = q.shape
    dim_v = v.shape[3]  # the kernel's layout: (B, Lq, Hq, ...) in memory
    out = q.new_empty_strided(
        (batch, q_heads, q_len, dim_v), (q_len * q_heads * dim_v, dim_v, q_heads * dim_v, 1)
    )
    return out, q.new_empty_strided((batch, q_heads, q_len), (q_len * q_heads, 1, q_heads))


# ---- the table ----

OPERATORS = {
    op.name: op
    for op in (
        *(_linear(layout) for layout in LAYOUTS.values()),
        # no tensor arguments: dispatched to CompositeExplicitAutograd; -1 answers "the fallback"
        Operator(
            "quantized_kernel_isa",
            "(int request) -> int",
            None,
            lambda request: -1,
            (),
            "CompositeExplicitAutograd",
        ),
        Operator(
            "kernels_ran",
            "(bool reset) -> int[]",
            None,
            lambda reset: [],
            (),
            "CompositeExplicitAutograd",
        ),
        Operator(
            "packings",
            "() -> str[]",
            None,
            lambda: [],
            (),
            "CompositeExplicitAutograd",
        ),
        # the fallback linears multiply x in float32: it has no rounding error to add
        Operator(
            "int8_residual",
            "(Tensor x, int block) -> Tensor",
            lambda x, block: torch.empty_like(x),
            lambda x, block: torch.zeros_like(x),
            ("scalar", "avx2"),
        ),
        Operator(
            "paged_attention_cpu",
            "(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor seq_lens, Tensor q_starts, "
            "float scale, float softcap, bool causal, Tensor? alibi_slopes, Tensor? key_padding, "
            "int window_left, int window_right) -> (Tensor, Tensor)",
            _paged_attention_fake,
            None,
            _ATTENTION_ISAS,
        ),
        Operator(
            "attention_cpu",
            "(Tensor q, Tensor k, Tensor v, float scale, float softcap, bool causal, Tensor? alibi_slopes, "
            "Tensor? key_padding, int window_left, int window_right) -> (Tensor, Tensor)",
            _attention_fake,
            None,
            _ATTENTION_ISAS,
        ),
    )
}

for _op in OPERATORS.values():
    LIBRARY.define(_op.name + _op.schema)
    if _op.fake is not None:
        torch.library.register_fake(f"flashformer::{_op.name}", _op.fake, lib=LIBRARY)


def op(name: str):
    """The operator `name` to call: torch.ops.flashformer.<name>.default."""
    return getattr(torch.ops.flashformer, name).default


def register_fallbacks() -> None:
    """Give every operator with a fallback its PyTorch kernel (extension.load, without the C++).
    (The C++ library registers its own no-backward kernels: a Python autograd registration costs
    a call's time even under no_grad.)"""
    for row in OPERATORS.values():
        if row.fallback is None:
            continue
        LIBRARY.impl(row.name, row.fallback, row.fallback_key)
        if not row.trainable:
            torch.library.register_autograd(
                f"flashformer::{row.name}",
                no_backward,
                setup_context=lambda ctx, inputs, output: None,
                lib=LIBRARY,
            )
