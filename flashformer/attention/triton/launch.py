"""Host side of the Triton kernels: tile sizes, launches, the autograd Function.

Importing this module imports Triton; entry_points.py imports it
only when a Triton kernel is actually asked for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from flashformer.attention.masks import dropout_head_keys, dropout_threshold
from flashformer.attention.triton.backward import (
    attention_backward_delta,
    attention_backward_dkdv,
    attention_backward_dq,
)
from flashformer.attention.triton.decode import combine_in_order, decode_combine, decode_split
from flashformer.attention.triton.forward import attention_forward

try:  # where Triton keeps it has moved between releases
    from triton.runtime.errors import OutOfResources
except ImportError:  # pragma: no cover
    from triton.runtime.autotuner import OutOfResources


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---- tile sizes ----
#
# Not yet chosen by timing on a GPU (none was at hand when they were written).
# The forward keeps a (BLOCK_M, D) query tile and its (BLOCK_M, Dv) float32
# accumulator in registers and streams (BLOCK_N, D) key/value tiles through
# shared memory; the dK/dV kernel keeps two (BLOCK_N, D) float32
# accumulators, so its tiles are smaller. Each entry is the largest tile tried
# that ptxas compiles for sm_90 without spilling registers to the stack (the
# dK/dV kernel at D <= 64: 24 bytes), in the causal bf16 variant
# (scripts/compile_kernels.py prints registers, stack and
# shared memory of every kernel without a GPU). A configuration the GPU cannot
# hold (shared memory) is stepped down at launch (see _launch). In the
# interpreter, 16 x 32 tiles make small test inputs cross many tile edges.
_GPU_TILES = {
    # kind: [(max head dim, (BLOCK_M, BLOCK_N, num_warps, num_stages)), ...]
    "forward": [(64, (128, 128, 8, 3)), (128, (128, 64, 8, 3)), (256, (64, 32, 8, 2))],
    "dkdv": [(64, (32, 128, 8, 3)), (128, (32, 64, 8, 2)), (256, (32, 32, 8, 1))],
    "dq": [(64, (128, 64, 8, 3)), (128, (128, 64, 8, 2)), (256, (32, 32, 4, 1))],
    "decode": [(64, (16, 64, 4, 3)), (128, (16, 64, 8, 3)), (256, (16, 32, 4, 2))],
}
_stepped_down: dict[tuple, tuple[int, int, int, int]] = {}  # tiles that fit, where the table's did not


def _tiles(kind: str, dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a kernel kind for a head dim."""
    return (16, 32, 4, 1) if interpreting() else gpu_tiles(kind, dim)


def gpu_tiles(kind: str, dim: int) -> tuple[int, int, int, int]:
    """The GPU's (BLOCK_M, BLOCK_N, num_warps, num_stages) from the table above."""
    for max_dim, tiles in _GPU_TILES[kind]:
        if dim <= max_dim:
            return tiles
    raise NotImplementedError(f"backend='triton' supports head dims up to 256; got {dim}")


def _block(dim: int) -> int:
    """Register width for a head dim: a power of two >= 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(dim))


def _launch(kernel, kind: str, dim: int, grid_of, args: dict, constants: dict, rows: int | None = None):
    """Launch with the tile sizes for `kind`; if the GPU cannot hold them,
    retry with fewer pipeline stages, then smaller tiles (the step-down is
    remembered per request, so it is paid once)."""
    block_m, block_n, warps, stages = tiles = _tiles(kind, dim)
    if rows is not None:  # no taller query tile than there are queries
        block_m = min(block_m, max(16, triton.next_power_of_2(rows)))
    key = (kind, dim, tuple(sorted(constants.items())), block_m, tiles)
    block_m, block_n, warps, stages = _stepped_down.get(key, (block_m, block_n, warps, stages))
    while True:
        try:
            kernel[grid_of(block_m, block_n)](
                **args, **constants, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages
            )
            return block_m, block_n
        except OutOfResources:
            if stages > 1:
                stages -= 1
            elif block_n > 16:
                block_n //= 2
            elif block_m > 16:
                block_m //= 2
            else:
                raise
            _stepped_down[key] = (block_m, block_n, warps, stages)


# ---- one attention call, described for the kernels ----


@dataclass(frozen=True)
class Plan:
    """Everything about a call that is not q, k, v or the bias tensor.

    Padded layout: q (B, Hq, Lq, D), lse (B, Hq, Lq). Varlen layout: q
    (total_q, Hq, D) with cu_q (B+1,) int32 offsets, lse (Hq, total_q).
    """

    batch: int
    q_heads: int
    kv_heads: int
    max_q_len: int
    max_k_len: int
    scale: float
    softcap: float | None = None
    window_left: int | None = None
    right_limit: int | None = None
    key_padding_mask: Tensor | None = None  # (B, 1, 1, Lk) bool
    mask: Tensor | None = None  # 4-D bool, size 1 on broadcast dims
    alibi_slopes: Tensor | None = None  # (B|1, Hq, 1, 1) float32
    dropout_p: float = 0.0
    dropout_seed: int | None = None
    cu_q: Tensor | None = None  # varlen only
    cu_k: Tensor | None = None

    @property
    def varlen(self) -> bool:
        return self.cu_q is not None


def _seq_strides(t: Tensor, varlen: bool) -> tuple[int, ...]:
    """(batch, head, position, dim) strides; a packed (T, H, D) tensor has batch stride 0."""
    if varlen:
        return 0, t.stride(1), t.stride(0), t.stride(2)
    return tuple(t.stride())


def _lse_strides(t: Tensor, varlen: bool) -> tuple[int, int, int]:
    return (0, t.stride(0), t.stride(1)) if varlen else tuple(t.stride())


def _broadcast_strides(t: Tensor) -> tuple[int, int, int, int]:
    """Strides of a 4-D tensor, 0 on its size-1 (broadcast) dims."""
    return tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride()))


def _precision(dtype: torch.dtype) -> str:
    """The `dot` mode of scores.py for inputs of this dtype."""
    if dtype == torch.float32:
        return "ieee"  # float32 products, as the eager backend computes them, not TF32
    if dtype == torch.bfloat16 and interpreting():
        return "bf16_as_fp32"  # the interpreter's bf16 tl.dot is wrong (see scores.dot)
    return "tf32"


def _rule_args(plan: Plan, bias: Tensor | None, like: Tensor) -> tuple[dict, dict]:
    """(runtime arguments, compile-time flags) describing masks, bias, ALiBi, dropout."""
    args = {
        "scale": plan.scale,
        "softcap": plan.softcap or 1.0,
        "window_left": plan.window_left or 0,
        "right_limit": plan.right_limit or 0,
        "cu_q": plan.cu_q if plan.varlen else like,
        "cu_k": plan.cu_k if plan.varlen else like,
        "LQ": plan.max_q_len,
        "LK": plan.max_k_len,
        "H": plan.q_heads,
        "G": plan.q_heads // plan.kv_heads,
    }
    for name, t in (("bias", bias), ("mask", None if plan.mask is None else plan.mask.view(torch.uint8))):
        strides = (0, 0, 0, 0) if t is None else _broadcast_strides(t)
        args[f"{name}_ptr"] = like if t is None else t
        args.update({f"s_{name[0]}{axis}": s for axis, s in zip("bhmn", strides)})
    pad = plan.key_padding_mask
    args["pad_ptr"] = like if pad is None else pad.view(torch.uint8)
    args["s_pb"], args["s_pn"] = (0, 0) if pad is None else (pad.stride(0), pad.stride(3))
    slopes = plan.alibi_slopes
    args["slopes_ptr"] = like if slopes is None else slopes
    args["s_ab"], args["s_ah"] = (0, 0) if slopes is None else _broadcast_strides(slopes)[:2]
    if plan.dropout_p > 0:
        args["head_keys_ptr"] = dropout_head_keys(plan.dropout_seed, plan.batch, plan.q_heads, like.device)
        args["dropout_threshold"] = dropout_threshold(plan.dropout_p)
        args["dropout_scale"] = 1.0 / (1.0 - plan.dropout_p)
    else:
        args.update(head_keys_ptr=like, dropout_threshold=0, dropout_scale=1.0)
    flags = {
        "HAS_SOFTCAP": plan.softcap is not None,
        "HAS_BIAS": bias is not None,
        "HAS_MASK": plan.mask is not None,
        "HAS_PAD": pad is not None,
        "HAS_ALIBI": slopes is not None,
        "HAS_LEFT": plan.window_left is not None,
        "HAS_RIGHT": plan.right_limit is not None,
        "DROPOUT": plan.dropout_p > 0,
        "VARLEN": plan.varlen,
        "PRECISION": _precision(like.dtype),
    }
    return args, flags


def _io_strides(prefix: str, t: Tensor, varlen: bool, axes: str = "bhmd") -> dict:
    return {f"{prefix}{axis}": s for axis, s in zip(axes, _seq_strides(t, varlen))}


def forward(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, plan: Plan) -> tuple[Tensor, Tensor]:
    """out (like q, with v's head dim) in q's dtype; lse float32 (B, Hq, Lq) or (Hq, total_q)."""
    dim, dim_v = q.shape[-1], v.shape[-1]
    out = q.new_empty(q.shape[:-1] + (dim_v,))
    if plan.varlen:
        lse = torch.empty(plan.q_heads, q.shape[0], dtype=torch.float32, device=q.device)
    else:
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    rule_args, flags = _rule_args(plan, bias, q)
    args = {
        "q_ptr": q, "k_ptr": k, "v_ptr": v, "out_ptr": out, "lse_ptr": lse,
        **_io_strides("s_q", q, plan.varlen),
        **_io_strides("s_k", k, plan.varlen, "bhnd"),
        **_io_strides("s_v", v, plan.varlen, "bhnd"),
        **_io_strides("s_o", out, plan.varlen),
        **dict(zip(("s_lb", "s_lh", "s_lm"), _lse_strides(lse, plan.varlen))),
        **rule_args, "D": dim, "DV": dim_v,
    }  # fmt: skip
    constants = {**flags, "BLOCK_D": _block(dim), "BLOCK_DV": _block(dim_v)}

    def grid(block_m, block_n):
        return (triton.cdiv(plan.max_q_len, block_m), plan.batch * plan.q_heads)

    _launch(attention_forward, "forward", max(dim, dim_v), grid, args, constants, rows=plan.max_q_len)
    return out, lse


def backward(grad_out, grad_lse, q, k, v, bias, out, lse, plan: Plan, bias_needs_grad: bool):
    """(dq, dk, dv, dbias) — dbias (bias' shape) only when bias_needs_grad."""
    dim, dim_v = q.shape[-1], v.shape[-1]
    if grad_out is None:  # only the LSE was used
        grad_out = torch.zeros_like(out)
    delta = torch.empty_like(lse)
    lse_strides = dict(zip(("s_lb", "s_lh", "s_lm"), _lse_strides(lse, plan.varlen)))
    grad_strides = _io_strides("s_g", grad_out, plan.varlen)
    preprocess_args = {
        "out_ptr": out, "dout_ptr": grad_out, "delta_ptr": delta,
        "dlse_ptr": lse if grad_lse is None else grad_lse.contiguous(),
        **_io_strides("s_o", out, plan.varlen), **grad_strides, **lse_strides,
        "cu_q": plan.cu_q if plan.varlen else q, "LQ": plan.max_q_len, "H": plan.q_heads, "DV": dim_v,
    }  # fmt: skip
    block_m = 16 if interpreting() else 64
    attention_backward_delta[(triton.cdiv(plan.max_q_len, block_m), plan.batch * plan.q_heads)](
        **preprocess_args,
        BLOCK_M=block_m,
        BLOCK_DV=_block(dim_v),
        HAS_DLSE=grad_lse is not None,
        VARLEN=plan.varlen,
    )

    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    bias_grad_mode, dbias_partial = 0, q
    if bias_needs_grad:
        # One float32 partial per (b, h) along the dims where the bias is full,
        # summed over its broadcast dims afterwards (see backward.py).
        rows_full, cols_full = bias.shape[2] != 1, bias.shape[3] != 1
        if cols_full:
            bias_grad_mode = 1 if rows_full else 2
            partial_shape = (plan.batch, plan.q_heads, plan.max_q_len if rows_full else 1, plan.max_k_len)
            dbias_partial = torch.zeros(partial_shape, dtype=torch.float32, device=q.device)
        elif grad_lse is None:  # one value per query row: its gradient is dlse (backward.py)
            dbias_partial = torch.zeros(plan.batch, plan.q_heads, plan.max_q_len, 1, device=q.device)
        else:
            dbias_partial = grad_lse.float().masked_fill(lse == float("-inf"), 0.0).unsqueeze(-1)
    rule_args, flags = _rule_args(plan, bias, q)
    shared = {
        "q_ptr": q, "k_ptr": k, "v_ptr": v, "dout_ptr": grad_out, "lse_ptr": lse, "delta_ptr": delta,
        "dbias_ptr": dbias_partial,
        **_io_strides("s_q", q, plan.varlen),
        **_io_strides("s_k", k, plan.varlen, "bhnd"),
        **_io_strides("s_v", v, plan.varlen, "bhnd"),
        **grad_strides, **lse_strides,
        **dict(zip(("s_db", "s_dh", "s_dm", "s_dn"), _broadcast_strides(dbias_partial) if bias_grad_mode else (0,) * 4)),
        **rule_args, "D": dim, "DV": dim_v,
    }  # fmt: skip
    constants = {**flags, "BLOCK_D": _block(dim), "BLOCK_DV": _block(dim_v), "BIAS_GRAD": bias_grad_mode}
    dkdv_args = {
        **shared, "dk_ptr": dk, "dv_ptr": dv,
        **_io_strides("s_dk", dk, plan.varlen, "bhnd"),
        **_io_strides("s_dv", dv, plan.varlen, "bhnd"),
    }  # fmt: skip
    dkdv_constants = constants
    _launch(
        attention_backward_dkdv,
        "dkdv",
        max(dim, dim_v),
        lambda block_m, block_n: (triton.cdiv(plan.max_k_len, block_n), plan.batch * plan.kv_heads),
        dkdv_args,
        dkdv_constants,
        rows=plan.max_q_len,
    )
    dq_args = {name: value for name, value in shared.items() if not name.startswith(("s_d", "dbias"))}
    dq_args.update(dq_ptr=dq, **_io_strides("s_dq", dq, plan.varlen))
    dq_constants = {name: value for name, value in constants.items() if name != "BIAS_GRAD"}
    _launch(
        attention_backward_dq,
        "dq",
        max(dim, dim_v),
        lambda block_m, block_n: (triton.cdiv(plan.max_q_len, block_m), plan.batch * plan.q_heads),
        dq_args,
        dq_constants,
        rows=plan.max_q_len,
    )
    dbias = None
    if bias_needs_grad:
        dbias = dbias_partial.sum_to_size(bias.shape).to(bias.dtype)
    return dq, dk, dv, dbias


class TritonAttention(torch.autograd.Function):
    """out, lse = TritonAttention.apply(q, k, v, bias, plan); differentiable in q, k, v, bias."""

    @staticmethod
    def forward(ctx, q, k, v, bias, plan: Plan):
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        out, lse = forward(q, k, v, bias, plan)
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.plan = plan
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, bias, out, lse = ctx.saved_tensors
        dq, dk, dv, dbias = backward(
            grad_out, grad_lse, q, k, v, bias, out, lse, ctx.plan, ctx.needs_input_grad[3]
        )
        return dq, dk, dv, dbias, None


# ---- split-KV decoding ----


def decode_splits(batch: int, kv_heads: int, row_tiles: int, max_k_len: int, device) -> int:
    """Enough key splits that about two programs run per streaming multiprocessor,
    each split still at least 256 keys long; up to 128 splits."""
    if interpreting() or torch.device(device).type != "cuda":
        return min(4, triton.cdiv(max_k_len, 32))
    processors = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * processors, batch * kv_heads * row_tiles)
    return max(1, min(wanted, triton.cdiv(max_k_len, 256), 128))


def decode(q, k_cache, v_cache, cache_seqlens, plan: Plan, num_splits: int | None) -> tuple[Tensor, Tensor]:
    """out (B, Hq, Lq, Dv) in q's dtype and lse (B, Hq, Lq) float32."""
    batch, q_heads, q_len, _ = q.shape
    kv_heads, max_k_len, dim_v = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    tiles = _decode_tiles(q, kv_heads, dim_v)
    splits = num_splits or decode_splits(batch, kv_heads, tiles[-1], max_k_len, q.device)
    split_len = triton.cdiv(triton.cdiv(max_k_len, splits), tiles[1]) * tiles[1]
    cache_layout = (k_cache, tuple(k_cache.stride()), 0, v_cache, tuple(v_cache.stride()), 0)
    part_out, part_lse = _decode_split(q, cache_layout, cache_seqlens, None, plan, tiles, splits, split_len)
    out = q.new_empty(batch, q_heads, q_len, dim_v)
    lse = torch.empty(batch, q_heads, q_len, dtype=torch.float32, device=q.device)
    decode_combine[(batch * q_heads * q_len,)](
        part_out, part_lse, out, lse, *out.stride(), q_heads, q_len, dim_v, splits,
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_DV=_block(dim_v), PRECISION=_precision(q.dtype),
    )  # fmt: skip
    return out, lse


# The keys of one split of a paged cache: a fixed number, so that how a
# sequence's keys are cut never depends on the batch (see decode.combine_in_order).
# On a GPU 256 keys (4 key tiles at D <= 128; vLLM's paged kernel likewise fixes
# its partitions, at 512): not yet chosen by timing, no GPU was at hand
# (scripts/bench_paged_attention.py times 64 to 512). In the interpreter 64 keys
# (2 key tiles), so that small test sequences cross split and tile edges.
PAGED_SPLIT_LEN = 256
PAGED_SPLIT_LEN_INTERPRETED = 64


def paged_decode(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, block_tables: Tensor, seq_lens: Tensor, plan: Plan,
    split_len: int | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """out (B, Hq, Lq, Dv) in q's dtype and lse (B, Hq, Lq) float32, from pools
    (Hk, num_blocks, block_size, D) read through block_tables (B, max_blocks).

    split_len: keys per split (rounded up to a whole number of key tiles);
    default PAGED_SPLIT_LEN. The grid covers the table's capacity, so no
    sequence length is read on the host; splits past a sequence's end do nothing."""
    batch, q_heads, q_len, _ = q.shape
    kv_heads, block_size, dim_v = k_pool.shape[0], k_pool.shape[2], v_pool.shape[3]
    tiles = _decode_tiles(q, kv_heads, dim_v)
    block_n = tiles[1]
    split_len = split_len or (PAGED_SPLIT_LEN_INTERPRETED if interpreting() else PAGED_SPLIT_LEN)
    split_len = triton.cdiv(split_len, block_n) * block_n
    splits = triton.cdiv(block_tables.shape[1] * block_size, split_len)

    def pool_strides(pool: Tensor) -> tuple[tuple[int, int, int, int], int]:
        heads, blocks, offsets, dims = pool.stride()
        return (0, heads, offsets, dims), blocks  # (batch, head, position, dim) strides; block stride

    pool_layout = (k_pool, *pool_strides(k_pool), v_pool, *pool_strides(v_pool))
    paging = (block_tables, block_size)
    part_out, part_lse = _decode_split(q, pool_layout, seq_lens, paging, plan, tiles, splits, split_len)
    out = q.new_empty(batch, q_heads, q_len, dim_v)
    lse = torch.empty(batch, q_heads, q_len, dtype=torch.float32, device=q.device)
    combine_in_order[(batch * q_heads * q_len,)](
        part_out, part_lse, seq_lens, out, lse, *out.stride(), q_heads, q_len, dim_v, splits, split_len,
        BLOCK_DV=_block(dim_v), PRECISION=_precision(q.dtype),
    )  # fmt: skip
    return out, lse


def _decode_tiles(q: Tensor, kv_heads: int, dim_v: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, row tiles) of the split kernel:
    the G query heads x Lq queries of a KV head are the rows of its tiles."""
    q_len, dim = q.shape[2], q.shape[3]
    rows = (q.shape[1] // kv_heads) * q_len
    _, block_n, warps, stages = _tiles("decode", max(dim, dim_v))
    block_m = max(16, min(64 if not interpreting() else 16, triton.next_power_of_2(rows)))
    return block_m, block_n, warps, stages, triton.cdiv(rows, block_m)


def _decode_split(q, layout, seqlens, paging, plan: Plan, tiles, splits: int, split_len: int):
    """Launch decode_split; returns part_out (B, Hq, Lq, S, Dv) and part_lse (B, Hq, Lq, S), float32.

    layout: (k, k strides (batch, head, position, dim), k block stride, the same for v);
    paging: (block_tables, block_size), or None for a dense cache."""
    batch, q_heads, q_len, dim = q.shape
    k, k_strides, k_block_stride, v, v_strides, v_block_stride = layout
    dim_v = v.shape[3]
    kv_heads = k.shape[0] if paging is not None else k.shape[1]
    block_m, block_n, warps, stages, row_tiles = tiles
    table, block_size = paging if paging is not None else (q, 1)
    table_strides = tuple(table.stride()) if paging is not None else (0, 0)
    part_out = torch.empty(batch, q_heads, q_len, splits, dim_v, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, q_heads, q_len, splits, dtype=torch.float32, device=q.device)
    slopes = plan.alibi_slopes
    decode_split[(splits, batch * kv_heads, row_tiles)](
        q, k, v, seqlens, part_out, part_lse,
        *q.stride(), *k_strides, *v_strides,
        q if slopes is None else slopes, *((0, 0) if slopes is None else _broadcast_strides(slopes)[:2]),
        table, *table_strides, k_block_stride, v_block_stride,
        q_len, q_heads, q_heads // kv_heads, dim, dim_v, splits, split_len,
        plan.scale, plan.softcap or 1.0, plan.window_left or 0, plan.right_limit or 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block(dim), BLOCK_DV=_block(dim_v),
        HAS_SOFTCAP=plan.softcap is not None, HAS_ALIBI=slopes is not None,
        HAS_LEFT=plan.window_left is not None, HAS_RIGHT=plan.right_limit is not None,
        PRECISION=_precision(q.dtype), PAGED=paging is not None, PAGE_SIZE=block_size,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return part_out, part_lse
