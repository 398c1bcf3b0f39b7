"""flashformer: the Transformer, exact, IO-aware and measured."""

from flashformer.attention.api import attention
from flashformer.config import ModelConfig, preset
from flashformer.models import DecoderModel, EncoderDecoderModel, EncoderModel, ModelOutput, build

__version__ = "0.1.0"
__all__ = [
    "attention",
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


def from_pretrained(folder, dtype=None):
    """A model from a Hugging Face checkpoint folder (bert, gpt2, t5, llama); see flashformer.hf."""
    from flashformer.hf import from_pretrained as _from_pretrained

    return _from_pretrained(folder, dtype=dtype)


def load(path, dtype=None):
    """(model, tokenizer) from a run folder of `flashformer train`, one checkpoint folder, or a
    Hugging Face folder with tokenizer.json; see flashformer.checkpoint.load."""
    from flashformer.checkpoint import load as _load

    return _load(path, dtype=dtype)
