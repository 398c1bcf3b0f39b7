"""FlashAttention-2 in PyTorch operations, for every device.

The score matrix is never materialized. Queries are cut into blocks of
`block_q`, keys into blocks of `block_k`; for each query block the forward pass
walks the key blocks with an online softmax (a running row max m and row sum l;
when m grows, the accumulator and l are rescaled by exp(m_old - m_new)) and
writes the output and the log-sum-exp (LSE) once. The backward pass keeps only
the output and the LSE, and recomputes each probability tile as
exp(s - lse) to form dV, dS = P * (dP - rowsum(dO * O)), dQ and dK.

All (batch, head) pairs go through one tile at a time, as one batched matmul,
so at most one block_q x block_k score tile per (batch, head group) is alive.
Grouped-query attention folds the G query heads that share a key/value head
into the rows of the tile, so K and V are never repeated in memory. Key tiles
that the causal or window band wholly excludes are never visited (see
ScoreRules.key_range / query_range), and tiles the band wholly includes skip
the masking work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flashformer.attention.masks import ScoreRules, dropout_head_keys, dropout_keep

# Tile sizes: 256 x 256 was the fastest of 64..1024 on the CPU (fp32, B=1, H=8,
# D=64, causal, n = 4096, forward + backward, timed with flashformer/bench/attention.py).
# A 256 x 256 fp32 tile over 8 heads is 2 MiB, which stays in cache between the
# matmul and the elementwise softmax work.
BLOCK_Q = 256
BLOCK_K = 256


@dataclass(frozen=True)
class FlashSettings:
    rules: ScoreRules
    scale: float
    dropout_p: float
    dropout_seed: int | None
    block_q: int
    block_k: int


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rules: ScoreRules,
    scale: float,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Returns (out (B, Hq, Lq, Dv) in q's dtype, lse (B, Hq, Lq) float32).

    Tile sizes default to the module's BLOCK_Q x BLOCK_K. When there are few
    queries (decoding), the key block grows so that a tile keeps about
    block_q x block_k entries: a one-query decode step then takes a few wide
    tiles rather than many thin ones.
    """
    block_q = block_q or BLOCK_Q
    block_k = block_k or BLOCK_K
    q_len = q.shape[2]
    if q_len < block_q:
        block_k = max(block_k, (block_q * block_k) // q_len)
        block_q = q_len
    settings = FlashSettings(rules, scale, dropout_p, dropout_seed, block_q, block_k)
    bias_leaves = _trainable_leaves(rules, q.device) if torch.is_grad_enabled() else ()
    return _FlashAttention.apply(q, k, v, rules.bias, rules.sinks, settings, *bias_leaves)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, settings: FlashSettings, *bias_leaves):
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None
        out, lse = _forward(q, k, v, settings)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = settings
        ctx.bias_leaves = bias_leaves
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        settings = ctx.settings
        bias_needs_grad = ctx.needs_input_grad[3]
        dq, dk, dv, dbias, delta, leaf_grads = _backward(
            grad_out, grad_lse, q, k, v, out, lse, settings, bias_needs_grad, ctx.bias_leaves
        )
        dsinks = None
        if ctx.needs_input_grad[4]:  # d/dsink = -P_sink * delta, P_sink = exp(sink - lse), per row
            sinks = settings.rules.sinks  # (1, Hq, 1, 1)
            p_sink = torch.exp(sinks[:, :, 0].to(lse.dtype) - lse)  # (B, Hq, Lq)
            dsinks = -(p_sink * delta).sum(dim=(0, 2)).view(sinks.shape).to(sinks.dtype)
        return dq, dk, dv, dbias, dsinks, None, *leaf_grads


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _group_rows(t: Tensor, kv_heads: int, q0: int, q1: int) -> Tensor:
    """(B, Hq, Lq, X) -> (B*Hk, G*(q1-q0), X): the G query heads that share a
    key/value head stacked as the rows of one tile, so one matmul serves them."""
    batch, q_heads, _, width = t.shape
    return t[:, :, q0:q1].reshape(batch * kv_heads, (q_heads // kv_heads) * (q1 - q0), width)


def _flat_heads(t: Tensor, dtype: torch.dtype) -> Tensor:
    """(B, Hk, L, X) -> contiguous (B*Hk, L, X) in the compute dtype."""
    batch, heads, length, width = t.shape
    return t.to(dtype).reshape(batch * heads, length, width).contiguous()


def _forward(q: Tensor, k: Tensor, v: Tensor, s: FlashSettings) -> tuple[Tensor, Tensor]:
    rules = s.rules
    batch, q_heads, q_len, _ = q.shape
    kv_heads, dim_v = k.shape[1], v.shape[3]
    dtype = _compute_dtype(q.dtype)
    k, v = _flat_heads(k, dtype), _flat_heads(v, dtype)  # (B*Hk, Lk, D), (B*Hk, Lk, Dv)
    head_keys = dropout_head_keys(s.dropout_seed, batch, q_heads, q.device) if s.dropout_p else None

    out = torch.zeros(batch, q_heads, q_len, dim_v, dtype=dtype, device=q.device)
    lse = torch.full((batch, q_heads, q_len), float("-inf"), dtype=dtype, device=q.device)
    for q0 in range(0, q_len, s.block_q):
        q1 = min(q_len, q0 + s.block_q)
        rows = q1 - q0
        q_tile = _group_rows(q, kv_heads, q0, q1).to(dtype) * s.scale  # (B*Hk, G*bq, D), scaled
        row_max = torch.full((batch, q_heads, rows, 1), float("-inf"), dtype=dtype, device=q.device)
        row_sum = torch.zeros(batch, q_heads, rows, 1, dtype=dtype, device=q.device)
        if rules.sinks is not None:  # the softmax starts from the sink: max = sink, sum = exp(0)
            row_max = row_max.copy_(rules.sinks.detach().to(dtype).expand_as(row_max))
            row_sum = row_sum.fill_(1.0)
        acc = torch.zeros(q_tile.shape[0], q_tile.shape[1], dim_v, dtype=dtype, device=q.device)
        for k0, k1 in _tiles(rules.key_spans(q0, q1), s.block_k):
            scores = torch.bmm(q_tile, k[:, k0:k1].transpose(1, 2))  # (B*Hk, G*bq, bk)
            scores4 = rules.apply(scores.view(batch, q_heads, rows, k1 - k0), q0, k0, inplace=True)
            new_max = torch.maximum(row_max, scores4.amax(dim=-1, keepdim=True))
            # A row with no allowed key so far keeps max -inf; subtracting 0
            # instead keeps exp(-inf) = 0 rather than exp(-inf + inf) = NaN.
            safe_max = new_max.masked_fill(new_max == float("-inf"), 0.0)
            correction = torch.exp(row_max - safe_max)  # (B, Hq, bq, 1)
            probs = scores4.sub_(safe_max).exp_()  # (B, Hq, bq, bk), unnormalized; aliases scores
            row_sum = row_sum.mul_(correction).add_(probs.sum(dim=-1, keepdim=True))
            if head_keys is not None:
                probs.mul_(dropout_keep(head_keys, q0, q1, k0, k1, s.dropout_p))
            acc.mul_(correction.view(acc.shape[0], -1, 1)).baddbmm_(scores, v[:, k0:k1])
            row_max = new_max
        normalizer = row_sum.masked_fill(row_sum == 0, 1.0)
        if head_keys is not None:
            normalizer = normalizer * (1.0 - s.dropout_p)
        out[:, :, q0:q1] = acc.view(batch, q_heads, rows, dim_v) / normalizer
        lse[:, :, q0:q1] = (row_max + torch.log(row_sum)).squeeze(-1)
    return out.to(q.dtype), lse


def _backward(grad_out, grad_lse, q, k, v, out, lse, s: FlashSettings, bias_needs_grad, bias_leaves):
    rules = s.rules
    batch, q_heads, q_len, dim = q.shape
    kv_heads, k_len, dim_v = k.shape[1], k.shape[2], v.shape[3]
    group = q_heads // kv_heads
    dtype = _compute_dtype(q.dtype)
    k, v = _flat_heads(k, dtype), _flat_heads(v, dtype)  # (B*Hk, Lk, D), (B*Hk, Lk, Dv)
    if grad_out is None:  # only the LSE was used
        grad_out = torch.zeros_like(out)
    grad_out = grad_out.to(dtype)  # (B, Hq, Lq, Dv)
    # dS = P * (dP - delta); delta = rowsum(dO * O), less the LSE's own gradient.
    # Summed block by block so that no (B, Hq, Lq, Dv) product is ever allocated.
    delta = torch.empty(batch, q_heads, q_len, dtype=dtype, device=q.device)  # (B, Hq, Lq)
    for q0 in range(0, q_len, s.block_q):
        rows = slice(q0, q0 + s.block_q)
        delta[:, :, rows] = (grad_out[:, :, rows] * out[:, :, rows].to(dtype)).sum(dim=-1)
    if grad_lse is not None:
        delta = delta - grad_lse.to(dtype)
    # exp(s - (+inf)) = 0 makes a fully masked row's probabilities (and so its
    # gradients) exactly zero instead of NaN.
    lse = lse.masked_fill(lse == float("-inf"), float("inf")).unsqueeze(-1)  # (B, Hq, Lq, 1)
    head_keys = dropout_head_keys(s.dropout_seed, batch, q_heads, q.device) if s.dropout_p else None
    keep_scale = 1.0 / (1.0 - s.dropout_p)

    dq = torch.zeros(batch * kv_heads, group, q_len, dim, dtype=dtype, device=q.device)
    dk = torch.empty_like(k)  # (B*Hk, Lk, D)
    dv = torch.empty_like(v)  # (B*Hk, Lk, Dv)
    dbias = torch.zeros(rules.bias.shape, dtype=dtype, device=q.device) if bias_needs_grad else None
    leaf_grads = [None] * len(bias_leaves)

    for k0 in range(0, k_len, s.block_k):
        k1 = min(k_len, k0 + s.block_k)
        # The scale goes on the key tile: s = q (scale k)^T, dQ = dS (scale k),
        # dK = scale dS^T q; so no scaled copy of all of q is ever made.
        k_tile = k[:, k0:k1] * s.scale  # (B*Hk, bk, D)
        v_tile = v[:, k0:k1]  # (B*Hk, bk, Dv)
        dk_tile = torch.zeros_like(k_tile)
        dv_tile = torch.zeros_like(v_tile)
        for q0, q1 in _tiles(rules.query_spans(k0, k1), s.block_q):
            rows = q1 - q0
            q_tile = _group_rows(q, kv_heads, q0, q1).to(dtype)  # (B*Hk, G*bq, D)
            do_tile = _group_rows(grad_out, kv_heads, q0, q1)  # (B*Hk, G*bq, Dv)

            scores = torch.bmm(q_tile, k_tile.transpose(1, 2))  # (B*Hk, G*bq, bk)
            scores4 = scores.view(batch, q_heads, rows, k1 - k0)
            scores4 = rules.apply_softcap(scores4, inplace=True)
            if rules.softcap is not None:
                softcap_grad = 1.0 - (scores4 / rules.softcap).square()  # d softcap(x) / dx
            scores4 = rules.apply_bias_and_mask(scores4, q0, k0, inplace=True)
            probs = scores4.sub_(lse[:, :, q0:q1]).exp_()  # (B, Hq, bq, bk); aliases scores

            dprobs = torch.bmm(do_tile, v_tile.transpose(1, 2))  # (B*Hk, G*bq, bk)
            dprobs4 = dprobs.view(batch, q_heads, rows, k1 - k0)
            if head_keys is not None:
                keep = dropout_keep(head_keys, q0, q1, k0, k1, s.dropout_p).to(dtype) * keep_scale
                dv_tile.baddbmm_((probs * keep).view_as(scores).transpose(1, 2), do_tile)
                dprobs4.mul_(keep)
            else:
                dv_tile.baddbmm_(scores.transpose(1, 2), do_tile)
            dscores4 = dprobs4.sub_(delta[:, :, q0:q1, None]).mul_(probs)  # (B, Hq, bq, bk)
            if dbias is not None:
                _accumulate_bias_grad(dbias, dscores4, q0, q1, k0, k1)
            if bias_leaves:
                _accumulate_leaf_grads(leaf_grads, bias_leaves, rules, dscores4, q0, q1, k0, k1)
            if rules.softcap is not None:  # the bias is added after the cap, q k^T before it
                dscores4.mul_(softcap_grad)

            dq[:, :, q0:q1] += torch.bmm(dprobs, k_tile).view(-1, group, rows, dim)
            dk_tile.baddbmm_(dprobs.transpose(1, 2), q_tile)
        dk[:, k0:k1] = dk_tile.mul_(s.scale)
        dv[:, k0:k1] = dv_tile

    dq = dq.view(batch, q_heads, q_len, dim)
    return (
        dq.to(q.dtype),
        dk.view(batch, kv_heads, k_len, dim).to(q.dtype),
        dv.view(batch, kv_heads, k_len, dim_v).to(v.dtype),
        None if dbias is None else dbias.to(rules.bias.dtype),
        delta,
        leaf_grads,
    )


def _accumulate_bias_grad(dbias: Tensor, dscores: Tensor, q0: int, q1: int, k0: int, k1: int) -> None:
    """dBias = dS summed over the dims the bias broadcasts on; never expanded."""
    rows = slice(None) if dbias.shape[2] == 1 else slice(q0, q1)
    cols = slice(None) if dbias.shape[3] == 1 else slice(k0, k1)
    target = dbias[:, :, rows, cols]
    target += dscores.sum_to_size(target.shape)


def _accumulate_leaf_grads(leaf_grads, leaves, rules: ScoreRules, dscores, q0, q1, k0, k1) -> None:
    """Backpropagate one tile's dS through the bias function to its tensors."""
    q_pos = torch.arange(q0, q1, device=dscores.device)
    k_pos = torch.arange(k0, k1, device=dscores.device)
    with torch.enable_grad():
        tile_bias = rules.bias_fn(q_pos, k_pos)
        grad = dscores.sum_to_size(tile_bias.shape).to(tile_bias.dtype)
        grads = torch.autograd.grad(tile_bias, leaves, grad, allow_unused=True)
    for index, g in enumerate(grads):
        if g is not None:
            leaf_grads[index] = g if leaf_grads[index] is None else leaf_grads[index] + g


def _trainable_leaves(rules: ScoreRules, device: torch.device) -> tuple[Tensor, ...]:
    """The tensors requiring grad that a bias function reads (T5's bias table).

    A bias function may close over trainable tensors. They become explicit
    inputs of the autograd Function so that autograd routes their gradients;
    the backward pass gets them by differentiating the function tile by tile.
    They are found by walking the graph of a 1 x 1 probe tile.
    """
    if rules.bias_fn is None:
        return ()
    probe_pos = torch.zeros(1, dtype=torch.int64, device=device)
    probe = rules.bias_fn(probe_pos, probe_pos)
    if not probe.requires_grad:
        return ()
    if probe.grad_fn is None:
        return (probe,)
    leaves, seen, stack = [], set(), [probe.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if variable is not None:
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return tuple(leaves)


def _tiles(spans: list[tuple[int, int]], block: int):
    """(start, end) of the tiles of at most `block` positions covering each span."""
    for lo, hi in spans:
        for start in range(lo, hi, block):
            yield start, min(hi, start + block)
