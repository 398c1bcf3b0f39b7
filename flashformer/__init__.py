"""flashformer: the Transformer, exact, IO-aware and measured."""

import os

# Large tensors on transparent huge pages: PyTorch's CPU allocator aligns allocations of 2 MB and
# more to 2 MB and madvises them when THP_MEM_ALLOC_ENABLE=1 (it reads the variable at its first
# allocation, so it is set here before torch is imported; THP_MEM_ALLOC_ENABLE=0 opts out). A
# decode step streams every weight and the whole KV cache; with 4 KB pages that is tens of
# thousands of TLB misses a step. SmolLM2 on its Q4_1 blocks, 2 threads, the batch turns of
# `flashformer bench generate --quantize gguf` run in-process: the 8-row prefill 0.34-0.62 s
# without (7 runs) against 0.22 s with (3 runs); batch 8 decoding 447-608 tokens/s (median 474)
# against 590-601.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from flashformer.attention.api import attention
from flashformer.config import ModelConfig, preset
from flashformer.loading import from_pretrained, load
from flashformer.models import (
    DecoderModel,
    EncoderDecoderModel,
    EncoderModel,
    ModelOutput,
    add_task_head,
    build,
)

__version__ = "0.1.0"
__all__ = [
    "attention",
    "add_task_head",
    "build",
    "from_pretrained",
    "load",
    "preset",
    "ModelConfig",
    "ModelOutput",
    "EncoderModel",
    "DecoderModel",
    "EncoderDecoderModel",
]
