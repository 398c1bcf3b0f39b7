"""Memory traffic of attention: reads and writes of the slow memory (HBM on a
GPU), eager against FlashAttention, for an on-chip memory of M bytes.

Standard attention (the FlashAttention paper's Algorithm 0) reads Q and K,
writes S, reads S and writes P (the softmax), reads P and V and writes O:
per head, 2·n·d + 2·m·d + 4·n·m elements, Θ(n·d + n²).

FlashAttention-2's loop order, which flashformer's flash backend follows,
keeps a block of b queries and its output accumulator on chip and streams
every visible key and value block past it: Q is read once, O and the LSE
written once, and K and V read once per query block. With the query,
accumulator, key and value blocks in fast memory, 4·b·d elements ≤ M, so
b = M / (4·d·e) and the K/V stream costs 2·m·d·⌈n / b⌉ ≈ 8·n·m·d²·e / M
elements: Θ(n²·d²/M). A causal call streams only the keys up to each
block's last query.
"""

from __future__ import annotations

from flashformer.costs.flops import Shapes, attention_calls

LSE_BYTES = 4


def flash_query_block(head_dim: int, sram_bytes: int, element: int) -> int:
    """The b of the docstring: query rows whose Q, O, K and V blocks fit in M."""
    return max(1, sram_bytes // (4 * head_dim * element))


def eager_traffic(q_len: int, k_len: int, head_dim: int, element: int) -> int:
    """Bytes one head of standard attention moves through slow memory."""
    return (2 * q_len * head_dim + 2 * k_len * head_dim + 4 * q_len * k_len) * element


def flash_traffic(q_len: int, k_len: int, head_dim: int, causal: bool, sram_bytes: int, element: int) -> int:
    """Bytes one head of FlashAttention-2 (forward) moves through slow memory."""
    block = flash_query_block(head_dim, sram_bytes, element)
    offset = k_len - q_len
    streamed = 0  # keys (and as many values) read, over all query blocks
    for q0 in range(0, q_len, block):
        q1 = min(q_len, q0 + block)
        streamed += min(k_len, q1 + offset) if causal else k_len
    return (2 * q_len * head_dim + 2 * streamed * head_dim) * element + q_len * LSE_BYTES


def model_attention_traffic(config, p, sram_bytes: int, element: int) -> dict[str, int]:
    """Bytes the attention calls of one forward pass move, per backend."""
    s = Shapes.of(config)
    totals = {"eager": 0, "flash": 0}
    for _, layers, q_len, k_len, causal in attention_calls(config, p):
        heads = layers * p.batch * s.heads
        totals["eager"] += heads * eager_traffic(q_len, k_len, s.head_dim, element)
        totals["flash"] += heads * flash_traffic(q_len, k_len, s.head_dim, causal, sram_bytes, element)
    return totals
