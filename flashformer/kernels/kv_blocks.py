"""The KV cache's element types, as llama.cpp names them (`--cache-type-k`, `--cache-type-v`):
f32, f16, and the q8_0 and q4_0 blocks of 32 values.

    kv_blocks.check_type("q8_0", "cache_type_k")     # the name, or a ValueError naming the argument
    pool = kv_blocks.empty("q8_0", (Hk, blocks, block_size), D)  # uint8 (..., 34 * D / 32)
    blocks = kv_blocks.quantize(x, "q4_0")           # (..., D) float -> (..., 18 * D / 32) uint8
    x = kv_blocks.dequantize(blocks, "q4_0", D)      # -> (..., D) float32, what the blocks mean

Why blocks: a decode step at long context reads every cached key and value of every layer, so
its time and a chat's memory grow with the cache's bytes. q8_0 stores a head's row of D values
in D / 32 blocks of a float16 scale and 32 int8 (34 bytes per 32 values: 0.53x float16), q4_0
in a scale and 16 bytes of nibbles (18 bytes: 0.28x). Keys are more sensitive than values
(their errors go through the softmax's exponential), hence a type for each.

The rules are ggml's reference quantizers (what llama.cpp's file format holds): q8_0 d = max|x| /
127, q = round half away from zero of x / d; q4_0 d = x_m / -8 for the x_m of largest magnitude
(the first of equals), q = min(15, trunc(x / d + 8.5)), byte j holding element j in its low
nibble and j + 16 in its high one; a value is q * d and (q - 8) * d. The C++ kernels
(csrc/kv_blocks.h) write and read the same bytes; this module is their Python side: allocating
pools and the reference the tests compare against (and gguf-py's quantizers against it).

Rotation (llama.cpp's since its PR #21038, after QuaRot): a block's error grows with its largest
value, and keys and values have outlier channels. Before quantizing, an orthonormal
Walsh-Hadamard rotation H spreads each outlier over its block: keys are stored as H k (the
queries rotated alike: H q . H k = q . k), values as H v (the attention output rotated back; H
is its own inverse). Where D is a multiple of 64: keys in blocks of the largest power of two
dividing D, values in blocks of 64 (llama.cpp's measured choices); float types are not rotated.
On SmolLM2 it halves q4_0's KL-divergence (docs/benchmarks.md). `store` and `load` rotate and
rotate back, so the eager modules see plain keys and values; the native decoder rotates q, k, v
and its attention output itself (csrc/kv_blocks.h).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flashformer.kernels import block_types

TYPES = ("f32", "f16", "q8_0", "q4_0")
_BLOCK_BYTES = {name: block_types.TYPES[name.upper()].block_bytes for name in ("q8_0", "q4_0")}
BLOCK = block_types.TYPES["Q8_0"].block_values  # values per q8_0 / q4_0 block (32)
# the float types: the two a user names, and the ones a model's own dtype gives (a bfloat16 or float64
# model keeps a cache of its dtype, as it always has)
_FLOAT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64}


def check_type(name, argument: str) -> str:
    """name if it is one of TYPES, else a ValueError naming `argument`, its value and the choices."""
    if name not in TYPES:
        raise ValueError(f"{argument}: expected one of {', '.join(TYPES)} (llama.cpp's names); got {name!r}")
    return name


def is_block_type(name: str) -> bool:
    return name in _BLOCK_BYTES


def holds_blocks(k_type: str, v_type: str) -> bool:
    """Whether a cache of these key and value types holds q8_0 / q4_0 blocks (the native decoder's only)."""
    return is_block_type(k_type) or is_block_type(v_type)


def type_of_dtype(dtype: torch.dtype) -> str:
    """The float type a cache of `dtype` stores."""
    for name, float_dtype in _FLOAT_DTYPES.items():
        if float_dtype == dtype:
            return name
    raise ValueError(
        f"a KV cache stores floats of {', '.join(map(str, _FLOAT_DTYPES.values()))}; got {dtype}"
    )


def check_dim(name: str, dim: int) -> None:
    if is_block_type(name) and dim % BLOCK:
        raise ValueError(
            f"a {name} KV cache stores rows of {BLOCK}-value blocks: head_dim must be a multiple of {BLOCK}, got {dim}"
        )


def row_bytes(name: str, dim: int) -> int:
    """Bytes of one head's row of `dim` values."""
    if is_block_type(name):
        check_dim(name, dim)
        return dim // BLOCK * _BLOCK_BYTES[name]
    return dim * _FLOAT_DTYPES[name].itemsize


def storage(name: str, dim: int) -> tuple[torch.dtype, int]:
    """The (dtype, last dim) of a pool of `name` rows of `dim` values."""
    if is_block_type(name):
        return torch.uint8, row_bytes(name, dim)
    return _FLOAT_DTYPES[name], dim


def empty(name: str, lead: tuple[int, ...], dim: int, device=None) -> Tensor:
    """A zeroed pool (*lead, row) for rows of `dim` values of type `name` (zero blocks mean 0)."""
    dtype, last = storage(name, dim)
    return torch.zeros(*lead, last, dtype=dtype, device=device)


def quantize(x: Tensor, name: str) -> Tensor:
    """x (..., D) float -> (..., D / 32 * bytes per block) uint8 blocks of `name` (q8_0, q4_0)."""
    dim = x.shape[-1]
    check_dim(name, dim)
    blocks = x.detach().float().reshape(*x.shape[:-1], dim // BLOCK, BLOCK)  # (..., nb, 32)
    if name == "q8_0":
        d = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
        scaled = blocks * torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        whole = scaled.trunc()  # roundf: half away from zero (torch.round goes to even)
        q = whole + torch.where((scaled - whole).abs() >= 0.5, scaled.sign(), torch.zeros_like(scaled))
        payload = q.to(torch.int8).view(torch.uint8)  # (..., nb, 32)
    elif name == "q4_0":
        at = blocks.abs().argmax(dim=-1, keepdim=True)  # the first of equal magnitudes
        d = blocks.gather(-1, at) / -8.0
        q = (
            (blocks * torch.where(d != 0, 1.0 / d, torch.zeros_like(d)) + 8.5)
            .trunc()
            .clamp(0, 15)
            .to(torch.uint8)
        )
        payload = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)  # (..., nb, 16)
    else:
        raise ValueError(f"quantize: expected a block type (q8_0, q4_0), got {name!r}")
    scales = d.to(torch.float16).view(torch.uint8)  # (..., nb, 2), little-endian float16
    return torch.cat([scales, payload], dim=-1).reshape(*x.shape[:-1], -1)


def dequantize(blocks: Tensor, name: str, dim: int) -> Tensor:
    """(..., row bytes) uint8 blocks of `name` -> (..., dim) float32, the values they stand for."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != row_bytes(name, dim):
        raise ValueError(
            f"dequantize: expected uint8 rows of {row_bytes(name, dim)} bytes ({name}, {dim} values), "
            f"got {blocks.dtype} {tuple(blocks.shape)}"
        )
    b = blocks.reshape(*blocks.shape[:-1], dim // BLOCK, _BLOCK_BYTES[name])  # (..., nb, bytes)
    d = b[..., :2].contiguous().view(torch.float16).float()  # (..., nb, 1)
    payload = b[..., 2:]
    if name == "q8_0":
        q = payload.contiguous().view(torch.int8).float()
    else:
        q = torch.cat([payload & 0x0F, payload >> 4], dim=-1).float() - 8.0
    return (q * d).reshape(*blocks.shape[:-1], dim)


def rotation(name: str, dim: int, keys: bool) -> int:
    """The rotation's block for keys (or values) of type `name` and head size `dim`; 0: none."""
    if not is_block_type(name) or dim % 64:
        return 0
    if not keys:
        return 64
    block = 64
    while dim % (2 * block) == 0:
        block *= 2
    return block


def rotate(x: Tensor, block: int) -> Tensor:
    """x (..., D) float32 rotated by the orthonormal Walsh-Hadamard matrix in blocks of `block` (0:
    x itself): the butterflies a + b, a - b in order of span, then 1 / sqrt(block), as the C++."""
    if block == 0:
        return x
    lead, dim = x.shape[:-1], x.shape[-1]
    y = x.float().reshape(-1, dim // block, block)
    span = 1
    while span < block:
        pairs = y.reshape(*y.shape[:2], block // (2 * span), 2, span)
        low, high = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack([low + high, low - high], dim=-2).reshape(*y.shape[:2], block)
        span *= 2
    scale = torch.tensor(1.0 / math.sqrt(block), dtype=torch.float32)
    return (y * scale).reshape(*lead, dim)


def store(x: Tensor, name: str, keys: bool) -> Tensor:
    """x (..., D), keys or values, as a pool of `name` holds them: a float dtype, or (rotated) blocks."""
    if not is_block_type(name):
        return x.to(_FLOAT_DTYPES[name])
    return quantize(rotate(x.float(), rotation(name, x.shape[-1], keys)), name)


def load(stored: Tensor, name: str, dim: int, keys: bool) -> Tensor:
    """The float32 keys or values a pool's rows of `name` stand for, rotated back."""
    if not is_block_type(name):
        return stored.float()
    return rotate(dequantize(stored, name, dim), rotation(name, dim, keys))
