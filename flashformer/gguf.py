"""Re-export (the old path): GGUF files are read by flashformer.checkpoints.gguf."""

from flashformer.checkpoints.gguf import (
    GGUFCheckpoint,
    GGUFError,
    QuantizedTensor,
    read_file,
    read_gguf,
    smollm2_path,
)
from flashformer.checkpoints.gguf.tokenizer import read_tokenizer

__all__ = [
    "GGUFCheckpoint",
    "GGUFError",
    "QuantizedTensor",
    "read_file",
    "read_gguf",
    "read_tokenizer",
    "smollm2_path",
]
