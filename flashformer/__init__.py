"""flashformer: the Transformer, exact, IO-aware and measured."""

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
