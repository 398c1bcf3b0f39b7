"""Triton kernels: FlashAttention-2 forward and backward, varlen, split-KV decoding.

`flashformer.attention(..., backend="triton")` runs here, and so do the two
inference entry points of this module, `varlen_attention` (packed batches of
sequences of different lengths, as flash-attn's `flash_attn_varlen_func`) and
`decode_attention` (a few new queries per sequence against a KV cache), and
`paged_attention(..., backend="triton")` (attention/paged.py) through
`triton_paged_attention`.

The room: entry_points.py (the functions above, their checks and refusals), launch.py (grids,
block sizes, the autograd function), forward.py, backward.py and decode.py (the kernels) and
scores.py (the score rules inside a kernel).

Triton is an optional dependency (`pip install flashformer[triton]`) and is
imported only when one of these kernels runs, so `import flashformer` works
without it. The kernels run on CUDA tensors; with TRITON_INTERPRET=1 set
before Triton is imported, Triton's interpreter runs them on CPU tensors
(slowly: that is how the tests check them on machines without a GPU).

What the kernels refuse (NotImplementedError naming it): a bias given as a
function of positions (the kernel cannot call Python per tile; pass the bias
as a tensor, or use backend="flash"), float64 inputs, head dims above 256,
and CPU tensors outside the interpreter.

Costs worth knowing: the backward is deterministic (dK/dV and dQ in separate
kernels, no atomics), at the price of recomputing the score tiles twice. A
bias tensor's gradient is summed over the dims it broadcasts on through one
float32 partial per (batch, query head): free for a full (B, Hq, Lq, Lk)
bias, (B, Hq, Lq, Lk) float32 of scratch for one shared by batch or heads,
(B, Hq, 1, Lk) for one shared by all queries; a bias constant along the keys
gets its exact gradient (dlse) without a kernel.
"""

from flashformer.attention.triton.entry_points import (
    MAX_HEAD_DIM,
    decode_attention,
    is_available,
    triton_attention,
    triton_paged_attention,
    unsupported,
    varlen_attention,
)

__all__ = [
    "MAX_HEAD_DIM",
    "decode_attention",
    "is_available",
    "triton_attention",
    "triton_paged_attention",
    "unsupported",
    "varlen_attention",
]
