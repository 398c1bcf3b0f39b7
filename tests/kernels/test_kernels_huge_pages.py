"""kernels.huge_pages: a model loaded after `import flashformer` lies on huge pages.

PyTorch's CPU allocator reads THP_MEM_ALLOC_ENABLE once, at its first allocation, so a single
tensor made while flashformer is imported (a module-level lookup table did, from 2 December
2026) switches huge pages off for the whole process and every decode step streams its weights
through 4 KB pages: Q4_K at M = 1 read 4.9 GB/s a thread against 6.9 with huge pages."""

import subprocess
import sys
from pathlib import Path

import pytest

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# In a fresh process, as a user's script: import, then allocate what a load would (64 MB).
PROBE = """
import os
os.environ.pop("THP_MEM_ALLOC_ENABLE", None)
import flashformer
from flashformer.kernels.huge_pages import use_huge_pages
import torch
use_huge_pages()
weights = torch.ones(2**24)
huge = [line.split()[1] for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages:")]
print(int(huge[0]))
"""


def thp_mode() -> str | None:
    if not THP.exists() or not Path("/proc/self/smaps_rollup").exists():
        return None
    text = THP.read_text()
    return text[text.index("[") + 1 : text.index("]")]


@pytest.mark.skipif(
    thp_mode() in (None, "never"), reason="this kernel gives no transparent huge pages (or has no smaps)"
)
def test_import_allocates_nothing_so_huge_pages_stay_possible():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=True
    )
    huge_kb = int(out.stdout.strip().splitlines()[-1])
    assert huge_kb >= 32 * 1024, f"a 64 MB tensor got {huge_kb} kB of huge pages after import flashformer"
