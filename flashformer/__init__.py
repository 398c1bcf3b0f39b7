"""flashformer: the Transformer, exact, IO-aware and measured.

The package is a house of rooms, each importing only the rooms before it (docs/architecture.md):
kernels, attention, text, generate, model, checkpoints, train, encoders, eval, serve, costs,
viz, bench, cli. This module re-exports the entry points most code needs.
"""

from flashformer.attention.api import attention
from flashformer.checkpoints.loading import from_pretrained, load, load_tokenizer
from flashformer.model.config import ModelConfig, preset
from flashformer.model.models import (
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
    "load_tokenizer",
    "preset",
    "ModelConfig",
    "ModelOutput",
    "EncoderModel",
    "DecoderModel",
    "EncoderDecoderModel",
]
