"""Attention over a paged KV cache (flashformer/attention/paged.py).

Each case writes every sequence's keys and values into a pool through
`kv_slots` and `write_kv`, with a shuffled block table, and checks
`paged_attention` against float64 attention over each sequence's own dense
keys (the eager backend, rounded inputs), within the error budget of
attention_cases: 2x the eager backend's own error in that dtype + 1e-5.
Batch invariance is checked bitwise: a sequence alone against the same
sequence in a batch of 16 of random lengths.

Without a GPU the Triton kernel runs in Triton's interpreter (conftest.py) on
small shapes; on a GPU the same tests run on CUDA tensors.
"""

from __future__ import annotations

import importlib
import itertools
import math

import pytest
import torch
from helpers.attention import assert_within_budget, max_err

import flashformer
from flashformer.attention import kv_slots, packed_paged_attention, paged_attention, write_kv
from flashformer.kernels import extension

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BLOCK_SIZE = 4
# A sequence of one key, block_size - 1, block_size, block_size + 1, and longer ones
# crossing the interpreter's 32-key tiles and 64-key splits.
LENGTHS = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 70, 29]
HEADS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}
FEATURES = {
    "plain": {},
    "softcap": {"softcap": 4.0},
    "alibi": {"alibi": True},
    "window": {"window": (9, None)},
    "mix": {"softcap": 6.0, "alibi": True, "window": (20, 0), "scale": 0.3},
}
try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False
# "cpu": the C++ kernel, float32 on the CPU, where it is built
HAS_CPU_KERNEL = DEVICE == "cpu" and extension.load() == "cpp"
BACKENDS = ["flash", "auto"] + (["cpu"] if HAS_CPU_KERNEL else []) + (["triton"] if HAS_TRITON else [])


class PagedCase:
    """Dense float64 keys and values of each sequence, and a pool that holds them.

    The pool is filled with NaN first, and table entries past a sequence's
    blocks are -1: anything read outside a sequence's own keys shows.
    """

    def __init__(self, lengths, kv_heads, dim, dtype, seed=0, dim_v=None, spare_blocks=3):
        gen = torch.Generator().manual_seed(seed)
        self.lengths = list(lengths)
        dim_v = dim_v or dim
        max_blocks = max(1, max(-(-n // BLOCK_SIZE) for n in self.lengths))
        num_blocks = sum(-(-n // BLOCK_SIZE) for n in self.lengths) + spare_blocks
        self.k = [torch.randn(1, kv_heads, n, dim, generator=gen, dtype=torch.float64) for n in self.lengths]
        self.v = [
            torch.randn(1, kv_heads, n, dim_v, generator=gen, dtype=torch.float64) for n in self.lengths
        ]
        shape = (kv_heads, num_blocks, BLOCK_SIZE)
        self.k_pool = torch.full(shape + (dim,), float("nan"), dtype=dtype, device=DEVICE)
        self.v_pool = torch.full(shape + (dim_v,), float("nan"), dtype=dtype, device=DEVICE)
        order = torch.randperm(num_blocks, generator=gen)  # non-contiguous, out of order
        self.block_tables = torch.full((len(self.lengths), max_blocks), -1, dtype=torch.int32)
        used = 0
        for b, n in enumerate(self.lengths):
            blocks = -(-n // BLOCK_SIZE)
            self.block_tables[b, :blocks] = order[used : used + blocks].int()
            used += blocks
        self.block_tables = self.block_tables.to(DEVICE)
        self.seq_lens = torch.tensor(self.lengths, dtype=torch.int32, device=DEVICE)
        for b, n in enumerate(self.lengths):
            if n:
                positions = torch.arange(n, device=DEVICE)[None]  # (1, n)
                slots = kv_slots(self.block_tables[b : b + 1], positions, BLOCK_SIZE)
                write_kv(
                    self.k_pool,
                    self.v_pool,
                    self.dense(self.k, b, dtype),
                    self.dense(self.v, b, dtype),
                    slots,
                )

    @staticmethod
    def dense(tensors, b, dtype):
        return tensors[b].to(device=DEVICE, dtype=dtype)

    def row(self, b: int):
        """(block_tables, seq_lens) of sequence b alone."""
        return self.block_tables[b : b + 1], self.seq_lens[b : b + 1]


def reference(case: PagedCase, q: torch.Tensor, dtype, rounded: bool, **kwargs):
    """(out, lse) of each sequence on its own dense keys, eager backend: in float64 on
    the inputs rounded to dtype (rounded=True), or in dtype itself."""
    batch, q_heads, q_len, _ = q.shape
    out = torch.zeros(batch, q_heads, q_len, case.v[0].shape[-1], dtype=torch.float64)
    lse = torch.full((batch, q_heads, q_len), float("-inf"), dtype=torch.float64)
    for b, n in enumerate(case.lengths):
        if n == 0:
            continue
        args = [q[b : b + 1].cpu(), case.k[b], case.v[b]]
        args = [(t.to(dtype).double() if rounded else t.to(dtype)) for t in args]
        slopes = kwargs.get("alibi_slopes")  # (B, Hq) or None
        per_row = dict(kwargs, alibi_slopes=None if slopes is None else slopes[b].cpu())
        out_b, lse_b = flashformer.attention(*args, causal=True, backend="eager", return_lse=True, **per_row)
        out[b], lse[b] = out_b[0].double(), lse_b[0].double()
    return out, lse


def feature_kwargs(features: dict, q_heads: int, batch: int, gen: torch.Generator) -> dict:
    kwargs = {name: value for name, value in features.items() if name != "alibi"}
    if features.get("alibi"):
        kwargs["alibi_slopes"] = (torch.rand(batch, q_heads, generator=gen) * 0.5).to(DEVICE)
    return kwargs


def _accuracy_cases():
    """Every backend x dtype x feature once, heads and Lq rotating."""
    for backend_index, backend in enumerate(BACKENDS):
        for dtype_index, dtype in enumerate(DTYPES if backend != "cpu" else [torch.float32]):
            for feature_index, feature in enumerate(FEATURES):
                turn = backend_index + dtype_index + feature_index
                heads = list(HEADS)[turn % len(HEADS)]
                q_len = (1, 3)[turn % 2]
                name = str(dtype).removeprefix("torch.")
                yield pytest.param(
                    backend, dtype, feature, heads, q_len, id=f"{backend}-{name}-{feature}-{heads}-q{q_len}"
                )


@pytest.mark.parametrize("backend, dtype, feature, heads, q_len", list(_accuracy_cases()))
def test_matches_float64_attention_of_each_sequence(backend, dtype, feature, heads, q_len):
    q_heads, kv_heads = HEADS[heads]
    dim = 16
    case = PagedCase(LENGTHS, kv_heads, dim, dtype, seed=q_heads + q_len)
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(len(LENGTHS), q_heads, q_len, dim, generator=gen, dtype=torch.float64)
    kwargs = feature_kwargs(FEATURES[feature], q_heads, len(LENGTHS), gen)
    out, lse = paged_attention(
        q.to(DEVICE, dtype), case.k_pool, case.v_pool, case.block_tables, case.seq_lens,
        backend=backend, return_lse=True, **kwargs,
    )  # fmt: skip
    assert out.dtype == dtype and out.shape == (len(LENGTHS), q_heads, q_len, dim)
    got = [out.double().cpu(), lse.double().cpu()]
    want = reference(case, q, dtype, rounded=True, **kwargs)
    eager_low = reference(case, q, dtype, rounded=False, **kwargs)
    assert_within_budget(got, eager_low, want, f"paged/{backend}/{dtype}/{feature}")


@pytest.mark.parametrize("backend", BACKENDS + ["eager", "torch"])
def test_a_value_head_dim_of_its_own_and_more_queries_than_keys(backend):
    """Dv != D; a sequence shorter than Lq (its first queries see no key: output 0,
    lse -inf) and an empty one (all zeros)."""
    lengths, q_heads, q_len = [2, 0, 9, 37], 4, 3
    case = PagedCase(lengths, 2, 16, torch.float32, dim_v=8)
    q = torch.randn(
        len(lengths), q_heads, q_len, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64
    )
    result = paged_attention(
        q.float().to(DEVICE), case.k_pool, case.v_pool, case.block_tables, case.seq_lens,
        backend=backend, return_lse=backend != "torch",
    )  # fmt: skip
    out, lse = result if backend != "torch" else (result, None)
    want_out, want_lse = reference(case, q, torch.float32, rounded=True)
    assert (out.double().cpu() - want_out).abs().max() < 1e-5
    assert (out[0, :, 0] == 0).all() and (out[1] == 0).all()
    if lse is not None:
        assert torch.allclose(lse.double().cpu(), want_lse, atol=1e-5)
        assert (lse[0, :, 0] == float("-inf")).all() and (lse[1] == float("-inf")).all()


# ---- batch invariance ----

INVARIANCE = {
    "decode": (1, {}),
    "chunk": (3, {}),
    "decode_features": (1, {"softcap": 5.0, "alibi": True, "window": (40, None)}),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("setting", list(INVARIANCE))
def test_a_sequence_alone_and_in_a_batch_of_16_give_the_same_bits(backend, setting):
    q_len, features = INVARIANCE[setting]
    q_heads, kv_heads, dim = 6, 2, 16
    gen = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 100, (16,), generator=gen).tolist()
    lengths[:3] = [1, BLOCK_SIZE + 1, 99]  # the sequences checked alone
    case = PagedCase(lengths, kv_heads, dim, torch.float32, seed=4)
    q = torch.randn(16, q_heads, q_len, dim, generator=gen).to(DEVICE)
    kwargs = feature_kwargs(features, q_heads, 16, gen)
    batched = paged_attention(
        q, case.k_pool, case.v_pool, case.block_tables, case.seq_lens, backend=backend, **kwargs
    )
    for b in range(3):
        alone_kwargs = dict(kwargs)
        if "alibi_slopes" in kwargs:
            alone_kwargs["alibi_slopes"] = kwargs["alibi_slopes"][b : b + 1]
        alone = paged_attention(
            q[b : b + 1], case.k_pool, case.v_pool, *case.row(b), backend=backend, **alone_kwargs
        )
        assert torch.equal(alone[0], batched[b]), (
            f"sequence {b} ({lengths[b]} keys) differs alone and batched"
        )


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariance_at_smollm2_shapes(backend):
    """SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, D 64, blocks of 16),
    sequences of 50..1000 keys, batches of 1, 4 and 16 holding the same first sequence."""
    gen = torch.Generator().manual_seed(7)
    q_heads, kv_heads, dim, block_size, max_blocks = 9, 3, 64, 16, 63
    num_blocks = 16 * max_blocks
    k_pool = torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen).to(DEVICE)
    v_pool = torch.randn(kv_heads, num_blocks, block_size, dim, generator=gen).to(DEVICE)
    tables = (
        torch.randperm(num_blocks, generator=gen)[: 16 * max_blocks].view(16, max_blocks).int().to(DEVICE)
    )
    lengths = torch.randint(50, 1001, (16,), generator=gen, dtype=torch.int32).to(DEVICE)
    q = torch.randn(16, q_heads, 1, dim, generator=gen).to(DEVICE)
    outs = [
        paged_attention(q[:n], k_pool, v_pool, tables[:n], lengths[:n], backend=backend)[0]
        for n in (1, 4, 16)
    ]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


# ---- the cache: writing, layout, steps ----


def test_the_pool_layout_read_element_by_element():
    """Key p of sequence b is at pool[:, block_tables[b, p // block_size], p % block_size]."""
    case = PagedCase([5, 11], kv_heads=2, dim=3, dtype=torch.float64)
    for b, n in enumerate(case.lengths):
        for p in range(n):
            block = int(case.block_tables[b, p // BLOCK_SIZE])
            assert torch.equal(case.k_pool[:, block, p % BLOCK_SIZE].cpu(), case.k[b][0, :, p])
            assert torch.equal(case.v_pool[:, block, p % BLOCK_SIZE].cpu(), case.v[b][0, :, p])
    slots = kv_slots(case.block_tables, torch.tensor([[0, 4, 5], [10, 3, 8]], device=DEVICE), BLOCK_SIZE)
    tables = case.block_tables.cpu().tolist()
    assert slots.dtype == torch.int64
    assert slots.tolist() == [
        [tables[0][0] * 4, tables[0][1] * 4, tables[0][1] * 4 + 1],
        [tables[1][2] * 4 + 2, tables[1][0] * 4 + 3, tables[1][2] * 4],
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_in_chunks_then_decode_equals_causal_attention_over_the_whole_sequence(backend):
    """The server's cycle: write a step's new keys at kv_slots, then attend. Two
    sequences, each in its own shuffled blocks: a prompt of 10 tokens prefilled
    in two chunks of 5, then 3 decode steps."""
    gen = torch.Generator().manual_seed(11)
    q_heads, kv_heads, dim, total = 4, 2, 16, 13
    q = torch.randn(2, q_heads, total, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(2, kv_heads, total, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(2, kv_heads, total, dim, generator=gen, dtype=torch.float64)
    want = flashformer.attention(q, k, v, causal=True, backend="eager")  # (2, Hq, total, D)
    k_pool = torch.zeros(kv_heads, 9, BLOCK_SIZE, dim, device=DEVICE)
    v_pool = torch.zeros_like(k_pool)
    block_tables = torch.tensor([[7, 0, 3, 5], [2, 8, 1, 6]], dtype=torch.int32, device=DEVICE)
    got = torch.zeros_like(want)
    start = 0
    for step_len in (5, 5, 1, 1, 1):  # two chunks of a prompt, then three decode steps
        positions = torch.arange(start, start + step_len, device=DEVICE)[None].expand(2, -1)  # (B, Lq)
        slots = kv_slots(block_tables, positions, BLOCK_SIZE)
        new = slice(start, start + step_len)
        write_kv(k_pool, v_pool, k[:, :, new].float().to(DEVICE), v[:, :, new].float().to(DEVICE), slots)
        seq_lens = torch.full((2,), start + step_len, dtype=torch.int32, device=DEVICE)
        out = paged_attention(
            q[:, :, new].float().to(DEVICE), k_pool, v_pool, block_tables, seq_lens, backend=backend
        )
        got[:, :, new] = out.double().cpu()
        start += step_len
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feature", FEATURES)
def test_float16_pools_give_what_their_float32_widening_gives(backend, feature):
    """float32 queries over float16 pools (a quantized model's cache): every backend computes what
    it computes on the pools widened to float32, bit for bit; sequences of 70 keys cross the C++
    kernel's 64-key spans, which it widens as it reads them."""
    q_heads, kv_heads = HEADS["gqa"]
    case = PagedCase(LENGTHS, kv_heads, 16, torch.float16, seed=8)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(len(LENGTHS), q_heads, 2, 16, generator=gen).to(DEVICE)
    kwargs = feature_kwargs(FEATURES[feature], q_heads, len(LENGTHS), gen)
    args = (case.block_tables, case.seq_lens)
    got = paged_attention(q, case.k_pool, case.v_pool, *args, backend=backend, **kwargs)
    widened = paged_attention(q, case.k_pool.float(), case.v_pool.float(), *args, backend=backend, **kwargs)
    assert got.dtype == torch.float32
    assert torch.equal(got, widened)


def test_write_kv_rounds_float32_into_float16_pools_and_refuses_other_mixes():
    k_pool, v_pool = torch.zeros(2, 3, BLOCK_SIZE, 5, dtype=torch.float16), torch.zeros(2, 3, BLOCK_SIZE, 6)
    k_new, v_new = torch.randn(1, 2, 2, 5), torch.randn(1, 2, 2, 6)
    write_kv(k_pool, v_pool.half(), k_new, v_new, torch.tensor([[3, 7]]))
    assert torch.equal(k_pool[:, 0, 3], k_new[0, :, 0].half())
    assert torch.equal(k_pool[:, 1, 3], k_new[0, :, 1].half())
    with pytest.raises(
        TypeError, match=r"k_new must have its pool's dtype and device \(torch.float16 on cpu\)"
    ):
        write_kv(k_pool, v_pool.half(), k_new.bfloat16(), v_new, torch.tensor([[3, 7]]))
    with pytest.raises(TypeError, match=r"got q torch.float32, k_pool torch.float16, v_pool torch.float32"):
        paged_attention(
            torch.randn(1, 2, 1, 5),
            k_pool,
            torch.zeros(2, 3, BLOCK_SIZE, 5),
            torch.tensor([[0]]),
            torch.tensor([2]),
        )


def test_write_kv_takes_a_packed_batch_and_refuses_bad_slots():
    k_pool = torch.zeros(2, 3, BLOCK_SIZE, 5)
    v_pool = torch.zeros(2, 3, BLOCK_SIZE, 6)
    k_new, v_new = torch.randn(1, 2, 4, 5), torch.randn(1, 2, 4, 6)
    write_kv(k_pool, v_pool, k_new, v_new, torch.tensor([[11, 0, 5, 6]]))  # packed tokens: B = 1
    for index, slot in enumerate((11, 0, 5, 6)):
        assert torch.equal(k_pool[:, slot // BLOCK_SIZE, slot % BLOCK_SIZE], k_new[0, :, index])
        assert torch.equal(v_pool[:, slot // BLOCK_SIZE, slot % BLOCK_SIZE], v_new[0, :, index])
    with pytest.raises(
        ValueError, match=r"slots must lie in \[0, num_blocks \* block_size = 12\); got values in \[0, 12\]"
    ):
        write_kv(k_pool, v_pool, k_new, v_new, torch.tensor([[12, 0, 5, 6]]))
    with pytest.raises(ValueError, match=r"slots must be distinct"):
        write_kv(k_pool, v_pool, k_new, v_new, torch.tensor([[1, 1, 5, 6]]))
    with pytest.raises(ValueError, match=r"slots must have shape \(B, L\) = \(1, 4\)"):
        write_kv(k_pool, v_pool, k_new, v_new, torch.tensor([1, 2, 5, 6]).view(2, 2))
    with pytest.raises(
        TypeError, match=r"k_new must have its pool's dtype and device \(torch.float32 on cpu\)"
    ):
        write_kv(k_pool, v_pool, k_new.double(), v_new, torch.tensor([[1, 2, 5, 6]]))
    with pytest.raises(
        ValueError, match=r"v_new \(B, Hk, L, D\) must have the heads and head dim of its pool"
    ):
        write_kv(k_pool, v_pool, k_new, k_new, torch.tensor([[1, 2, 5, 6]]))
    with pytest.raises(ValueError, match=r"positions must lie in \[0, max_blocks \* block_size = 8\)"):
        kv_slots(torch.zeros(1, 2, dtype=torch.int32), torch.tensor([[8]]), BLOCK_SIZE)


# ---- bad arguments ----


def _good():
    k_pool = torch.zeros(2, 5, BLOCK_SIZE, 8)
    return {
        "q": torch.zeros(2, 4, 1, 8),
        "k_pool": k_pool,
        "v_pool": torch.zeros_like(k_pool),
        "block_tables": torch.tensor([[0, 1], [2, -1]], dtype=torch.int32),
        "seq_lens": torch.tensor([8, 3], dtype=torch.int32),
    }


BAD_ARGUMENTS = {
    "table entry past the pool": (
        {"block_tables": torch.tensor([[0, 5], [2, 0]], dtype=torch.int32)},
        ValueError,
        r"block_tables\[0, 1\] = 5 is not a block of the pool \(num_blocks = 5\); sequence 0 holds 8 keys",
    ),
    "negative table entry in use": (
        {"block_tables": torch.tensor([[0, 1], [-1, 0]], dtype=torch.int32)},
        ValueError,
        r"block_tables\[1, 0\] = -1 is not a block of the pool",
    ),
    "seq_lens past the table": (
        {"seq_lens": torch.tensor([9, 3], dtype=torch.int32)},
        ValueError,
        r"seq_lens must lie in \[0, max_blocks \* block_size = 8\] \(block_tables \(2, 2\), block_size 4\); "
        r"got seq_lens\[0\] = 9",
    ),
    "float table": (
        {"block_tables": torch.zeros(2, 2)},
        ValueError,
        r"block_tables must be an int32/int64 tensor of shape \(B, max_blocks\); got tensor of dtype torch.float32",
    ),
    "seq_lens of another batch": (
        {"seq_lens": torch.tensor([8], dtype=torch.int32)},
        ValueError,
        r"block_tables \(B, max_blocks\) and seq_lens \(B,\) must have a row per query row, B = 2",
    ),
    "pool dtype": (
        {"v_pool": torch.zeros(2, 5, BLOCK_SIZE, 8, dtype=torch.float16)},
        TypeError,
        r"q, k_pool and v_pool must share a dtype \(or be float32 q with float16 k_pool and v_pool\); "
        r"got q torch.float32, k_pool torch.float32, v_pool torch.float16",
    ),
    "pool device": (
        {"q": torch.zeros(2, 4, 1, 8, device="meta")},
        ValueError,
        r"q, k_pool and v_pool must be on one device; got meta, cpu, cpu",
    ),
    "pools of different blocks": (
        {"v_pool": torch.zeros(2, 6, BLOCK_SIZE, 8)},
        ValueError,
        r"v_pool must have the heads, blocks and block size of k_pool .* got k_pool \(2, 5, 4, 8\), v_pool \(2, 6, 4, 8\)",
    ),
    "a 3-D pool": (
        {"k_pool": torch.zeros(2, 20, 8)},
        ValueError,
        r"k_pool must be a 4-D tensor \(Hk, num_blocks, block_size, D\); got tensor of dtype torch.float32 and shape \(2, 20, 8\)",
    ),
    "head dim": (
        {"q": torch.zeros(2, 4, 1, 16)},
        ValueError,
        r"q \(B, Hq, Lq, D\) and k_pool \(Hk, num_blocks, block_size, D\) must share the head dim D",
    ),
    "heads": (
        {"q": torch.zeros(2, 3, 1, 8)},
        ValueError,
        r"the query heads Hq must be a multiple of the key/value heads Hk; got q \(2, 3, 1, 8\) \(Hq=3\)",
    ),
    "backend": (
        {"backend": "paged"},
        ValueError,
        r"backend must be one of \('auto', 'cpu', 'eager', 'flash', 'torch', 'triton'\)",
    ),
    "alibi shape": (
        {"alibi_slopes": torch.zeros(3)},
        ValueError,
        r"alibi_slopes must have shape \(Hq,\) = \(4,\)",
    ),
    "window": ({"window": (-1, 0)}, ValueError, r"window sizes must be >= 0"),
    "softcap": ({"softcap": 0.0}, ValueError, r"softcap must be a positive number or None; got 0.0"),
    "scale": ({"scale": float("nan")}, ValueError, r"scale must be a finite number or None"),
    "softcap on SDPA": (
        {"softcap": 2.0, "backend": "torch"},
        NotImplementedError,
        r"backend='torch' does not support softcap",
    ),
}


@pytest.mark.parametrize("name", list(BAD_ARGUMENTS))
def test_bad_arguments_are_named(name):
    changes, error, message = BAD_ARGUMENTS[name]
    args = _good()  # the tensors; any other change is a keyword argument
    args.update(changes)
    with pytest.raises(error, match=message):
        paged_attention(**args)


def test_the_good_arguments_run_and_unused_table_entries_are_never_read():
    args = _good()
    out = paged_attention(*args.values(), backend="flash")  # the -1 of row 1 is past its 3 keys
    assert out.shape == (2, 4, 1, 8) and torch.isfinite(out).all()
    assert torch.equal(paged_attention(*args.values(), backend="flash", validate=False), out)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_refuses_float64_naming_it():
    args = {name: (t.double() if t.is_floating_point() else t).to(DEVICE) for name, t in _good().items()}
    with pytest.raises(
        NotImplementedError,
        match=r"backend='triton' supports float16, bfloat16 and float32 inputs; got torch.float64",
    ):
        paged_attention(*args.values(), backend="triton")
    assert paged_attention(*args.values()).dtype == torch.float64  # auto runs it per sequence


@pytest.mark.skipif(DEVICE != "cuda", reason="auto picks triton for CUDA tensors")
def test_auto_runs_the_triton_kernel_on_cuda(monkeypatch):
    triton_module = importlib.import_module("flashformer.attention.triton")

    calls = []
    original = triton_module.triton_paged_attention
    monkeypatch.setattr(
        triton_module, "triton_paged_attention", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    case = PagedCase([5, 9], 2, 16, torch.float16)
    paged_attention(
        torch.randn(2, 4, 1, 16, device=DEVICE, dtype=torch.float16),
        case.k_pool,
        case.v_pool,
        case.block_tables,
        case.seq_lens,
    )
    assert calls == [1]


def test_math_by_hand_for_one_decode_step():
    """An independent check of the semantics: softmax(q k^T / sqrt(D)) v over a
    sequence's keys, written out in float64."""
    case = PagedCase([6], kv_heads=1, dim=4, dtype=torch.float64)
    q = torch.randn(1, 2, 1, 4, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    out = paged_attention(
        q.to(DEVICE), case.k_pool, case.v_pool, case.block_tables, case.seq_lens, backend="flash"
    )
    k, v = case.k[0][0, 0], case.v[0][0, 0]  # (6, 4)
    for head in range(2):
        scores = [float(q[0, head, 0] @ k[j]) / math.sqrt(4) for j in range(6)]
        weights = [math.exp(s - max(scores)) for s in scores]
        expected = sum(w * v[j] for j, w in enumerate(weights)) / sum(weights)
        assert torch.allclose(out[0, head, 0].cpu(), expected, atol=1e-12)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("split_len", [32, 96])
def test_the_triton_kernel_at_other_split_lengths(split_len):
    """One split per key tile, and splits of three tiles (96 keys: not a power of two)."""
    from flashformer.attention.masks import ScoreRules
    from flashformer.attention.triton import triton_paged_attention

    case = PagedCase([1, 33, 70, 97], kv_heads=2, dim=16, dtype=torch.float32)
    q = torch.randn(4, 4, 2, 16, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    rules = ScoreRules(4, 4, 2, case.block_tables.shape[1] * BLOCK_SIZE, causal=True)
    out, lse = triton_paged_attention(
        q.float().to(DEVICE),
        case.k_pool,
        case.v_pool,
        case.block_tables,
        case.seq_lens,
        rules,
        0.25,
        split_len,
    )
    want_out, want_lse = reference(case, q, torch.float32, rounded=True, scale=0.25)
    assert max_err(out.double().cpu(), want_out) < 1e-5
    assert max_err(lse.double().cpu(), want_lse) < 1e-5  # -inf where sequence 0's first query sees no key


# ---- packed: sequences with different numbers of new queries in one call ----


@pytest.mark.parametrize("cpu_kernel", [True, False] if HAS_CPU_KERNEL else [False])
def test_packed_sequences_get_what_each_gets_alone(cpu_kernel, monkeypatch):
    """A decode token, a prompt chunk, a sequence with no new query and a whole prompt, packed:
    each sequence's rows equal paged_attention of that sequence alone (the same bits with the
    C++ kernel; within float32 rounding of the float64 reference either way)."""
    if not cpu_kernel:
        monkeypatch.setattr(
            importlib.import_module("flashformer.attention.cpu_kernel"), "cpu_kernel_runs", lambda q: False
        )
    lengths, counts = [40, 23, 17, 9], [1, 7, 0, 9]
    q_heads, kv_heads, dim = 6, 2, 16
    case = PagedCase(lengths, kv_heads, dim, torch.float32, seed=11)
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(sum(counts), q_heads, dim, generator=gen).to(DEVICE)
    starts = torch.tensor([0] + list(itertools.accumulate(counts)), device=DEVICE)
    out = packed_paged_attention(q, case.k_pool, case.v_pool, case.block_tables, case.seq_lens, starts)
    assert out.shape == (sum(counts), q_heads, dim)
    for b, (begin, end) in enumerate(zip(starts.tolist(), starts.tolist()[1:])):
        if end == begin:
            continue
        rows = q[begin:end].transpose(0, 1)[None]  # (1, Hq, n, D)
        backend = "cpu" if cpu_kernel else "auto"
        alone = paged_attention(rows, case.k_pool, case.v_pool, *case.row(b), backend=backend)
        got = out[begin:end].transpose(0, 1)[None]
        if cpu_kernel:
            assert torch.equal(got, alone), b
        k, v = case.k[b].double(), case.v[b].double()
        exact = flashformer.attention(rows.double().cpu(), k, v, causal=True, backend="eager")
        assert (got.double().cpu() - exact).abs().max() < 1e-5, b


def test_packed_refuses_bad_starts():
    case = PagedCase([5, 6], 1, 8, torch.float32)
    q = torch.randn(3, 2, 8, device=DEVICE)
    for starts, message in (([0, 3], "S \\+ 1 = 3 entries"), ([0, 2, 2], "rise from 0 to T = 3")):
        with pytest.raises(ValueError, match=message):
            packed_paged_attention(
                q,
                case.k_pool,
                case.v_pool,
                case.block_tables,
                case.seq_lens,
                torch.tensor(starts, device=DEVICE),
            )
