"""Attention: one function, several backends (see api.py); and attention over
a paged KV cache (see paged.py)."""

from flashformer.attention.api import BACKENDS, attention
from flashformer.attention.paged import (
    PAGED_BACKENDS,
    kv_slots,
    packed_paged_attention,
    paged_attention,
    write_kv,
)

__all__ = [
    "BACKENDS",
    "PAGED_BACKENDS",
    "attention",
    "kv_slots",
    "packed_paged_attention",
    "paged_attention",
    "write_kv",
]
