"""flashformer.attention against float64 references, backend by backend.

1. The eager backend in float64 is checked against a row-by-row definition of
   attention written here from the contract (an independent reference).
2. Every other backend, in float32, bfloat16 and float16, is checked against
   eager-float64 with flash-attn's rule: its error in the output, the LSE and
   dq, dk, dv is at most 2x the eager backend's own error in that dtype + 1e-5.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from helpers.attention import NAMES, Shape, assert_within_budget, make_inputs, max_err, rounded_to, run

import flashformer
from flashformer.attention import flash

SHAPES = [
    Shape(2, 4, 4, 50, 50, 64),  # MHA; lengths not multiples of the tile
    Shape(1, 4, 2, 70, 33, 40),  # GQA; more queries than keys
    Shape(2, 6, 1, 1, 77, 80),  # MQA; a single query (a decode step)
    Shape(1, 2, 2, 33, 100, 96, dim_v=48),  # fewer queries than keys; own value head dim
    Shape(3, 2, 1, 17, 17, 16),
    Shape(1, 2, 2, 40, 64, 128),
]

FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (7, 3)},
    "causal_window": {"causal": True, "window": (9, None)},
    "padding": {"padding": True},
    "mask": {"mask": True},
    "bias_full": {"bias": (-1, -1, -1, -1)},
    "bias_broadcast": {"bias": (1, -1, 1, -1)},
    "alibi": {"alibi": True, "causal": True},
    "softcap": {"softcap": 5.0},
    "dropout": {"dropout": 0.2},
    "mix": {"causal": True, "padding": True, "bias": (1, -1, -1, -1), "softcap": 8.0, "alibi": True},
    "mix_dropout": {"window": (20, 5), "mask": True, "dropout": 0.3, "scale": 0.3},
}

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TORCH_REFUSES = {"softcap", "dropout"}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles much smaller than the inputs, so every test crosses tile edges."""
    monkeypatch.setattr(flash, "BLOCK_Q", 16)
    monkeypatch.setattr(flash, "BLOCK_K", 32)


@functools.cache
def _eager(shape_index: int, feature: str, dtype: torch.dtype):
    """(reference: eager float64 on the inputs rounded to dtype, eager run in dtype)."""
    inputs = make_inputs(SHAPES[shape_index], FEATURES[feature])
    return run(rounded_to(inputs, dtype), torch.float64, "eager"), run(inputs, dtype, "eager")


def _cases():
    for shape_index, shape in enumerate(SHAPES):
        for feature in FEATURES:
            for backend in ("flash", "torch"):
                if backend == "torch" and TORCH_REFUSES & set(FEATURES[feature]):
                    continue
                for dtype in DTYPES:
                    dtype_name = str(dtype).removeprefix("torch.")
                    yield pytest.param(
                        shape_index, feature, backend, dtype, id=f"{shape}-{feature}-{backend}-{dtype_name}"
                    )


@pytest.mark.parametrize("shape_index, feature, backend, dtype", list(_cases()))
def test_backend_within_error_budget(shape_index, feature, backend, dtype):
    reference, eager_low = _eager(shape_index, feature, dtype)
    inputs = make_inputs(SHAPES[shape_index], FEATURES[feature])
    got = run(inputs, dtype, backend)
    assert_within_budget(got, eager_low, reference, f"{backend}/{dtype}")


# ---- the eager backend against the definition ----


def definition(
    q,
    k,
    v,
    *,
    causal=False,
    key_padding_mask=None,
    mask=None,
    bias=None,
    alibi_slopes=None,
    window=None,
    softcap=None,
    scale=None,
):
    """Attention one query row at a time, straight from the contract."""
    B, Hq, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = torch.zeros(B, Hq, Lq, v.shape[-1], dtype=q.dtype)
    full_bias = None if bias is None else bias.expand(B, Hq, Lq, Lk)
    full_mask = None if mask is None else mask.expand(B, Hq, Lq, Lk)
    j = torch.arange(Lk)
    for b in range(B):
        for h in range(Hq):
            kv = h // (Hq // Hk)
            for i in range(Lq):
                diagonal = i + Lk - Lq
                s = (k[b, kv] @ q[b, h, i]) * scale  # (Lk,)
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                if full_bias is not None:
                    s = s + full_bias[b, h, i]
                if alibi_slopes is not None:
                    s = s - alibi_slopes[h].double() * (diagonal - j).abs()
                allowed = torch.ones(Lk, dtype=torch.bool)
                if causal:
                    allowed &= j <= diagonal
                if window is not None:
                    if window[0] is not None:
                        allowed &= j >= diagonal - window[0]
                    if window[1] is not None:
                        allowed &= j <= diagonal + window[1]
                if key_padding_mask is not None:
                    allowed &= key_padding_mask[b]
                if full_mask is not None:
                    allowed &= full_mask[b, h, i]
                if allowed.any():
                    weights = torch.softmax(s[allowed], dim=0)
                    out[b, h, i] = weights @ v[b, kv][allowed]
    return out


@pytest.mark.parametrize("feature", [f for f in FEATURES if "dropout" not in FEATURES[f]])
@pytest.mark.parametrize("shape_index", [1, 3])
def test_eager_float64_matches_definition(shape_index, feature):
    inputs = make_inputs(SHAPES[shape_index], FEATURES[feature])
    got = flashformer.attention(inputs.q, inputs.k, inputs.v, backend="eager", **inputs.kwargs)
    want = definition(inputs.q, inputs.k, inputs.v, **inputs.kwargs)
    assert max_err(got, want) < 1e-12


# ---- rows with no key at all ----


@pytest.mark.parametrize("backend", ["eager", "flash", "torch"])
def test_fully_masked_rows_give_zero_output_and_zero_gradient(backend):
    B, H, Lq, Lk, D = 2, 2, 20, 12, 16
    q = torch.randn(B, H, Lq, D, requires_grad=True)
    k = torch.randn(B, H, Lk, D, requires_grad=True)
    v = torch.randn(B, H, Lk, D, requires_grad=True)
    padding = torch.ones(B, Lk, dtype=torch.bool)
    padding[1] = False  # batch 1 has no real key at all
    # causal with Lq > Lk: queries 0..7 of batch 0 precede every key
    result = flashformer.attention(
        q, k, v, causal=True, key_padding_mask=padding, backend=backend, return_lse=backend != "torch"
    )
    out, lse = result if backend != "torch" else (result, None)
    dead = torch.zeros(B, H, Lq, dtype=torch.bool)
    dead[0, :, : Lq - Lk] = True
    dead[1] = True
    assert (out[dead] == 0).all()
    assert torch.isfinite(out).all()
    if lse is not None:
        assert (lse[dead] == float("-inf")).all() and torch.isfinite(lse[~dead]).all()
    out.backward(torch.randn_like(out))
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert torch.isfinite(t.grad).all(), f"NaN in d{name}"
    assert (q.grad[dead] == 0).all()
    assert (k.grad[1] == 0).all() and (v.grad[1] == 0).all()


# ---- dropout ----


def test_dropout_drops_the_same_entries_in_every_backend():
    inputs = make_inputs(Shape(2, 4, 2, 45, 61, 32), {"dropout": 0.4, "causal": True})
    eager = run(inputs, torch.float64, "eager")
    tiled = run(inputs, torch.float64, "flash")
    for name, a, b in zip(NAMES, eager, tiled):
        assert max_err(a, b) < 1e-12, name


def test_dropout_keeps_the_expected_fraction():
    from flashformer.attention.masks import dropout_head_keys, dropout_keep

    for p in (0.1, 0.5, 0.9):
        keys = dropout_head_keys(seed=7, batch=2, heads=4, device="cpu")
        keep = dropout_keep(keys, 0, 512, 0, 1024, p)  # 4M entries
        assert abs(keep.float().mean().item() - (1 - p)) < 0.01
        # the entries are a function of absolute positions, not of the tiling
        tile = dropout_keep(keys, 100, 164, 300, 333, p)
        assert torch.equal(tile, keep[:, :, 100:164, 300:333])


def test_dropout_seed_decides_the_entries():
    q, k, v = (torch.randn(1, 2, 30, 16) for _ in range(3))
    a = flashformer.attention(q, k, v, dropout_p=0.5, dropout_seed=1, backend="flash")
    b = flashformer.attention(q, k, v, dropout_p=0.5, dropout_seed=1, backend="flash")
    c = flashformer.attention(q, k, v, dropout_p=0.5, dropout_seed=2, backend="flash")
    assert torch.equal(a, b) and not torch.equal(a, c)
    torch.manual_seed(3)
    d = flashformer.attention(q, k, v, dropout_p=0.5, backend="flash")
    torch.manual_seed(3)
    e = flashformer.attention(q, k, v, dropout_p=0.5, backend="flash")
    assert torch.equal(d, e)


def test_dropout_is_unbiased():
    """Averaged over seeds, dropout's output approaches the output without it."""
    q, k, v = (torch.randn(1, 1, 8, 16, dtype=torch.float64) for _ in range(3))
    clean = flashformer.attention(q, k, v, backend="eager")
    runs = torch.stack(
        [flashformer.attention(q, k, v, dropout_p=0.3, dropout_seed=s, backend="flash") for s in range(2000)]
    )
    assert (runs.mean(0) - clean).abs().max() < 0.05


# ---- a bias given as a function of positions (T5's relative bias) ----


def test_bias_function_matches_a_materialized_bias_and_trains_its_table():
    torch.manual_seed(0)
    B, H, Lq, Lk, D, buckets = 2, 3, 37, 45, 16, 11
    table = torch.randn(buckets, H, dtype=torch.float64, requires_grad=True)

    def relative_bias(q_pos, k_pos):  # (H, len(q_pos), len(k_pos))
        distance = (k_pos[None, :] - q_pos[:, None]).clamp(-5, 5) + 5
        return table[distance].permute(2, 0, 1)

    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float64, requires_grad=True) for L in (Lq, Lk, Lk))
    grad_out = torch.randn(B, H, Lq, D, dtype=torch.float64)
    results = {}
    for backend in ("eager", "flash", "torch"):
        out = flashformer.attention(q, k, v, bias=relative_bias, causal=True, backend=backend)
        results[backend] = (out, *torch.autograd.grad(out, (q, k, v, table), grad_out))
    for backend in ("flash", "torch"):
        for name, a, b in zip(("out", "dq", "dk", "dv", "dtable"), results[backend], results["eager"]):
            assert max_err(a, b) < 1e-12, f"{backend} {name}"
    assert results["eager"][4].abs().sum() > 0


def test_lse_is_differentiable():
    q, k, v = (torch.randn(2, 2, 40, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grads = {}
    for backend in ("eager", "flash"):
        out, lse = flashformer.attention(q, k, v, causal=True, return_lse=True, backend=backend)
        loss = (out * out).sum() + (lse * torch.linspace(-1, 1, 40)).sum()
        grads[backend] = torch.autograd.grad(loss, (q, k, v))
    for a, b in zip(grads["eager"], grads["flash"]):
        assert max_err(a, b) < 1e-12


def test_eager_returns_probabilities():
    q, k, v = (torch.randn(1, 2, 10, 8) for _ in range(3))
    out, probs = flashformer.attention(q, k, v, causal=True, return_probs=True)
    assert probs.shape == (1, 2, 10, 10)
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 2, 10))
    assert (probs.triu(1) == 0).all()
    torch.testing.assert_close(out, probs @ v)


def test_auto_backend_is_exact():
    inputs = make_inputs(Shape(2, 4, 2, 40, 40, 32), {"causal": True, "padding": True})
    reference = run(rounded_to(inputs, torch.float32), torch.float64, "eager")
    eager32 = run(inputs, torch.float32, "eager")
    assert_within_budget(run(inputs, torch.float32, "auto"), eager32, reference, "auto")


@pytest.mark.parametrize(
    "feature, pattern",
    [
        ({"softcap": 2.0}, "softcap"),
        ({"dropout_p": 0.1}, "dropout"),
        ({"return_lse": True}, "return_lse"),
    ],
)
def test_torch_backend_refuses_what_it_cannot_do_exactly(feature, pattern):
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(NotImplementedError, match=pattern):
        flashformer.attention(q, q, q, backend="torch", **feature)
    with pytest.raises(NotImplementedError, match="return_probs"):
        flashformer.attention(q, q, q, backend="flash", return_probs=True)


def test_dropout_hash_matches_a_pure_python_reference():
    from flashformer.attention.masks import (
        dropout_head_keys,
        dropout_keep,
        dropout_threshold,
        mix32_reference,
    )

    seed, p, B, H = (2**40 + 12345), 0.37, 2, 3
    keep = dropout_keep(dropout_head_keys(seed, B, H, "cpu"), 5, 12, 1000, 1019, p)
    lo, hi = seed & 0xFFFFFFFF, seed >> 32
    for b in range(B):
        for h in range(H):
            head = mix32_reference(mix32_reference((b * H + h) ^ lo) ^ mix32_reference(hi))
            for i in range(5, 12):
                row = mix32_reference(head ^ i)
                for j in range(1000, 1019):
                    kept = mix32_reference(row ^ mix32_reference(j)) >= dropout_threshold(p)
                    assert bool(keep[b, h, i - 5, j - 1000]) == kept


# ---- backend "cpu": the C++ kernel for a few queries over cached keys ----

HAS_CPU_KERNEL = __import__("flashformer.kernels.extension", fromlist=["cpp_kernels"]).cpp_kernels()
needs_cpu_kernel = pytest.mark.skipif(
    not HAS_CPU_KERNEL, reason="the C++ CPU kernels could not be built here"
)
CPU_KERNEL_FEATURES = ["plain", "causal", "window", "causal_window", "padding", "alibi", "softcap"]


@needs_cpu_kernel
@pytest.mark.parametrize("feature", CPU_KERNEL_FEATURES)
@pytest.mark.parametrize("shape_index", range(len(SHAPES)))
def test_cpu_backend_within_error_budget(shape_index, feature):
    """Forward only (the kernel has no backward): out and LSE within 2x eager float32's error."""
    inputs = make_inputs(SHAPES[shape_index], FEATURES[feature])
    with torch.no_grad():
        reference = run_forward(rounded_to(inputs, torch.float32), torch.float64, "eager")
        eager32 = run_forward(inputs, torch.float32, "eager")
        got = run_forward(inputs, torch.float32, "cpu")
    assert_within_budget(got, eager32, reference, f"cpu/{feature}")


def run_forward(inputs, dtype, backend):
    q, k, v = (t.to(dtype) for t in (inputs.q, inputs.k, inputs.v))
    out, lse = flashformer.attention(q, k, v, backend=backend, return_lse=True, **inputs.kwargs)
    return out.double(), lse.double()


@needs_cpu_kernel
def test_auto_takes_the_cpu_kernel_for_a_decode_step_over_a_cache_view():
    """A decode step reads a static cache's view (strided, not copied): auto runs the kernel, and
    each row's result is the same bits alone as in a batch of rows of other lengths' caches."""
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 4, 3, 90, 32, generator=gen)  # (k|v, B, Hk, max_len, D)
    q = torch.randn(4, 6, 1, 32, generator=gen)
    k, v = cache[0, :, :, :57], cache[1, :, :, :57]  # the first 57 positions are written
    padding = torch.ones(4, 57, dtype=torch.bool)
    padding[1, :13] = False  # a left-padded row
    with torch.no_grad():
        auto = flashformer.attention(q, k, v, causal=True, key_padding_mask=padding)
        named = flashformer.attention(q, k, v, causal=True, key_padding_mask=padding, backend="cpu")
        torch_out = flashformer.attention(q, k, v, causal=True, key_padding_mask=padding, backend="torch")
        assert torch.equal(auto, named)
        assert max_err(named, torch_out) < 1e-5
        for b in range(4):
            alone = flashformer.attention(
                q[b : b + 1],
                k[b : b + 1],
                v[b : b + 1],
                causal=True,
                key_padding_mask=padding[b : b + 1],
                backend="cpu",
            )
            assert torch.equal(alone, named[b : b + 1])


@pytest.mark.parametrize("backend", ["auto", "eager", "flash", "torch"] + (["cpu"] if HAS_CPU_KERNEL else []))
@pytest.mark.parametrize("feature", ["causal", "causal_window", "padding", "alibi"])
@pytest.mark.parametrize("q_len", [1, 5])
def test_a_float16_cache_gives_what_its_float32_widening_gives(backend, feature, q_len):
    """float32 queries over a float16 KV cache (a quantized model keeps one, as llama.cpp does):
    every backend computes what it computes on the cache widened to float32, bit for bit (the
    C++ kernel widens span by span as it reads: rows 0-63, 64-127 and a partial span here)."""
    gen = torch.Generator().manual_seed(21)
    cache = torch.randn(2, 3, 2, 160, 16, generator=gen).half()  # (k|v, B, Hk, max_len, D)
    k, v = cache[0, :, :, :150], cache[1, :, :, :150]  # a view of the written positions
    q = torch.randn(3, 6, q_len, 16, generator=gen)
    kwargs = {"causal": feature != "padding"}
    if "window" in feature:
        kwargs["window"] = (70, 0)
    if feature == "padding":
        kwargs["key_padding_mask"] = torch.arange(150)[None] >= torch.tensor([[0], [31], [97]])
    if feature == "alibi":
        kwargs["alibi_slopes"] = torch.rand(3, 6, generator=gen)
    with torch.no_grad():
        got = flashformer.attention(q, k, v, backend=backend, **kwargs)
        widened = flashformer.attention(q, k.float(), v.float(), backend=backend, **kwargs)
    assert got.dtype == torch.float32
    assert torch.equal(got, widened)


def test_mixed_dtypes_other_than_a_float16_cache_are_refused_naming_them():
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match=r"got q torch.bfloat16, k torch.float16, v torch.float16"):
        flashformer.attention(q.bfloat16(), q.half(), q.half())
    with pytest.raises(TypeError, match=r"got q torch.float32, k torch.float16, v torch.float32"):
        flashformer.attention(q, q.half(), q)
    with pytest.raises(TypeError, match=r"got q torch.float16, k torch.float32, v torch.float32"):
        flashformer.attention(q.half(), q, q)


@needs_cpu_kernel
@pytest.mark.parametrize(
    "kwargs, dtype, grad, pattern",
    [
        ({"mask": torch.ones(1, 1, 4, 4, dtype=torch.bool)}, torch.float32, False, "masks and biases"),
        ({"bias": torch.zeros(1, 1, 4, 4)}, torch.float32, False, "masks and biases"),
        ({"dropout_p": 0.1}, torch.float32, False, "dropout"),
        ({}, torch.float32, True, "gradients"),
        ({}, torch.bfloat16, False, "float32 on the CPU"),
    ],
)
def test_cpu_backend_refuses_what_it_cannot_do(kwargs, dtype, grad, pattern):
    q = torch.randn(1, 1, 4, 8, dtype=dtype, requires_grad=grad)
    with pytest.raises(NotImplementedError, match=pattern):
        flashformer.attention(q, q, q, backend="cpu", **kwargs)


@needs_cpu_kernel
def test_cpu_backend_compiles_into_one_graph():
    """A compiled decode step keeps the kernel inside its graph (its fake gives the real strides):
    fullgraph=True fails on any graph break."""
    gen = torch.Generator().manual_seed(6)
    cache = torch.randn(2, 2, 3, 40, 16, generator=gen)
    q = torch.randn(2, 6, 1, 16, generator=gen)

    def step(q, cache, length: int):
        return flashformer.attention(q * 2, cache[0, :, :, :length], cache[1, :, :, :length], causal=True)

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    with torch.no_grad():
        got, want = compiled(q, cache, 25), step(q, cache, 25)
    assert got.stride() == want.stride()
    assert torch.equal(got, want)
