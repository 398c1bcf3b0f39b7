"""Which keys each query may see, and what is added to its scores.

Every backend reads the same `ScoreRules`: the eager backend asks for one tile
that covers the whole (Lq, Lk) score matrix, the tiled backends ask tile by
tile. That is how the mask semantics live in one place.

Order of operations on a tile of scaled scores s = scale * q @ k^T:

    s = softcap * tanh(s / softcap)          (if softcap)
    s = s + bias + alibi                     (if given)
    s = -inf where the key is not allowed    (causal, window, padding, bool mask)

Attention sinks (gpt-oss) are not a tile's business: a sink is one more logit per query head
in every row's softmax denominator, with no value, so p_j = exp(s_j) / (exp(sink) + sum_k
exp(s_k)); the backends start each row's running max and sum from it (the online softmax's
initial state) and the log-sum-exp they return includes it.

Positions are aligned bottom-right: query i sits at key position
i + (Lk - Lq), which is what a KV cache needs (Lq new tokens after Lk - Lq
cached ones). Causal means key j <= i + (Lk - Lq); a window (left, right)
keeps keys in [i + off - left, i + off + right]. Global tokens (Longformer, BigBird) widen
the window: the first `global_tokens` key positions are visible to every query, and the
queries at those positions see every key (causality still holds: never a later key).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

BiasFunction = Callable[[Tensor, Tensor], Tensor]

_UINT32 = 0xFFFFFFFF


@dataclass(frozen=True)
class ScoreRules:
    """The mask, bias and score transform of one attention call.

    Tensors are stored already normalized to 4-D (size 1 on broadcast dims),
    so a tile is a plain slice and broadcast dims are never expanded.
    """

    batch: int
    q_heads: int
    q_len: int
    k_len: int
    causal: bool = False
    window_left: int | None = None  # None = unbounded
    window_right: int | None = None  # None = unbounded (0 when causal)
    key_padding_mask: Tensor | None = None  # (B, 1, 1, Lk) bool, True = real token
    mask: Tensor | None = None  # (B|1, H|1, Lq|1, Lk|1) bool, True = may attend
    bias: Tensor | None = None  # (B|1, H|1, Lq|1, Lk|1) float
    bias_fn: BiasFunction | None = None  # bias(q_pos, k_pos) -> one tile's bias
    alibi_slopes: Tensor | None = None  # (B|1, H, 1, 1) float32
    softcap: float | None = None
    global_tokens: int = 0  # key / query positions 0 .. global_tokens - 1 are global
    sinks: Tensor | None = None  # (1, H, 1, 1): a logit per query head in every softmax's denominator

    # ---- the band (causal and window): pure index arithmetic, no tensors ----

    @property
    def offset(self) -> int:
        """Key position of query 0 on the aligned diagonal."""
        return self.k_len - self.q_len

    @property
    def right_limit(self) -> int | None:
        """Keys allowed to the right of the diagonal (None = unbounded)."""
        if self.causal:
            return 0 if self.window_right is None else min(0, self.window_right)
        return self.window_right

    @property
    def has_band(self) -> bool:
        return self.right_limit is not None or self.window_left is not None

    def key_range(self, q0: int, q1: int) -> tuple[int, int]:
        """Half-open range of keys that any query in [q0, q1) may see.

        Key tiles outside it are skipped by the tiled backends. The range can
        be empty (k_lo >= k_hi) when every query in the block is fully masked.
        """
        k_lo, k_hi = 0, self.k_len
        if self.window_left is not None:
            k_lo = max(0, q0 + self.offset - self.window_left)
        if self.right_limit is not None:
            k_hi = min(self.k_len, q1 - 1 + self.offset + self.right_limit + 1)
        return k_lo, k_hi

    def query_range(self, k0: int, k1: int) -> tuple[int, int]:
        """Half-open range of queries that may see any key in [k0, k1)."""
        q_lo, q_hi = 0, self.q_len
        if self.right_limit is not None:
            q_lo = max(0, k0 - self.offset - self.right_limit)
        if self.window_left is not None:
            q_hi = min(self.q_len, k1 - 1 - self.offset + self.window_left + 1)
        return q_lo, q_hi

    def band_covers(self, q0: int, q1: int, k0: int, k1: int) -> bool:
        """True if the band allows every (query, key) pair of the tile."""
        if self.window_left is not None and q1 - 1 + self.offset - self.window_left > k0:
            return False
        if self.right_limit is not None and q0 + self.offset + self.right_limit < k1 - 1:
            return False
        return True

    # ---- the spans the tiled backends visit: the band, and the global rows and columns ----

    def key_spans(self, q0: int, q1: int) -> list[tuple[int, int]]:
        """Half-open key ranges that queries [q0, q1) may see: key_range's band, and with global
        tokens the global keys [0, global_tokens) (or, for a block holding a global query,
        every key up to the causal limit). Key tiles outside the spans are skipped."""
        return _merge([self.key_range(q0, q1), *self._global_key_spans(q0, q1)])

    def query_spans(self, k0: int, k1: int) -> list[tuple[int, int]]:
        """Half-open query ranges that may see any key in [k0, k1) (the backward's dK, dV)."""
        return _merge([self.query_range(k0, k1), *self._global_query_spans(k0, k1)])

    def _global_key_spans(self, q0: int, q1: int) -> list[tuple[int, int]]:
        g = self.global_tokens
        if g == 0:
            return []
        causal_end = min(self.k_len, q1 + self.offset) if self.causal else self.k_len
        if q0 + self.offset < g:  # a global query: every key it may causally see
            return [(0, causal_end)]
        return [(0, min(g, causal_end))]

    def _global_query_spans(self, k0: int, k1: int) -> list[tuple[int, int]]:
        g = self.global_tokens
        if g == 0:
            return []
        first = max(0, k0 - self.offset) if self.causal else 0  # the first query that may see key k0
        spans = [(first, min(self.q_len, g - self.offset))]  # the global queries see every key
        if k0 < g:  # a global key is seen by every later query
            spans.append((first, self.q_len))
        return spans

    # ---- tensors for one tile ----

    def tile_keep(self, q0: int, q1: int, k0: int, k1: int, device) -> Tensor | None:
        """Bool tensor broadcastable to (B, H, q1-q0, k1-k0), True = may attend.

        None when every pair of the tile is allowed (no masking work at all).
        """
        keep = None
        if self.has_band and not self.band_covers(q0, q1, k0, k1):
            i = torch.arange(q0 + self.offset, q1 + self.offset, device=device)[:, None]
            j = torch.arange(k0, k1, device=device)[None, :]
            keep = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=device)
            if self.right_limit is not None:
                keep &= j <= i + self.right_limit
            if self.window_left is not None:
                keep &= j >= i - self.window_left
            if self.global_tokens:
                reach = (j < self.global_tokens) | (i < self.global_tokens)
                keep |= reach & (j <= i) if self.causal else reach
        if self.key_padding_mask is not None:
            keep = _and(keep, self.key_padding_mask[..., k0:k1])
        if self.mask is not None:
            keep = _and(keep, _slice(self.mask, q0, q1, k0, k1))
        return keep

    def tile_bias(self, q0: int, q1: int, k0: int, k1: int, device, dtype) -> Tensor | None:
        """Tensor of `dtype` broadcastable to (B, H, q1-q0, k1-k0), or None."""
        bias = None
        if self.bias is not None:
            bias = _slice(self.bias, q0, q1, k0, k1).to(dtype)
        if self.bias_fn is not None:
            q_pos = torch.arange(q0, q1, device=device)
            k_pos = torch.arange(k0, k1, device=device)
            fn_bias = self.bias_fn(q_pos, k_pos).to(dtype)
            bias = fn_bias if bias is None else bias + fn_bias
        if self.alibi_slopes is not None:
            i = torch.arange(q0 + self.offset, q1 + self.offset, device=device)[:, None]
            j = torch.arange(k0, k1, device=device)[None, :]
            distance = (i - j).abs().to(dtype)  # (bq, bk)
            alibi = -self.alibi_slopes.to(dtype) * distance  # (B|1, H, bq, bk)
            bias = alibi if bias is None else bias + alibi
        return bias

    def apply(self, scores: Tensor, q0: int, k0: int, inplace: bool = False) -> Tensor:
        """Softcap, bias and mask on a float tile of scaled scores (B, H, bq, bk).

        Returns the transformed tile; entries that may not be attended are -inf.
        The tile always has the full (B, H) shape, so every bias and mask
        broadcasts into it; `inplace=True` (for backends outside autograd)
        overwrites it instead of allocating new tiles.
        """
        scores = self.apply_softcap(scores, inplace)
        return self.apply_bias_and_mask(scores, q0, k0, inplace)

    def apply_softcap(self, scores: Tensor, inplace: bool = False) -> Tensor:
        if self.softcap is None:
            return scores
        if inplace:
            return scores.div_(self.softcap).tanh_().mul_(self.softcap)
        return torch.tanh(scores / self.softcap) * self.softcap

    def apply_bias_and_mask(self, scores: Tensor, q0: int, k0: int, inplace: bool = False) -> Tensor:
        q1, k1 = q0 + scores.shape[-2], k0 + scores.shape[-1]
        bias = self.tile_bias(q0, q1, k0, k1, scores.device, scores.dtype)
        if bias is not None:
            scores = scores.add_(bias) if inplace else scores + bias
        keep = self.tile_keep(q0, q1, k0, k1, scores.device)
        if keep is not None:
            if inplace:
                scores = scores.masked_fill_(~keep, float("-inf"))
            else:
                scores = scores.masked_fill(~keep, float("-inf"))
        return scores


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Non-empty half-open ranges, sorted, overlapping or touching ones joined."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(span for span in spans if span[0] < span[1]):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _and(a: Tensor | None, b: Tensor) -> Tensor:
    return b if a is None else a & b


def _slice(t: Tensor, q0: int, q1: int, k0: int, k1: int) -> Tensor:
    """Slice a 4-D tensor whose last two dims may be broadcast (size 1)."""
    rows = slice(None) if t.shape[-2] == 1 else slice(q0, q1)
    cols = slice(None) if t.shape[-1] == 1 else slice(k0, k1)
    return t[..., rows, cols]


# ---- dropout: a pure function of (seed, b, h, i, j) ----
#
# Every backend must drop the same entries for the same seed, so the keep mask
# is a counter-based hash rather than a random-number stream. The hash is
# Chris Wellons' "lowbias32" integer mixer on 32-bit words. PyTorch has no
# unsigned 32-bit shifts on the CPU, so the words live in int32 tensors:
# multiplication wraps modulo 2**32 exactly as on uint32, right shifts are
# made logical by masking off the copied sign bits, and the final unsigned
# comparison flips the sign bit on both sides. The Triton kernels do the same
# arithmetic on native uint32 and get identical bits (tests check both against
# a pure-Python reference).

_INT32_MIN = -(2**31)


def _signed32(value: int) -> int:
    """The int32 that holds the uint32 bit pattern of `value`."""
    value &= _UINT32
    return value - 2**32 if value >= 2**31 else value


def mix32(x: Tensor) -> Tensor:
    """A bijective avalanche hash of 32-bit words held in an int32 tensor."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _signed32(0x7FEB352D)
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _signed32(0x846CA68B)
    return x ^ ((x >> 16) & 0xFFFF)


def mix32_reference(x: int) -> int:
    """The same hash on one Python integer (the tests' independent reference)."""
    x &= _UINT32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _UINT32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _UINT32
    return x ^ (x >> 16)


def dropout_head_keys(seed: int, batch: int, heads: int, device) -> Tensor:
    """One 32-bit key per (b, h): (B, H, 1, 1) int32."""
    seed_lo, seed_hi = seed & _UINT32, (seed >> 32) & _UINT32
    bh = torch.arange(batch * heads, device=device, dtype=torch.int32)
    keys = mix32(mix32(bh ^ _signed32(seed_lo)) ^ _signed32(mix32_reference(seed_hi)))
    return keys.view(batch, heads, 1, 1)


def dropout_threshold(p: float) -> int:
    """An entry is dropped iff its hash, read as uint32, is below this."""
    return min(_UINT32, round(p * 2**32))


def dropout_keep(head_keys: Tensor, q0: int, q1: int, k0: int, k1: int, p: float) -> Tensor:
    """Keep mask of one tile, (B, H, q1-q0, k1-k0) bool, from absolute positions."""
    device = head_keys.device
    i = torch.arange(q0, q1, device=device, dtype=torch.int32)[:, None]
    j = torch.arange(k0, k1, device=device, dtype=torch.int32)[None, :]
    row_keys = mix32(head_keys ^ i)  # (B, H, bq, 1)
    hashed = mix32(row_keys ^ mix32(j))  # (B, H, bq, bk)
    # unsigned hashed >= threshold, as a signed comparison with both sign bits flipped
    return (hashed ^ _INT32_MIN) >= _signed32(dropout_threshold(p) ^ 2**31)
