"""The KV cache's q8_0 / q4_0 blocks: the bytes ggml's reference quantizers give (gguf-py's copy of
them is the independent reference), the values they stand for, and attention over them in the
C++ kernels: the bits attention gives over a float32 cache holding those values, on every path
(the ISA switch: scalar and AVX2 dequantization), whatever types keys and values have."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from helpers.kernel_paths import kernel_paths, on_path

import flashformer
from flashformer.generate.cache import make_caches
from flashformer.generate.sampling import settings_from
from flashformer.generate.session import make_session
from flashformer.kernels import extension, kv_blocks
from flashformer.kernels.native_decoder import NativeCache
from flashformer.model.native import native_decoder

GGUF_TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
needs_cpp = pytest.mark.skipif(not extension.cpp_kernels(), reason="the C++ kernels could not be built here")


def awkward_rows(seed: int = 0) -> torch.Tensor:
    """(6, 3, 96) values with the cases a quantizer gets wrong: a zero block, ties of magnitude with
    opposite signs, a negative extreme, values at exactly half a step, tiny and huge scales."""
    torch.manual_seed(seed)
    x = torch.randn(6, 3, 96) * torch.rand(6, 3, 1) * 4
    x[0, 0, :32] = 0.0
    x[0, 1, :32] = torch.linspace(-1, 1, 32)  # -1 and 1: equal magnitudes, the first wins
    x[0, 2, 5] = -9.0
    x[1, 0, :32] = torch.arange(32) * 0.5 - 8  # multiples of half a step
    x[2] *= 1e-6
    x[3] *= 1e3
    return x


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_blocks_are_the_bytes_of_ggml_reference_quantizer(name):
    x = awkward_rows()
    ours = kv_blocks.quantize(x, name)
    assert ours.dtype == torch.uint8 and ours.shape == (6, 3, kv_blocks.row_bytes(name, 96))
    theirs = quants.quantize(x.numpy().reshape(-1, 96), GGUF_TYPES[name]).reshape(ours.shape)
    np.testing.assert_array_equal(ours.numpy(), theirs)
    values = kv_blocks.dequantize(ours, name, 96)
    expected = quants.dequantize(theirs.reshape(18, -1), GGUF_TYPES[name]).reshape(values.shape)
    np.testing.assert_array_equal(values.numpy(), expected)
    # within half a step (q8_0) or a step (q4_0: its top level is clamped), plus the float16
    # rounding of the scale; row 2's scales are below float16's range
    step = x.abs().reshape(6, 3, 3, 32).amax(-1) / (127 if name == "q8_0" else 8)  # (6, 3, 3)
    error = (values - x).abs().reshape(6, 3, 3, 32).amax(-1)
    bound = step * (0.5 if name == "q8_0" else 1.0) + step * 127 / 2048
    assert bool((error[[0, 1, 3, 4, 5]] <= bound[[0, 1, 3, 4, 5]]).all())


def test_row_bytes_and_types_are_checked():
    assert kv_blocks.row_bytes("q8_0", 64) == 68 and kv_blocks.row_bytes("q4_0", 64) == 36
    assert kv_blocks.row_bytes("f16", 64) == 128 and kv_blocks.row_bytes("f32", 64) == 256
    with pytest.raises(ValueError, match=r"cache_type_k: expected one of f32, f16, q8_0, q4_0 .* got 'q5_1'"):
        kv_blocks.check_type("q5_1", "cache_type_k")
    with pytest.raises(ValueError, match="head_dim must be a multiple of 32, got 48"):
        kv_blocks.row_bytes("q4_0", 48)


def test_the_rotation_is_the_orthonormal_hadamard_matrix_block_by_block():
    hadamard = np.array([[1.0]])
    while hadamard.shape[0] < 64:
        hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])  # Sylvester's construction
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4))
    rotated = kv_blocks.rotate(x, 64)
    expected = (x.double().reshape(5, 2, 64) @ torch.from_numpy(hadamard / 8)).reshape(5, 128)
    assert torch.allclose(rotated.double(), expected, atol=1e-6)
    assert torch.allclose(kv_blocks.rotate(rotated, 64), x, atol=1e-6)  # its own inverse
    assert [kv_blocks.rotation("q4_0", d, keys) for d, keys in [(64, True), (256, True), (256, False)]] == [
        64,
        256,
        64,
    ]
    assert kv_blocks.rotation("q8_0", 96, True) == kv_blocks.rotation("f16", 128, True) == 0


# ---- attention over blocks ----


def stored_as(x: torch.Tensor, name: str) -> torch.Tensor:
    """x as a pool of `name` stores it, unrotated (the operator reads whatever values it is given)."""
    return (
        kv_blocks.quantize(x, name) if kv_blocks.is_block_type(name) else x.to(kv_blocks.storage(name, 1)[0])
    )


def values_of(stored: torch.Tensor, name: str, dim: int) -> torch.Tensor:
    return kv_blocks.dequantize(stored, name, dim) if kv_blocks.is_block_type(name) else stored.float()


PAIRS = [("q8_0", "q8_0"), ("q8_0", "q4_0"), ("q4_0", "q4_0"), ("f16", "q4_0"), ("q4_0", "f32")]


def paths_with_scalar() -> list[str]:
    return ["scalar", *kernel_paths()] if extension.cpp_kernels() else []


@needs_cpp
@pytest.mark.parametrize("isa", paths_with_scalar())
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "/".join(p))
def test_paged_attention_over_blocks_gives_the_bits_of_their_values(pair, isa):
    torch.manual_seed(1)
    heads, kv_heads, blocks, block_size, dim = 6, 2, 9, 16, 64
    k, v = torch.randn(kv_heads, blocks, block_size, dim), torch.randn(kv_heads, blocks, block_size, dim)
    k_stored, v_stored = stored_as(k, pair[0]), stored_as(v, pair[1])
    k_values, v_values = values_of(k_stored, pair[0], dim), values_of(v_stored, pair[1], dim)
    q = torch.randn(7, heads, dim)  # sequence 0: 4 queries (a prompt chunk), sequence 1: 3
    tables = torch.tensor([[3, 1, 4, 0, 2, 8], [5, 6, 7, 0, 0, 0]], dtype=torch.int32)
    lengths = torch.tensor([77, 40], dtype=torch.int32)
    starts = torch.tensor([0, 4, 7])
    for rules in [(0.125, 0.0, True, None, None, -1, -1), (0.2, 30.0, True, None, None, 20, -1)]:
        with on_path(isa):
            out, lse = torch.ops.flashformer.paged_attention_cpu(
                q, k_stored, v_stored, tables, lengths, starts, *rules
            )
            expected = torch.ops.flashformer.paged_attention_cpu(
                q, k_values, v_values, tables, lengths, starts, *rules
            )
        assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


@needs_cpp
def test_the_static_operator_reads_block_caches_in_place():
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 4, 3, 32), torch.randn(2, 2, 50, 32), torch.randn(2, 2, 50, 32)
    k_stored, v_stored = stored_as(k, "q8_0"), stored_as(v, "q4_0")
    args = (0.17, 0.0, True, None, None, -1, -1)
    out, lse = torch.ops.flashformer.attention_cpu(q, k_stored, v_stored, *args)
    expected = torch.ops.flashformer.attention_cpu(
        q, values_of(k_stored, "q8_0", 32), values_of(v_stored, "q4_0", 32), *args
    )
    assert out.shape == (2, 4, 3, 32) and torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


@needs_cpp
def test_pools_of_no_known_type_are_refused_by_name():
    q = torch.randn(1, 2, 64)
    index = (torch.tensor([[0]]), torch.tensor([1]), torch.tensor([0, 1]), 1.0, 0.0, True, None, None, -1, -1)
    odd = torch.zeros(1, 1, 16, 50, dtype=torch.uint8)  # neither 68 (q8_0) nor 36 (q4_0) bytes
    with pytest.raises(
        RuntimeError, match=r"k, v: expected float32, float16 or uint8 q8_0 / q4_0 rows for D = 64"
    ):
        torch.ops.flashformer.paged_attention_cpu(q, odd, odd, *index)


# ---- the native decoder writes blocks ----


def model_with_heads_of(dim: int, seed: int = 0):
    """A tiny LLaMA (GQA, 4 query heads, 2 KV heads) whose heads hold `dim` values."""
    torch.manual_seed(seed)
    model = flashformer.build("llama-tiny", d_model=4 * dim, n_heads=4, n_kv_heads=2, vocab_size=97)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@needs_cpp
@pytest.mark.parametrize("dim", [32, 64])  # 64: keys and values rotated before they are quantized
@pytest.mark.parametrize("pair", [("q8_0", "q4_0"), ("q4_0", "q8_0")], ids="/".join)
def test_the_native_decoder_writes_the_blocks_store_gives(pair, dim):
    """Layer 0's keys and values do not depend on the cache: the block cache holds exactly the
    float cache's rows as kv_blocks.store writes them (rotated where D is a multiple of 64)."""
    model = model_with_heads_of(dim)
    ids = torch.randint(3, 97, (2, 21), generator=torch.Generator().manual_seed(3))
    caches = {}
    for types in [("f32", "f32"), pair]:
        settings = settings_from(model, max_new_tokens=2, cache_type_k=types[0], cache_type_v=types[1])
        session = make_session(model, ids, None, settings)
        assert session.native is not None
        session.prefill()
        caches[types] = session.caches
    decoder = native_decoder(model)
    floats, blocks = caches[("f32", "f32")][0], caches[pair][0]
    assert torch.equal(blocks.k[:, :, :21], kv_blocks.store(floats.k[:, :, :21], pair[0], keys=True))
    assert torch.equal(blocks.v[:, :, :21], kv_blocks.store(floats.v[:, :, :21], pair[1], keys=False))
    pools = [c.k.transpose(0, 1)[..., :-2] for c in caches[pair]]  # rows 2 bytes short
    with pytest.raises(RuntimeError, match=r"bind_cache: layer 0: expected key and value pools"):
        decoder.forward(None, NativeCache(pools, pools))


def test_block_caches_need_heads_of_whole_blocks():
    model = flashformer.build("llama-tiny", vocab_size=97)  # head_dim 16
    with pytest.raises(
        ValueError,
        match=r"cache_type_v=q4_0: blocks of 32 values need head_dim a multiple of 32; this model's is 16",
    ):
        make_caches(model, 1, 8, cache_type_v="q4_0")
