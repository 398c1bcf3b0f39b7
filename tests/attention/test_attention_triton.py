"""The Triton backend against float64 references, as the other backends are
tested (test_attention.py): error <= 2x the eager backend's error in the same
dtype + 1e-5, for out, lse, dq, dk, dv and dbias.

Without a GPU the kernels run in Triton's CPU interpreter (conftest.py), which
is slow: each feature is checked once per dtype on small shapes, the shapes
rotating so that every shape meets every dtype. On a GPU the same tests run
over the full grid of shapes x features x dtypes, with larger shapes.

Two interpreter quirks are worked around inside the kernels, not in these
tests (see flashformer/attention/triton/scores.py): its bfloat16 tl.dot
multiplies raw bits, and its float32 -> bfloat16 cast truncates.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.attention import (
    NAMES,
    Inputs,
    Shape,
    assert_within_budget,
    make_inputs,
    max_err,
    rounded_to,
    run,
)

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import flashformer  # noqa: E402
from flashformer.attention.masks import dropout_head_keys, dropout_keep, dropout_threshold  # noqa: E402
from flashformer.attention.triton import decode_attention, varlen_attention  # noqa: E402
from flashformer.attention.triton.scores import dropout_keep as kernel_dropout_keep  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

SHAPES = [
    Shape(1, 2, 2, 37, 45, 40),  # MHA, head dim 40
    Shape(2, 2, 1, 33, 20, 80),  # MQA, more queries than keys (rows with no key under causal), head dim 80
    Shape(1, 4, 2, 21, 50, 96, dim_v=48),  # GQA, head dim 96, a value head dim of its own
]
GPU_SHAPES = [  # compiled kernels run fast: larger shapes, and the GPU's real tile sizes
    Shape(2, 8, 2, 300, 300, 64),
    Shape(1, 4, 4, 200, 517, 128),
    Shape(2, 4, 1, 1, 1000, 128),  # one query (a decode step)
    Shape(1, 2, 2, 129, 257, 256),
    Shape(2, 6, 3, 77, 77, 16),
]

FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window": (7, 3)},
    "causal_window": {"causal": True, "window": (9, None)},
    "padding": {"padding": True},
    "mask": {"mask": True},
    "bias_full": {"bias": (-1, -1, -1, -1)},
    "bias_broadcast": {"bias": (1, -1, 1, -1)},  # one row per head, shared by batch and queries
    "bias_per_row": {"bias": (-1, 1, -1, 1)},  # one value per query row
    "alibi": {"alibi": True, "causal": True},
    "softcap": {"softcap": 5.0},
    "dropout": {"dropout": 0.2},
    "mix": {"causal": True, "padding": True, "bias": (1, -1, -1, -1), "softcap": 8.0, "alibi": True},
    "mix_dropout": {"window": (20, 5), "mask": True, "dropout": 0.3, "scale": 0.3},
}


def on_device(inputs: Inputs) -> Inputs:
    def move(t):
        return t.to(DEVICE) if isinstance(t, torch.Tensor) else t

    kwargs = {name: move(value) for name, value in inputs.kwargs.items()}
    return Inputs(*(move(t) for t in (inputs.q, inputs.k, inputs.v, inputs.grad_out)), kwargs)


def run_triton(inputs: Inputs, dtype: torch.dtype, **extra):
    """run() with backend='triton' on DEVICE; results back on the CPU."""
    return [None if t is None else t.cpu() for t in run(on_device(inputs), dtype, "triton", **extra)]


def _cases():
    """Each (feature, dtype) on one of SHAPES, rotating; on a GPU, bf16 and fp16
    also on one of GPU_SHAPES.

    (On a GPU every case compiles its own kernel variants, so the grid is sized
    by compile time: about 250 compilations.)"""
    for (feature_index, feature), (dtype_index, dtype) in itertools.product(
        enumerate(FEATURES), enumerate(DTYPES)
    ):
        turn = feature_index + dtype_index
        shapes = [SHAPES[turn % len(SHAPES)]]
        if ON_GPU and dtype != torch.float32:  # the kernels' GPU dtypes at the GPU's sizes
            shapes.append(GPU_SHAPES[turn % len(GPU_SHAPES)])
        for shape in shapes:
            dtype_name = str(dtype).removeprefix("torch.")
            yield pytest.param(shape, feature, dtype, id=f"{shape}-{feature}-{dtype_name}")


@pytest.mark.parametrize("shape, feature, dtype", list(_cases()))
def test_triton_within_error_budget(shape, feature, dtype):
    inputs = make_inputs(shape, FEATURES[feature])
    reference = run(rounded_to(inputs, dtype), torch.float64, "eager")
    eager_low = run(inputs, dtype, "eager")
    assert_within_budget(run_triton(inputs, dtype), eager_low, reference, f"triton/{dtype}")


@pytest.mark.parametrize(
    "q_len, k_len, causal, window",
    [
        (33, 33, True, None),  # the last query's last key opens a tile
        (64, 64, True, (1, 0)),  # a first key closing a tile; a last query opening one
        (64, 64, False, (None, 1)),  # the first query of a key tile closing a query tile
        (17, 49, False, (32, 32)),
        (48, 16, True, (0, 15)),
        # where the first interior (unmasked) tile starts or the last one ends, one key or query off
        (32, 46, True, None),
        (64, 64, False, (30, None)),
        (64, 64, False, (14, None)),
    ],
)
def test_band_limits_on_tile_edges(q_len, k_len, causal, window):
    """Causal/window bands whose edges fall on the first or last key of a tile
    (the interpreter's tiles are 16 queries x 32 keys), where skipping one tile
    too many or too few, or leaving one unmasked too many, would show."""
    inputs = make_inputs(Shape(1, 1, 1, q_len, k_len, 16), {"causal": causal, "window": window})
    reference = run(inputs, torch.float64, "eager")
    eager32 = run(inputs, torch.float32, "eager")
    assert_within_budget(run_triton(inputs, torch.float32), eager32, reference, "band")


def test_the_gpus_tile_sizes(monkeypatch):
    """The GPU's own tile sizes (64 to 128 rows and keys), run in the
    interpreter too: the tile arithmetic must not depend on the small tiles
    the other tests use there."""
    from flashformer.attention.triton import launch

    monkeypatch.setattr(launch, "_tiles", launch.gpu_tiles)
    inputs = make_inputs(
        Shape(1, 2, 1, 200, 300, 64), {"causal": True, "window": (150, None), "padding": True}
    )
    reference = run(rounded_to(inputs, torch.bfloat16), torch.float64, "eager")
    eager_low = run(inputs, torch.bfloat16, "eager")
    assert_within_budget(run_triton(inputs, torch.bfloat16), eager_low, reference, "gpu tiles")


def test_a_launch_that_does_not_fit_steps_down_and_remembers(monkeypatch):
    """A tile configuration the GPU cannot hold (OutOfResources at launch) is
    retried with fewer stages, then narrower tiles; the fitting one is reused."""
    from flashformer.attention.triton import launch

    monkeypatch.setattr(launch, "_tiles", lambda kind, dim: (128, 128, 8, 3))
    monkeypatch.setattr(launch, "_stepped_down", {})
    tried = []

    class FakeKernel:
        def __getitem__(self, grid):
            def run(**kwargs):
                config = (kwargs["BLOCK_M"], kwargs["BLOCK_N"], kwargs["num_stages"])
                tried.append(config)
                if kwargs["BLOCK_N"] > 32:
                    raise launch.OutOfResources(300_000, 232_448, "shared memory")

            return run

    assert launch._launch(FakeKernel(), "forward", 128, lambda m, n: (1,), {}, {"X": 1}, rows=1000) == (
        128,
        32,
    )
    assert tried == [(128, 128, 3), (128, 128, 2), (128, 128, 1), (128, 64, 1), (128, 32, 1)]
    tried.clear()
    launch._launch(FakeKernel(), "forward", 128, lambda m, n: (1,), {}, {"X": 1}, rows=1000)
    assert tried == [(128, 32, 1)]


# ---- dropout: the same bits as every other backend ----


@triton.jit
def _keep_mask_kernel(head_keys_ptr, out_ptr, threshold, L_Q, L_K, BLOCK: tl.constexpr):
    """Writes the kernels' dropout keep mask of one head, (L_Q, L_K) uint8."""
    head = tl.program_id(0)
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK)
    key = tl.load(head_keys_ptr + head).to(tl.uint32)
    keep = kernel_dropout_keep(key, rows, cols, threshold)
    ok = (rows[:, None] < L_Q) & (cols[None, :] < L_K)
    tl.store(out_ptr + head * L_Q * L_K + rows[:, None] * L_K + cols[None, :], keep.to(tl.uint8), mask=ok)


@pytest.mark.parametrize("seed, p", [(0, 0.1), (1234, 0.5), (2**40 + 17, 0.9), (2**64 - 1, 0.3)])
def test_kernel_dropout_hash_gives_the_same_bits_as_masks_py(seed, p):
    batch, heads, q_len, k_len = 2, 3, 29, 31
    head_keys = dropout_head_keys(seed, batch, heads, DEVICE)  # (B, H, 1, 1) int64
    got = torch.empty(batch * heads, q_len, k_len, dtype=torch.uint8, device=DEVICE)
    _keep_mask_kernel[(batch * heads,)](
        head_keys.contiguous(), got, dropout_threshold(p), q_len, k_len, BLOCK=32
    )
    want = dropout_keep(head_keys, 0, q_len, 0, k_len, p).reshape(batch * heads, q_len, k_len)
    assert torch.equal(got.bool(), want)
    assert 0 < want.sum() < want.numel()  # the comparison is not between two trivial masks


def test_dropout_drops_the_same_entries_as_eager_and_flash():
    """In float32 a single differently dropped entry would move the output by ~0.1."""
    inputs = make_inputs(Shape(2, 2, 1, 30, 41, 32), {"dropout": 0.4, "causal": True})
    reference = run(inputs, torch.float64, "eager")
    flash64 = run(inputs, torch.float64, "flash")
    got = run_triton(inputs, torch.float32)
    for name, want, tiled, mine in zip(NAMES, reference, flash64, got):
        if want is not None:
            assert max_err(tiled, want) < 1e-12, f"flash {name}"
            assert max_err(mine, want) < 2e-5, f"triton {name}"


# ---- the LSE and its gradient; rows with no key ----


@pytest.mark.parametrize("dtype", DTYPES)
def test_lse_gradient_including_a_bias_per_query_row(dtype):
    """loss = <out, g> + <lse, h>: dq, dk, dv and the bias gradient (which is dlse
    for a bias constant along the keys) within the budget."""
    inputs = make_inputs(Shape(2, 2, 1, 27, 35, 32), {"causal": True, "bias": (-1, 1, -1, 1)})
    lse_weights = torch.linspace(-1, 1, 27, dtype=torch.float64)

    def grads(q, k, v, bias, backend):
        out, lse = flashformer.attention(q, k, v, causal=True, bias=bias, backend=backend, return_lse=True)
        loss = (out.double() * inputs.grad_out.to(q.device)).sum() + (
            lse.double() * lse_weights.to(q.device)
        ).sum()
        return [t.double().cpu() for t in (out, lse, *torch.autograd.grad(loss, (q, k, v, bias)))]

    def leaves(source, to_dtype, device):
        return [t.to(device=device, dtype=to_dtype).requires_grad_() for t in source]

    tensors = (inputs.q, inputs.k, inputs.v, inputs.kwargs["bias"])
    rounded = [t.to(dtype).double() for t in tensors]
    reference = grads(*leaves(rounded, torch.float64, "cpu"), "eager")
    eager_low = grads(*leaves(tensors, dtype, "cpu"), "eager")
    got = grads(*leaves(tensors, dtype, DEVICE), "triton")
    assert_within_budget(got, eager_low, reference, f"triton/{dtype}")
    assert reference[5].abs().max() > 0.1  # the bias gradient is not trivially zero here


def test_fully_masked_rows_give_zero_output_and_zero_gradient():
    B, H, Lq, Lk, D = 2, 2, 20, 12, 16
    q, k, v = (torch.randn(B, H, L, D, device=DEVICE, requires_grad=True) for L in (Lq, Lk, Lk))
    padding = torch.ones(B, Lk, dtype=torch.bool, device=DEVICE)
    padding[1] = False  # batch 1 has no real key at all
    # causal with Lq > Lk: queries 0..7 of batch 0 precede every key
    out, lse = flashformer.attention(
        q, k, v, causal=True, key_padding_mask=padding, backend="triton", return_lse=True
    )
    dead = torch.zeros(B, H, Lq, dtype=torch.bool, device=DEVICE)
    dead[0, :, : Lq - Lk] = True
    dead[1] = True
    assert (out[dead] == 0).all() and torch.isfinite(out).all()
    assert (lse[dead] == float("-inf")).all() and torch.isfinite(lse[~dead]).all()
    out.backward(torch.randn_like(out))
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert torch.isfinite(t.grad).all(), f"NaN in d{name}"
    assert (q.grad[dead] == 0).all()
    assert (k.grad[1] == 0).all() and (v.grad[1] == 0).all()
    assert q.grad[~dead].abs().sum() > 0


# ---- strides: views are read as they are, never copied ----


def test_bias_and_mask_with_arbitrary_strides():
    """A bias expanded over batch and queries (stride 0 on full-size dims), a
    permuted mask, and q/k/v views of a (B, L, H, D) layout."""
    B, H, Lq, Lk, D = 2, 3, 26, 39, 32
    gen = torch.Generator().manual_seed(5)
    q, k, v, g = (
        torch.randn(B, L, H, D, generator=gen, dtype=torch.float64).transpose(1, 2) for L in (Lq, Lk, Lk, Lq)
    )
    bias_rows = torch.randn(1, H, 1, Lk, generator=gen, dtype=torch.float64)
    mask = (torch.rand(B, Lk, H, Lq, generator=gen) > 0.2).permute(0, 2, 3, 1)  # (B, H, Lq, Lk), permuted
    results = {}
    for backend, dtype, device in (
        ("eager", torch.float64, "cpu"),
        ("eager", torch.float32, "cpu"),
        ("triton", torch.float32, DEVICE),
    ):
        qkv = [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]
        rows = bias_rows.to(device=device, dtype=dtype).requires_grad_()
        bias = rows.expand(B, H, Lq, Lk)  # strides (0, Lk, 0, 1)
        out = flashformer.attention(*qkv, bias=bias, mask=mask.to(device), backend=backend)
        grads = torch.autograd.grad(out, (*qkv, rows), g.to(device=device, dtype=dtype))
        results[backend, dtype] = [out.double().cpu(), None] + [t.double().cpu() for t in grads]
    assert_within_budget(
        results["triton", torch.float32],
        results["eager", torch.float32],
        results["eager", torch.float64],
        "strides",
    )


# ---- refusals and import hygiene ----


def test_triton_refuses_what_it_cannot_do():
    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(NotImplementedError, match="bias function"):
        flashformer.attention(
            q, q, q, bias=lambda qp, kp: (qp[:, None] - kp[None, :]).float(), backend="triton"
        )
    with pytest.raises(NotImplementedError, match="float64"):
        flashformer.attention(q.double(), q.double(), q.double(), backend="triton")
    big = torch.randn(1, 1, 4, 264, device=DEVICE)
    with pytest.raises(NotImplementedError, match=r"head dims up to 256.*264"):
        flashformer.attention(big, big, big, backend="triton")


def test_auto_picks_triton_for_cuda_tensors_only():
    from flashformer.attention.api import choose_backend
    from flashformer.attention.masks import ScoreRules

    q = torch.randn(1, 2, 16, 32, device=DEVICE, dtype=torch.bfloat16)
    rules = ScoreRules(1, 2, 16, 16, causal=True)
    assert (choose_backend(q, q, q, rules, 0.0, False, False) == "triton") == ON_GPU
    cpu = q.cpu()  # never triton on the CPU, even where the interpreter could run it
    assert choose_backend(cpu, cpu, cpu, rules, 0.0, True, False) == "flash"
    with_bias_fn = ScoreRules(1, 2, 16, 16, bias_fn=lambda qp, kp: qp[:, None] - kp[None, :])
    assert choose_backend(q, q, q, with_bias_fn, 0.0, False, False) != "triton"


def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter runs kernels as Python, so code the GPU compiler rejects
    would pass every test above: compile each kernel with every feature on for
    sm_90 (Triton's wheel carries ptxas; no GPU needed)."""
    script = Path(__file__).parents[2] / "scripts" / "compile_kernels.py"
    done = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "0 of the variants failed to compile for sm_90" in done.stdout


def test_importing_flashformer_does_not_import_triton():
    code = (
        "import sys, torch, flashformer\n"
        "q = torch.randn(1, 1, 4, 8)\n"
        "flashformer.attention(q, q, q, backend='eager'); flashformer.attention(q, q, q)\n"
        "import flashformer.attention.triton\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- varlen: packed sequences of different lengths ----

VARLEN_FEATURES = {
    "plain": {},
    "causal": {"causal": True},
    "window_alibi_softcap": {"window": (6, 2), "alibi": True, "softcap": 4.0},
}


def _packed(q_lens, k_lens, q_heads, kv_heads, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), q_heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(sum(k_lens), kv_heads, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(sum(k_lens), kv_heads, dim, generator=gen, dtype=torch.float64)
    g = torch.randn(sum(q_lens), q_heads, dim, generator=gen, dtype=torch.float64)
    slopes = torch.rand(len(q_lens), q_heads, generator=gen) * 0.5
    return q, k, v, g, slopes


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _eager_per_sequence(q, k, v, g, q_lens, k_lens, dtype, kwargs):
    """Each sequence alone through attention(backend='eager'): (out, lse, dq, dk, dv) packed."""
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    outs, lses = [], []
    cq, ck = _cu(q_lens).tolist(), _cu(k_lens).tolist()
    for b in range(len(q_lens)):
        if q_lens[b] == 0:
            continue
        per_seq = {name: value for name, value in kwargs.items() if name != "alibi_slopes"}
        if "alibi_slopes" in kwargs:
            per_seq["alibi_slopes"] = kwargs["alibi_slopes"][b]
        out, lse = flashformer.attention(
            q[cq[b] : cq[b + 1]].transpose(0, 1)[None],
            k[ck[b] : ck[b + 1]].transpose(0, 1)[None],
            v[ck[b] : ck[b + 1]].transpose(0, 1)[None],
            backend="eager",
            return_lse=True,
            **per_seq,
        )
        outs.append(out[0].transpose(0, 1))  # (Lq_b, H, D)
        lses.append(lse[0])  # (H, Lq_b)
    out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    grads = torch.autograd.grad(out, (q, k, v), g.to(dtype))
    return [t.double() for t in (out, lse, *grads)]


@pytest.mark.parametrize("feature", list(VARLEN_FEATURES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_matches_each_sequence_alone(feature, dtype):
    q_lens, k_lens = [5, 0, 19, 1], [9, 4, 40, 12]  # a sequence with no query at all
    if ON_GPU:
        q_lens, k_lens = [5, 0, 230, 170, 1, 400], [9, 4, 300, 170, 120, 401]
    q, k, v, g, slopes = _packed(q_lens, k_lens, 2, 1, 40)  # MQA
    features = VARLEN_FEATURES[feature]
    kwargs = {name: value for name, value in features.items() if name != "alibi"}
    if features.get("alibi"):
        kwargs["alibi_slopes"] = slopes
    rounded = [t.to(dtype).double() for t in (q, k, v, g)]
    reference = _eager_per_sequence(*rounded, q_lens, k_lens, torch.float64, kwargs)
    eager_low = _eager_per_sequence(q, k, v, g, q_lens, k_lens, dtype, kwargs)

    qd, kd, vd = (t.to(device=DEVICE, dtype=dtype).requires_grad_() for t in (q, k, v))
    device_kwargs = {n: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for n, t in kwargs.items()}
    out, lse = varlen_attention(
        qd, kd, vd, _cu(q_lens).to(DEVICE), _cu(k_lens).to(DEVICE), max(q_lens), max(k_lens),
        return_lse=True, **device_kwargs,
    )  # fmt: skip
    grads = torch.autograd.grad(out, (qd, kd, vd), g.to(device=DEVICE, dtype=dtype))
    got = [t.double().cpu() for t in (out, lse, *grads)]
    assert_within_budget(got + [None], eager_low + [None], reference + [None], f"varlen/{feature}/{dtype}")


def test_varlen_dropout_drops_what_a_padded_batch_drops():
    """Sequence b of a packed batch drops the entries that attention() drops in
    row b of the same batch padded (no causal, so the alignment is the same)."""
    q_lens, k_lens = [7, 19, 12], [11, 8, 20]
    q, k, v, g, _ = _packed(q_lens, k_lens, 2, 2, 24, seed=3)
    seed = 99
    cq, ck = _cu(q_lens).tolist(), _cu(k_lens).tolist()
    batch, lq, lk = len(q_lens), max(q_lens), max(k_lens)
    qp, kp, vp = (
        torch.zeros(batch, 2, lq, 24, dtype=torch.float64),
        torch.zeros(batch, 2, lk, 24, dtype=torch.float64),
        torch.zeros(batch, 2, lk, 24, dtype=torch.float64),
    )
    for b in range(batch):
        qp[b, :, : q_lens[b]] = q[cq[b] : cq[b + 1]].transpose(0, 1)
        kp[b, :, : k_lens[b]] = k[ck[b] : ck[b + 1]].transpose(0, 1)
        vp[b, :, : k_lens[b]] = v[ck[b] : ck[b + 1]].transpose(0, 1)
    padding = torch.arange(lk)[None, :] < torch.tensor(k_lens)[:, None]
    want = flashformer.attention(
        qp, kp, vp, key_padding_mask=padding, dropout_p=0.5, dropout_seed=seed, backend="eager"
    )
    got = varlen_attention(
        q.float().to(DEVICE), k.float().to(DEVICE), v.float().to(DEVICE), _cu(q_lens).to(DEVICE), _cu(k_lens).to(DEVICE),
        lq, lk, dropout_p=0.5, dropout_seed=seed,
    ).double().cpu()  # fmt: skip
    for b in range(batch):
        assert max_err(got[cq[b] : cq[b + 1]], want[b, :, : q_lens[b]].transpose(0, 1)) < 2e-5


# ---- decoding against a KV cache ----

DECODE_CASES = {
    "causal_one_query": ({"causal": True}, 1, None),
    "causal_three_queries_one_split": ({"causal": True}, 3, 1),
    "not_causal": ({"causal": False}, 2, 3),
    "window_alibi_softcap": ({"causal": True, "window": (10, 0), "alibi": True, "softcap": 6.0}, 2, 5),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_matches_attention_on_each_cache(case, dtype):
    features, q_len, num_splits = DECODE_CASES[case]
    batch, q_heads, kv_heads, dim, max_len = 4, 8, 2, 64, 70
    lengths = [70, 33, 2, 0]  # a full cache, a partial one, fewer keys than queries, an empty one
    if ON_GPU:
        max_len, lengths = 3000, [3000, 1337, 2, 0]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, q_heads, q_len, dim, generator=gen, dtype=torch.float64)
    # the caches in a (B, L, H, D) layout, handed over as (B, H, L, D) views
    k_cache = torch.randn(batch, max_len, kv_heads, dim, generator=gen, dtype=torch.float64).transpose(1, 2)
    v_cache = torch.randn(batch, max_len, kv_heads, dim, generator=gen, dtype=torch.float64).transpose(1, 2)
    slopes = torch.rand(q_heads, generator=gen) * 0.3
    kwargs = {name: value for name, value in features.items() if name != "alibi"}
    if features.get("alibi"):
        kwargs["alibi_slopes"] = slopes

    def eager(dt, rounded):
        out = torch.zeros(batch, q_heads, q_len, dim, dtype=torch.float64)
        lse = torch.full((batch, q_heads, q_len), float("-inf"), dtype=torch.float64)
        for b, n in enumerate(lengths):
            if n == 0:
                continue
            args = [t[b : b + 1, :, :n] if t is not q else t[b : b + 1] for t in (q, k_cache, v_cache)]
            args = [(t.to(dtype).double() if rounded else t).to(dt) for t in args]
            out_b, lse_b = flashformer.attention(*args, backend="eager", return_lse=True, **kwargs)
            out[b], lse[b] = out_b[0].double(), lse_b[0].double()
        return [out, lse]

    reference, eager_low = eager(torch.float64, True), eager(dtype, False)
    device_kwargs = {n: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for n, t in kwargs.items()}
    out, lse = decode_attention(
        q.to(device=DEVICE, dtype=dtype), k_cache.to(device=DEVICE, dtype=dtype), v_cache.to(device=DEVICE, dtype=dtype),
        torch.tensor(lengths, dtype=torch.int32, device=DEVICE), num_splits=num_splits, return_lse=True, **device_kwargs,
    )  # fmt: skip
    got = [out.double().cpu(), lse.double().cpu()]
    assert_within_budget(got, eager_low, reference, f"decode/{case}/{dtype}")
    assert (out[3] == 0).all() and (lse[3] == float("-inf")).all()  # the empty cache


def test_varlen_and_decode_name_bad_arguments():
    q = torch.randn(10, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must rise from 0 to the packed length 10"):
        varlen_attention(
            q,
            q,
            q,
            torch.tensor([0, 4, 9], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE),
            5,
            6,
        )
    with pytest.raises(ValueError, match=r"max_seqlen_k must be an int >= the longest sequence \(6\)"):
        varlen_attention(
            q,
            q,
            q,
            torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE),
            6,
            5,
        )
    with pytest.raises(ValueError, match=r"cu_seqlens_k must be a 1-D int32 tensor"):
        varlen_attention(
            q,
            q,
            q,
            torch.tensor([0, 10], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, 10], device=DEVICE),
            10,
            10,
        )
    cache = torch.randn(2, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"cache_seqlens must lie in \[0, L_max = 8\]"):
        decode_attention(
            torch.randn(2, 4, 1, 16, device=DEVICE),
            cache,
            cache,
            torch.tensor([3, 9], dtype=torch.int32, device=DEVICE),
        )
    with pytest.raises(
        ValueError, match=r"cache_seqlens must be an int32/int64 tensor of shape \(B,\) = \(2,\)"
    ):
        decode_attention(
            torch.randn(2, 4, 1, 16, device=DEVICE), cache, cache, torch.tensor([3], device=DEVICE)
        )
