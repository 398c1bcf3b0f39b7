"""Weight-only quantized linear layers and embeddings for decoding on the CPU.

The weights are stored as small integers in blocks along the input dim and stay so in memory,
in one of the packed layouts of layouts.py; the activations stay float32 at the module's
boundary. A float weight is quantized to "int4" (llama.cpp's Q4_1 rule) or "int8" (per-row
scales); a GGUF tensor of a type block_types.py serves (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K) keeps its blocks, repacked byte for byte or used in place, never re-rounded.

`QuantizedLinear(x)` computes x @ W^T + b with a C++ kernel (csrc/quantized_cpu.cpp,
kquants_cpu.cpp) that streams the packed bytes and widens them in registers: a decode step's time
is the time to read the weights, and 4-bit blocks are 0.625 bytes a weight instead of 4. By
default the kernel also quantizes x to int8 per block of 32 (as llama.cpp does; per block of
256 for the K-quants, as its Q8_K) and sums integer products; with activations="float32" it keeps
x in float32 and is exact with respect to the dequantized weights. Either way a row's result does
not depend on the other rows of its batch.

The kernels are compiled at first use (kernels/extension.py); without a compiler, or with
FLASHFORMER_QUANTIZED_KERNELS=torch, the same operators run as PyTorch code that dequantizes
the weights tile by tile (operators.py): exact, slower, announced by one warning.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashformer.kernels import extension, gguf_blocks
from flashformer.kernels.block_types import GGUF_TYPES as GGUF_TYPES
from flashformer.kernels.block_types import parse_gguf_blocks
from flashformer.kernels.extension import kernel_isa as kernel_isa
from flashformer.kernels.layouts import (
    BLOCK,
    LAYOUTS,
    pack_int4,
    pack_int8,
    quantize_int8_per_row,
    quantize_q4_1,
)
from flashformer.kernels.machine import KERNEL_ISAS as KERNEL_ISAS
from flashformer.kernels.operators import op

GROUP_ROWS = {name: layout.group_rows for name, layout in LAYOUTS.items()}
FORMATS = ("int4", "int8")  # what a float weight is quantized to
PACKED_FORMATS = tuple(LAYOUTS)  # what a layer holds
# formats whose layout is GGUF's own, row after row: a layer holds the file's bytes, mapped, not a
# copy. The others interleave rows (8 or 4 to a group) for their kernels: repacked at load.
IN_PLACE_FORMATS = tuple(name for name, layout in LAYOUTS.items() if layout.in_place)
BLOCK_VALUES = {name: layout.block_values for name, layout in LAYOUTS.items()}
# what a layer's x is multiplied as: int8 blocks, int8x2 (x and its int8 rounding error, each in
# int8 blocks, two x rows of one product added: ~15 bits of x, csrc/products.h), or float32; the
# C++ code of each (csrc/products.h's Activations)
ACTIVATIONS = ("int8", "int8x2", "float32")
ACTIVATION_CODES = {"float32": 0, "int8": 1, "int8x2": 2}

load_kernels = extension.load


def _linear_op(fmt: str):
    """The format's operator, called as (x, qweight, scales, bias, out_features, int8_activations)."""
    call = op(LAYOUTS[fmt].op)
    if not LAYOUTS[fmt].in_place:
        return call

    def blocks_call(x, qweight, scales, bias, out_features, int8_activations):
        # scales: None, the blocks hold them
        return call(x, qweight, bias, out_features, int8_activations)

    return blocks_call


_LINEAR_OPS = {fmt: _linear_op(fmt) for fmt in LAYOUTS}
_INT8_RESIDUAL = op("int8_residual")  # (x (M, K), block) -> x - d q under int8 blocks of `block`


def _quantize_float(weight: Tensor, mode: str) -> tuple[Tensor, Tensor]:
    if mode not in FORMATS:
        raise ValueError(f"mode: expected one of {FORMATS}, got {mode!r}")
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        got = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"weight: expected a 2-D float tensor (out_features, in_features), got {got}")
    if mode == "int4":
        if weight.shape[1] % BLOCK:
            raise ValueError(
                f"weight: int4 needs in_features a multiple of {BLOCK}, got weight of shape {tuple(weight.shape)}"
            )
        return pack_int4(*quantize_q4_1(weight))
    return pack_int8(*quantize_int8_per_row(weight))


def _dequantize(fmt: str, qweight: Tensor, scales: Tensor | None) -> Tensor:
    """The float32 weight (padded rows and columns included) of a packed layout."""
    return LAYOUTS[fmt].dequantize(qweight, scales)


def _keep_dtypes(module: nn.Module, fn, recurse: bool, apply) -> nn.Module:
    """nn.Module._apply that lets model.half() / .float() / .to(dtype) move the packed buffers
    but not cast them: their dtypes are the format (float16 block scales, float32 row scales and
    bias), and a cast and back would not even give the same values."""
    before = dict(module._buffers)
    apply(fn, recurse)
    for name, buffer in module._buffers.items():
        if buffer is not None and buffer.dtype != before[name].dtype:
            module._buffers[name] = before[name].to(device=buffer.device)
    return module


# ---- modules ----


class QuantizedLinear(nn.Module):
    """y = x @ W^T + b with W stored quantized (see the module docstring), for inference.

    x: float32 (..., in_features) on the CPU -> (..., out_features). activations="int8" (default)
    quantizes x per block of 32 inside the kernel, as llama.cpp does; "int8x2" adds the product of
    x's rounding error (in int8 too: ~15 bits of x, at the cost of a second x row); "float32"
    keeps it exact. The weights are buffers, not parameters: they have no gradient; x has one
    (through the dequantized weight) where it needs one, for an adapter trained beside a quantized base.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        fmt: str,
        qweight: Tensor,
        scales: Tensor,
        bias: Tensor | None = None,
        activations: str = "int8",
    ):
        super().__init__()
        if fmt not in PACKED_FORMATS:
            raise ValueError(f"fmt: expected one of {PACKED_FORMATS}, got {fmt!r}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations: expected one of {ACTIVATIONS}, got {activations!r}")
        groups = -(-out_features // GROUP_ROWS[fmt])
        block = BLOCK_VALUES[fmt]
        padded_in = -(-in_features // block) * block
        if qweight.shape[:2] != (groups, padded_in // block):
            raise ValueError(
                f"qweight: expected ({groups}, {padded_in // block}, ...) for a ({out_features}, {in_features}) "
                f"weight, got {tuple(qweight.shape)}"
            )
        if bias is not None and (bias.shape != (out_features,) or not bias.is_floating_point()):
            raise ValueError(
                f"bias: expected a float tensor of shape ({out_features},), got {tuple(bias.shape)}"
            )
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.activations = activations
        self.int8_activations = activations != "float32"  # what the kernels read x as
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._pad_in = padded_in - in_features
        load_kernels()

    @classmethod
    def from_float(
        cls,
        linear_or_weight: nn.Linear | Tensor,
        mode: str,
        *,
        bias: Tensor | None = None,
        activations: str = "int8",
    ) -> QuantizedLinear:
        """Quantize an nn.Linear (its bias kept in float32) or a weight (out_features, in_features).
        mode "int4": llama.cpp's Q4_1 rule (in_features a multiple of 32); "int8": per-row scales."""
        if isinstance(linear_or_weight, nn.Linear):
            weight, bias = linear_or_weight.weight, linear_or_weight.bias if bias is None else bias
        else:
            weight = linear_or_weight
        qweight, scales = _quantize_float(weight, mode)
        out_features, in_features = weight.shape
        return cls(in_features, out_features, mode, qweight, scales, bias, activations)

    @classmethod
    def from_gguf_blocks(
        cls,
        type_name: str,
        raw_uint8_blocks,
        shape: tuple[int, int],
        *,
        bias: Tensor | None = None,
        activations: str = "int8",
    ) -> QuantizedLinear:
        """A GGUF tensor's bytes (a type of GGUF_TYPES), repacked as they are (see parse_gguf_blocks).
        shape: (out_features, in_features), the reverse of GGUF's ne."""
        fmt, qweight, scales = parse_gguf_blocks(type_name, raw_uint8_blocks, shape)
        return cls(shape[1], shape[0], fmt, qweight, scales, bias, activations)

    @classmethod
    def from_embedding(cls, embedding: QuantizedEmbedding, activations: str = "int8") -> QuantizedLinear:
        """The output head tied to a quantized embedding: the same packed bytes, not a copy."""
        return cls(
            embedding.embedding_dim,
            embedding.num_embeddings,
            embedding.fmt,
            embedding.qweight,
            embedding.scales,
            None,
            activations,
        )

    @classmethod
    def cat(cls, linears: list[QuantizedLinear]) -> QuantizedLinear | ConcatenatedLinear:
        """One layer computing several that read the same x (q, k, v; gate and up): their rows
        stacked, the same bytes. One call instead of several saves a call's fixed cost and a pass
        over x (docs/benchmarks.md, "Packed layouts"); torch.split the output to get the parts.
        Every part but the last needs out_features a multiple of the rows per packed group
        (8 for int4 and int5, 4 for int8). Parts of different formats (a Q4_K_M file's Q5_0 q
        and k beside a Q8_0 v) cannot share a kernel: each run of one format is fused, and a
        ConcatenatedLinear joins the runs' outputs. K-quant parts are never stacked: their bytes
        are a GGUF file's own, used in place from its map, and a stack would copy them (the
        native decoder runs a ConcatenatedLinear's parts as one projection all the same)."""
        first = linears[0]
        for i, lin in enumerate(linears):
            if (lin.in_features, lin.activations) != (first.in_features, first.activations):
                raise ValueError(
                    f"linears[{i}]: {lin.extra_repr()} does not match linears[0]: {first.extra_repr()}"
                )
        runs = [[first]]
        for lin in linears[1:]:
            if _packing(lin) == _packing(runs[-1][-1]) and lin.fmt not in IN_PLACE_FORMATS:
                runs[-1].append(lin)
            else:
                runs.append([lin])
        if len(runs) > 1:
            return ConcatenatedLinear([run[0] if len(run) == 1 else cls.cat(run) for run in runs])
        if first.fmt in IN_PLACE_FORMATS:
            return first
        for i, lin in enumerate(linears[:-1]):
            if lin.out_features % GROUP_ROWS[lin.fmt]:
                raise ValueError(
                    f"linears[{i}]: out_features={lin.out_features} is not a multiple of {GROUP_ROWS[lin.fmt]}"
                    f" ({lin.fmt}'s rows per group); put it last"
                )
        bias = None
        if any(lin.bias is not None for lin in linears):
            bias = torch.cat(
                [
                    lin.bias
                    if lin.bias is not None
                    else lin.qweight.new_zeros(lin.out_features, dtype=torch.float32)
                    for lin in linears
                ]
            )
        scales = None if first.scales is None else torch.cat([lin.scales for lin in linears])
        return cls(
            first.in_features,
            sum(lin.out_features for lin in linears),
            first.fmt,
            torch.cat([lin.qweight for lin in linears]),
            scales,
            bias,
            first.activations,
        )

    def _apply(self, fn, recurse=True):
        return _keep_dtypes(self, fn, recurse, super()._apply)

    def dequantize(self) -> Tensor:
        """The float32 weight (out_features, in_features) the kernels multiply by (up to the
        rounding of their sums)."""
        return _dequantize(self.fmt, self.qweight, self.scales)[: self.out_features, : self.in_features]

    def forward(self, x: Tensor) -> Tensor:
        if x.requires_grad and torch.is_grad_enabled():  # an adapter trained beside a frozen base
            return _InputGradient.apply(x, self)
        return self._product(x)

    def _product(self, x: Tensor) -> Tensor:
        if x.dtype != torch.float32 or not x.is_cpu:
            raise ValueError(
                f"x: expected a float32 CPU tensor, got {x.dtype} on {x.device} (shape {tuple(x.shape)})"
            )
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"x: expected shape (..., {self.in_features}) for in_features={self.in_features}, got {tuple(x.shape)}"
            )
        x2 = x.reshape(-1, self.in_features)  # (M, in)
        if self._pad_in:  # int8 rows padded with zero weights to whole blocks
            x2 = F.pad(x2, (0, self._pad_in))
        op = _LINEAR_OPS[self.fmt]  # the format's kernel, fixed at construction
        if self.activations == "int8x2":
            out = self._int8x2(op, x2)
        else:
            out = op(
                x2, self.qweight, self.scales, self.bias, self.out_features, self.int8_activations
            )  # (M, out)
        return out.view(*x.shape[:-1], self.out_features)

    def _int8x2(self, op, x2: Tensor) -> Tensor:
        """x @ W^T as x's int8 product plus its rounding error's: the rows [x; x - d q] in one call
        (their weights read once), the two halves added, then the bias, as the native decoder's head."""
        rows = x2.shape[0]
        residual = _INT8_RESIDUAL(x2, BLOCK_VALUES[self.fmt])  # (M, in): x - d q
        both = op(torch.cat([x2, residual]), self.qweight, self.scales, None, self.out_features, True)
        out = both[:rows] + both[rows:]  # (M, out)
        return out if self.bias is None else out.add_(self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
            f"activations={self.activations}, bias={self.bias is not None}"
        )


class _InputGradient(torch.autograd.Function):
    """A quantized layer's product with a gradient for its input alone: grad (..., out) @ W, W
    dequantized in the backward (as QLoRA does). The weight stays frozen (integer buffers have no
    gradient), but a LoRA adapter trained beside the base needs the gradient to flow back through
    the layers after it. Inference never comes here (its inputs need no gradient)."""

    @staticmethod
    def forward(ctx, x: Tensor, layer: QuantizedLinear) -> Tensor:
        ctx.layer = layer
        return layer._product(x)  # (..., out)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad @ ctx.layer.dequantize(), None  # (..., in)


def _packing(lin: QuantizedLinear) -> tuple:
    """What layers must share to be stacked into one: the format and its kind of scales."""
    return lin.fmt, None if lin.scales is None else lin.scales.dim()


class ConcatenatedLinear(nn.Module):
    """Quantized layers of different formats reading the same x, as one layer: their outputs
    joined along the last dim (QuantizedLinear.cat makes it where formats differ), plus an
    optional bias over the whole output."""

    def __init__(self, parts: list[QuantizedLinear]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)
        self.register_buffer("bias", None)

    def forward(self, x: Tensor) -> Tensor:
        out = torch.cat([part(x) for part in self.parts], dim=-1)  # (..., out_features)
        return out if self.bias is None else out + self.bias

    def dequantize(self) -> Tensor:
        return torch.cat([part.dequantize() for part in self.parts])


class QuantizedEmbedding(nn.Module):
    """An embedding table stored quantized: ids (...) -> float32 (..., embedding_dim), the rows
    gathered and dequantized. `QuantizedLinear.from_embedding` makes the tied output head."""

    def __init__(self, num_embeddings: int, embedding_dim: int, fmt: str, qweight: Tensor, scales: Tensor):
        super().__init__()
        if fmt not in PACKED_FORMATS:
            raise ValueError(f"fmt: expected one of {PACKED_FORMATS}, got {fmt!r}")
        self.num_embeddings, self.embedding_dim, self.fmt = num_embeddings, embedding_dim, fmt
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    @classmethod
    def from_float(cls, embedding_or_weight: nn.Embedding | Tensor, mode: str) -> QuantizedEmbedding:
        weight = (
            embedding_or_weight.weight
            if isinstance(embedding_or_weight, nn.Embedding)
            else embedding_or_weight
        )
        qweight, scales = _quantize_float(weight, mode)
        return cls(weight.shape[0], weight.shape[1], mode, qweight, scales)

    @classmethod
    def from_gguf_blocks(cls, type_name: str, raw_uint8_blocks, shape: tuple[int, int]) -> QuantizedEmbedding:
        """shape: (num_embeddings, embedding_dim), the reverse of GGUF's ne."""
        fmt, qweight, scales = parse_gguf_blocks(type_name, raw_uint8_blocks, shape)
        return cls(shape[0], shape[1], fmt, qweight, scales)

    def _apply(self, fn, recurse=True):
        return _keep_dtypes(self, fn, recurse, super()._apply)

    def dequantize(self) -> Tensor:
        return _dequantize(self.fmt, self.qweight, self.scales)[: self.num_embeddings, : self.embedding_dim]

    def forward(self, ids: Tensor) -> Tensor:
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"ids: expected an integer tensor, got {ids.dtype} (shape {tuple(ids.shape)})")
        flat = ids.reshape(-1).long()  # (L,)
        if self.fmt in IN_PLACE_FORMATS:
            rows = LAYOUTS[self.fmt].dequantize(self.qweight[flat], None)  # (L, dim)
            return rows.reshape(*ids.shape, -1)[..., : self.embedding_dim]
        if self.fmt == "int5":
            return gguf_blocks.int5_rows(self.qweight, self.scales, flat).reshape(*ids.shape, -1)[
                ..., : self.embedding_dim
            ]
        group, row = flat // GROUP_ROWS[self.fmt], flat % GROUP_ROWS[self.fmt]
        q = self.qweight[group, :, row]  # (L, blocks, 16 or 32): each id's row of its group
        if self.fmt == "int4":
            q = torch.cat((q & 15, q >> 4), dim=-1).float()  # (L, blocks, 32)
            d, m = self.scales[group, :, :, row].float().unbind(-1)  # (L, blocks) each
            rows = d[..., None] * q + m[..., None]
        elif self.scales.dim() == 1:
            rows = q.float() * self.scales[flat, None, None]
        else:
            rows = q.float() * self.scales[group, :, row].float()[..., None]
        return rows.reshape(*ids.shape, -1)[..., : self.embedding_dim]  # (..., dim)
