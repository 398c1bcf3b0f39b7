"""Weight-only quantized linear layers and embeddings for decoding on the CPU.

The weights are stored as small integers in blocks of 32 along the input dim and stay so in
memory; the activations stay float32 at the module's boundary. Two formats:

- "int4": GGUF's Q4_1 block, weight = d * q + m with q in 0..15 and d, m float16 per block.
  Q4_0 (weight = d * (q - 8)) is the same with m = -8 d. A GGUF Q4_0/Q4_1 tensor is repacked
  byte for byte, never re-rounded; a float weight is quantized with llama.cpp's Q4_1 rule.
- "int8": weight = s * q, q in int8, with s float16 per block of 32 (GGUF Q8_0, as stored) or
  float32 per output row (a float weight quantized here).

and, from GGUF files only (gguf_blocks.py describes their layouts): "int5" (Q5_0 / Q5_1, int4
with a fifth bit) and "q4_k", "q5_k", "q6_k" (the K-quants' blocks of 256, as the file stores
them; with int8 activations x is quantized per block of 256, as llama.cpp's Q8_K).

`QuantizedLinear(x)` computes x @ W^T + b with a C++ kernel (csrc/quantized_cpu.cpp) that
streams the packed bytes and widens them in registers: a decode step's time is the time to read
the weights, and 4-bit blocks are 0.625 bytes a weight instead of 4. By default the kernel also
quantizes x to int8 per block of 32 (as llama.cpp does) and sums integer products; with
activations="float32" it keeps x in float32 and is exact with respect to the dequantized weights.
Either way a row's result does not depend on the other rows of its batch.

The kernels are compiled at first use (kernels/extension.py); without a compiler, or with
FLASHFORMER_QUANTIZED_KERNELS=torch, the same operators run as PyTorch code that dequantizes
the weights tile by tile: exact, slower, announced by one warning.

Packed layout (the kernels read it; `dequantize()` undoes it): output rows in groups of 8 (int4)
or 4 (int8), padded with zero rows; for each group and block of 32 inputs the group's quants are
adjacent, so that a group is read as one sequential stream:
    int4: qweight uint8 (groups, blocks, 8, 16), GGUF's nibble order (byte j: q[j] low, q[j+16] high)
          scales float16 (groups, blocks, 2, 8): the 8 rows' d, then their m
    int8: qweight int8 (groups, blocks, 4, 32)
          scales float16 (groups, blocks, 4) per block, or float32 (groups * 4,) per row
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashformer.kernels import extension, gguf_blocks
from flashformer.kernels.gguf_blocks import KQUANT_FORMATS, SUPER_BLOCK
from flashformer.kernels.machine import KERNEL_ISAS

BLOCK = 32  # values per quantization block along the input dim (GGUF's QK4_0, QK4_1, QK8_0)
# Output rows interleaved in the packed layout: 8 for int4, whose one-row kernel reads 8 rows per
# block (the x block's loads and scale shared by 8 rows) as one sequential stream, which the
# hardware prefetches best (docs/benchmarks.md, "Packed layouts"). 4 for int8: 4 rows x 32 bytes
# are already a 128-byte sequential block.
# int5 as int4; the K-quants are not interleaved: a row's blocks are one sequential stream already.
GROUP_ROWS = {"int4": 8, "int8": 4, "int5": 8, "q4_k": 1, "q5_k": 1, "q6_k": 1}
FORMATS = ("int4", "int8")  # what a float weight is quantized to
PACKED_FORMATS = tuple(GROUP_ROWS)  # what a layer holds
# formats whose layout is GGUF's own, row after row: a layer holds the file's bytes, mapped, not a
# copy. The others interleave rows (8 or 4 to a group) for their kernels: repacked at load.
IN_PLACE_FORMATS = tuple(KQUANT_FORMATS.values())
BLOCK_VALUES = {fmt: SUPER_BLOCK if fmt in KQUANT_FORMATS.values() else BLOCK for fmt in PACKED_FORMATS}
GGUF_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
ACTIVATIONS = ("int8", "float32")
FALLBACK_TILE_ROWS = 1024  # output rows dequantized at a time by the PyTorch fallback

# ---- the operators (schemas in extension.py): shapes for torch.compile, no backward ----

_LIBRARY = extension.LIBRARY
load_kernels = extension.load


def _linear_fake(x, qweight, scales, bias, out_features, int8_activations):
    return x.new_empty(x.shape[0], out_features)


def _no_backward(ctx, grad):
    raise RuntimeError(
        "flashformer's quantized linear layers have no backward pass: their weights are integer "
        "buffers. Train or fine-tune the float model, then quantize it."
    )


for _name in ("int4_linear", "int8_linear"):
    torch.library.register_fake(f"flashformer::{_name}", _linear_fake, lib=_LIBRARY)
_LINEAR_OPS = {
    "int4": torch.ops.flashformer.int4_linear.default,
    "int8": torch.ops.flashformer.int8_linear.default,
    "int5": gguf_blocks.INT5_OP,
}


def _kquant_op(fmt: str):
    op = gguf_blocks.KQUANT_OPS[fmt]

    def call(x, qweight, scales, bias, out_features, int8_activations):  # scales: None, the blocks hold them
        return op(x, qweight, bias, out_features, int8_activations)

    return call


_LINEAR_OPS |= {fmt: _kquant_op(fmt) for fmt in KQUANT_FORMATS.values()}


def kernel_isa(request: int | str = -1) -> str:
    """Which code runs the operators: one of KERNEL_ISAS (the C++ kernels) or "torch" (the fallback).
    request (a name or its index) switches the C++ kernels to that code, or the best below it
    this CPU has; "best" switches to the best this CPU has (FLASHFORMER_CPU_ISA chose the path at
    load). Tests compare them: all give the same bits."""
    load_kernels()
    if isinstance(request, str):
        request = len(KERNEL_ISAS) - 1 if request == "best" else KERNEL_ISAS.index(request)
    isa = torch.ops.flashformer.quantized_kernel_isa(request)
    return "torch" if isa < 0 else KERNEL_ISAS[isa]


@extension.on_fallback
def _register_fallback() -> None:
    """The operators' kernels in Python. (The C++ library registers its own no-backward kernel:
    a Python autograd registration costs a call's time even under no_grad.)"""
    for name, dequantize in (("int4_linear", dequantize_int4), ("int8_linear", dequantize_int8)):
        _LIBRARY.impl(name, functools.partial(_linear_fallback, dequantize), "CPU")
        torch.library.register_autograd(
            f"flashformer::{name}", _no_backward, setup_context=lambda ctx, inputs, output: None, lib=_LIBRARY
        )
    _LIBRARY.impl("quantized_kernel_isa", lambda request: -1, "CompositeExplicitAutograd")


def _linear_fallback(dequantize, x, qweight, scales, bias, out_features, int8_activations) -> Tensor:
    """The operators in PyTorch: x (M, K) @ W^T with W dequantized FALLBACK_TILE_ROWS rows at a
    time, never whole. x stays float32 whatever int8_activations asks (exact, not batch-invariant)."""
    out = x.new_empty(x.shape[0], out_features)  # (M, N)
    rows = qweight.shape[2]  # per group
    groups_per_tile = FALLBACK_TILE_ROWS // rows
    for g0 in range(0, qweight.shape[0], groups_per_tile):
        g1 = min(g0 + groups_per_tile, qweight.shape[0])
        tile_scales = scales[g0 * rows : g1 * rows] if scales.dim() == 1 else scales[g0:g1]
        weight = dequantize(qweight[g0:g1], tile_scales)  # (rows of the tile, K)
        n0, n1 = g0 * rows, min(g1 * rows, out_features)
        out[:, n0:n1] = x @ weight[: n1 - n0].t()
    if bias is not None:
        out += bias
    return out


# ---- packing and dequantization ----


def pack_int4(d: Tensor, m: Tensor, nibbles: Tensor) -> tuple[Tensor, Tensor]:
    """GGUF Q4_1 fields of N rows -> the packed layout. d, m: float16 (N, blocks);
    nibbles: uint8 (N, blocks, 16) in GGUF's order. Returns qweight (G, blocks, 8, 16) uint8
    and scales (G, blocks, 2, 8) float16, rows padded with zeros to G * 8."""
    n, blocks = d.shape
    rows = GROUP_ROWS["int4"]
    pad = -n % rows
    groups = (n + pad) // rows
    nibbles = F.pad(nibbles, (0, 0, 0, 0, 0, pad)).view(groups, rows, blocks, 16)
    qweight = nibbles.permute(0, 2, 1, 3).contiguous()  # (G, blocks, 8, 16)
    dm = torch.stack((d, m)).view(torch.int16)  # F.pad has no float16 kernel on every build
    dm = F.pad(dm, (0, 0, 0, pad)).view(2, groups, rows, blocks)
    scales = dm.permute(1, 3, 0, 2).contiguous().view(torch.float16)  # (G, blocks, 2, 8)
    return qweight, scales


def pack_int5(d: Tensor, m: Tensor, nibbles: Tensor, words: Tensor) -> tuple[Tensor, Tensor]:
    """Q5_1 fields of N rows (d, m, nibbles as pack_int4's; words int32 (N, blocks): the fifth
    bits, gguf_blocks.fifth_bit_words) -> qweight (G, blocks, 160) uint8, scales as int4's."""
    nibble_blocks, scales = pack_int4(d, m, nibbles)  # (G, blocks, 8, 16)
    groups, blocks = nibble_blocks.shape[:2]
    rows = GROUP_ROWS["int5"]
    words = F.pad(words, (0, 0, 0, groups * rows - words.shape[0])).view(groups, rows, blocks)
    word_bytes = words.permute(0, 2, 1).contiguous().view(torch.uint8)  # (G, blocks, 32)
    return torch.cat((nibble_blocks.reshape(groups, blocks, 128), word_bytes), dim=-1), scales


def pack_int8(q: Tensor, scales: Tensor) -> tuple[Tensor, Tensor]:
    """int8 quants (N, blocks, 32) and their scales, float16 (N, blocks) per block or float32 (N,)
    per row -> qweight (G, blocks, 4, 32) int8 and scales (G, blocks, 4) or (G * 4,)."""
    n, blocks, _ = q.shape
    rows = GROUP_ROWS["int8"]
    pad = -n % rows
    groups = (n + pad) // rows
    # one copy from q's layout (a strided view of a file's blocks) into the groups: 0.3 s for a
    # 262k-row embedding, where making q contiguous, padding and permuting took three (0.6 s)
    source = F.pad(q, (0, 0, 0, 0, 0, pad)) if pad else q
    qweight = torch.empty(groups, blocks, rows, BLOCK, dtype=torch.int8)
    qweight.copy_(source.view(groups, rows, blocks, BLOCK).permute(0, 2, 1, 3))
    if scales.dim() == 1:
        return qweight, F.pad(scales, (0, pad))
    per_block = F.pad(scales.view(torch.int16), (0, 0, 0, pad)).view(groups, rows, blocks)
    return qweight, per_block.permute(0, 2, 1).contiguous().view(torch.float16)


def dequantize_int4(qweight: Tensor, scales: Tensor) -> Tensor:
    """Packed int4 -> float32 (G * 8, K): d * q + m, rounded as gguf's dequantizer rounds it."""
    groups, blocks, rows = qweight.shape[:3]
    q = torch.stack((qweight & 15, qweight >> 4), dim=3).view(groups, blocks, rows, BLOCK).float()
    d, m = scales.float().unbind(2)  # (G, blocks, 8) each
    weight = d[..., None] * q + m[..., None]  # (G, blocks, 8, 32)
    return weight.permute(0, 2, 1, 3).reshape(groups * rows, blocks * BLOCK)


def dequantize_int8(qweight: Tensor, scales: Tensor) -> Tensor:
    """Packed int8 -> float32 (G * 4, K): q * s, per block (float16 scales) or per row (float32)."""
    groups, blocks, rows = qweight.shape[:3]
    q = qweight.permute(0, 2, 1, 3).reshape(groups * rows, blocks, BLOCK).float()  # (N, blocks, 32)
    if scales.dim() == 1:
        return (q * scales[:, None, None]).view(groups * rows, blocks * BLOCK)
    s = scales.float().permute(0, 2, 1).reshape(groups * rows, blocks, 1)
    return (q * s).view(groups * rows, blocks * BLOCK)


def quantize_q4_1(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """A float weight (N, K) -> GGUF Q4_1 fields (d, m float16 (N, K/32), nibbles uint8 (N, K/32, 16)),
    with llama.cpp's rule (quantize_row_q4_1_ref; gguf.quants does the same): per block,
    d = (max - min) / 15, q = trunc((x - min) / d + 0.5) clipped to 0..15 with 1/d and d in
    float32, then d and m = min stored as float16. Every step is a float32 operation of its own,
    as there, so the bytes are the same."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    low = blocks.amin(dim=-1, keepdim=True)
    d = (blocks.amax(dim=-1, keepdim=True) - low) / 15
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc((blocks - low) * inverse + 0.5).clamp(0, 15).to(torch.uint8)  # (N, blocks, 32)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    return d.squeeze(-1).half(), low.squeeze(-1).half(), nibbles


def quantize_int8_per_row(weight: Tensor) -> tuple[Tensor, Tensor]:
    """A float weight (N, K) -> int8 quants (N, K/32, 32) (K zero-padded to a multiple of 32)
    and float32 scales (N,): s = max|w| / 127 per row, q = round(w / s), half to even."""
    n, k = weight.shape
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127  # (N,)
    q = torch.round(w / torch.where(scale == 0, torch.ones_like(scale), scale)[:, None]).clamp(-127, 127)
    q = F.pad(q.to(torch.int8), (0, -k % BLOCK))
    return q.view(n, -1, BLOCK), scale


def parse_gguf_blocks(type_name: str, raw, shape: tuple[int, int]) -> tuple[str, Tensor, Tensor | None]:
    """Raw GGUF blocks of a (N, K) tensor (torch order: GGUF's ne reversed) -> (format, qweight, scales).

    raw: the tensor's bytes (uint8, any shape: gguf.GGUFReader's tensor.data is (N, bytes per row);
    a numpy array is copied, GGUFReader's are read-only views of the mapped file; a torch tensor
    is used as it is). Q4_0 becomes Q4_1 with m = -8 d and Q5_0 Q5_1 with m = -16 d, exact in
    float16 (multiplications by powers of two). K-quants keep their bytes (scales None)."""
    if type_name not in GGUF_TYPES:
        raise ValueError(f"type_name: expected one of {GGUF_TYPES}, got {type_name!r}")
    n, k = _check_shape("shape", shape)
    block = SUPER_BLOCK if type_name in KQUANT_FORMATS else BLOCK
    if k % block:
        raise ValueError(
            f"shape: in_features must be a multiple of {block} for {type_name}, got shape {tuple(shape)}"
        )
    data = gguf_blocks.to_bytes(raw)
    block_bytes = {
        "Q4_0": 18,
        "Q4_1": 20,
        "Q5_0": 22,
        "Q5_1": 24,
        "Q8_0": 34,
        "Q4_K": 144,
        "Q5_K": 176,
        "Q6_K": 210,
    }
    block_bytes = block_bytes[type_name]
    blocks = k // block
    if data.numel() != n * blocks * block_bytes:
        raise ValueError(
            f"raw_uint8_blocks: a {type_name} tensor of shape {tuple(shape)} takes {n * blocks * block_bytes} "
            f"bytes ({n} x {blocks} blocks of {block_bytes}), got {data.numel()} (shape {tuple(data.shape)})"
        )
    if type_name in KQUANT_FORMATS:
        # the bytes as given, not a copy: a GGUF file's own, used in place from its map (the
        # loader unmaps the pages it read to repack the other types, which a copy once did:
        # checkpoints.gguf.header.FileMapping.drop_resident_pages)
        return KQUANT_FORMATS[type_name], gguf_blocks.parse_kquant(type_name, data, n, k), None
    if type_name in ("Q5_0", "Q5_1"):
        return ("int5", *pack_int5(*gguf_blocks.parse_int5(type_name, data, n, blocks)))
    data = data.reshape(n, blocks, block_bytes)
    d = data[..., :2].contiguous().view(torch.float16).squeeze(-1)  # (N, blocks)
    if type_name == "Q8_0":
        return ("int8", *pack_int8(data[..., 2:].view(torch.int8), d))  # quants (N, blocks, 32), strided
    if type_name == "Q4_1":
        m = data[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
        return ("int4", *pack_int4(d, m, data[..., 4:]))
    m = d * -8
    if not torch.isfinite(m).all():
        raise ValueError("raw_uint8_blocks: a Q4_0 scale d is too large for m = -8 d in float16")
    return ("int4", *pack_int4(d, m, data[..., 2:]))


def _check_shape(name: str, shape) -> tuple[int, int]:
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"{name}: expected (out_features, in_features), both >= 1, got {tuple(shape)}")
    return int(shape[0]), int(shape[1])


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


_DEQUANTIZE = {
    "int4": dequantize_int4,
    "int8": dequantize_int8,
    "int5": gguf_blocks.dequantize_int5,
} | {fmt: functools.partial(gguf_blocks.dequantize_kquant, fmt) for fmt in KQUANT_FORMATS.values()}


def _dequantize(fmt: str, qweight: Tensor, scales: Tensor | None) -> Tensor:
    """The float32 weight (padded rows and columns included) of a packed layout."""
    if fmt in KQUANT_FORMATS.values():
        return _DEQUANTIZE[fmt](qweight)
    return _DEQUANTIZE[fmt](qweight, scales)


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
    quantizes x per block of 32 inside the kernel, as llama.cpp does; "float32" keeps it exact.
    The weights are buffers, not parameters: there is no backward pass (it raises).
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
        self.int8_activations = activations == "int8"
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
            if (lin.in_features, lin.int8_activations) != (first.in_features, first.int8_activations):
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
            "int8" if first.int8_activations else "float32",
        )

    def _apply(self, fn, recurse=True):
        return _keep_dtypes(self, fn, recurse, super()._apply)

    def dequantize(self) -> Tensor:
        """The float32 weight (out_features, in_features) the kernels multiply by (up to the
        rounding of their sums)."""
        return _dequantize(self.fmt, self.qweight, self.scales)[: self.out_features, : self.in_features]

    def forward(self, x: Tensor) -> Tensor:
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
        out = op(
            x2, self.qweight, self.scales, self.bias, self.out_features, self.int8_activations
        )  # (M, out)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        activations = "int8" if self.int8_activations else "float32"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, fmt={self.fmt}, "
            f"activations={activations}, bias={self.bias is not None}"
        )


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
        if self.fmt in KQUANT_FORMATS.values():
            rows = gguf_blocks.dequantize_kquant(self.fmt, self.qweight[flat])  # (L, dim)
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
