"""Large tensors on transparent huge pages, for the processes that load a model to run it.

A decode step streams every weight and the whole KV cache; with 4 KB pages that is tens of
thousands of TLB misses a step. PyTorch's CPU allocator madvises its allocations of 2 MB and more
for huge pages when THP_MEM_ALLOC_ENABLE=1, and reads that variable once, at its first
allocation: so this is switched on where a model is loaded (flashformer.load, from_pretrained)
and at the start of the `flashformer` command, before the weights are allocated. A process that
allocated tensors before loading keeps the allocator's first answer (set the variable yourself
then). THP_MEM_ALLOC_ENABLE=0 opts out. Why it is on: docs/benchmarks.md (huge pages).
"""

from __future__ import annotations

import os


def use_huge_pages() -> None:
    """Ask PyTorch's CPU allocator for huge pages, unless THP_MEM_ALLOC_ENABLE is already set."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
