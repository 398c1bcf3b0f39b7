"""The model: one ModelConfig and its presets (config.py), positional encodings (positional.py),
the blocks (layers.py), embeddings and stacks (stacks.py), the heads (heads.py: LM, masked LM,
pooling, task heads), the three families (models.py), quantized weights (quantize.py) and the
Hugging Face names of each family (hf/)."""

from flashformer.model.config import ModelConfig
from flashformer.model.models import (
    DecoderModel,
    EncoderDecoderModel,
    EncoderModel,
    ModelOutput,
    add_task_head,
    build,
)
from flashformer.model.presets import preset

__all__ = [
    "DecoderModel",
    "EncoderDecoderModel",
    "EncoderModel",
    "ModelConfig",
    "ModelOutput",
    "add_task_head",
    "build",
    "preset",
]
