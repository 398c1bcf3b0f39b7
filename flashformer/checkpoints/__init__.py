"""Models in and out: from_pretrained / load / load_tokenizer / export_hf / export_gguf for GGUF files, runs,
checkpoints and Hugging Face folders (loading.py), atomic checkpoint folders with a verified
manifest (checkpoint.py), and GGUF files, one table entry per architecture (gguf/)."""

from flashformer.checkpoints.checkpoint import CheckpointError
from flashformer.checkpoints.loading import export_gguf, export_hf, from_pretrained, load, load_tokenizer

__all__ = ["CheckpointError", "export_gguf", "export_hf", "from_pretrained", "load", "load_tokenizer"]
