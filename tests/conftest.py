"""Test setup shared by every test module.

Without a GPU, the Triton kernels run in Triton's CPU interpreter. It is
switched on here, before any test module imports Triton (its @triton.jit
decorator reads TRITON_INTERPRET when the kernel modules are imported), so
that `python -m pytest` runs them with no extra command.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
