"""GGUF files (llama.cpp's format) as Hugging Face checkpoints.

    checkpoint = read_gguf("model.gguf")
    checkpoint.config      # config.json as transformers would write it (model_type "llama", "qwen2", "gemma2", ...)
    checkpoint.tensors     # {transformers name: float32 tensor}, equal to transformers' GGUF load
    checkpoint.quantized   # {transformers name: QuantizedTensor}, the file's raw blocks, never re-rounded
    checkpoint.metadata    # every metadata key, as Python values (the tokenizer reads its part)
    checkpoint.mapping     # the file's memory map, whose bytes the blocks are views of

Writing goes the other way through the same tables: writer.write_gguf (and loading.export_gguf,
`flashformer export`) turns config.json's values and transformers' tensors into a file llama.cpp
runs, in f16, q8_0 or llama.cpp's Q4_K_M mix (our K-quant quantizer, kquant_quantize.py).

The config and the tensors are what `flashformer.model.hf` reads from a folder, so the same family
rules build our model from either. Reading and dequantizing are the `gguf` library's; what this
package adds is the meaning: which tensor goes where, the q/k rows llama.cpp reordered for its
RoPE put back, and a refusal naming the file and the tensor whenever the file and its metadata
disagree, instead of a model that silently computes something else.

The room: architectures.py is the one table of architectures (a module each: llama.py, qwen2.py,
phi3.py, gpt2.py, qwen3.py, gemma.py, their shared helpers in common.py); checkpoint.py reads a
file through it (read_gguf), writer.py writes one; packaged_models.py finds the real models the
tests use (smollm2_path, gemma3_path).
"""

from flashformer.checkpoints.gguf.architectures import ARCHITECTURES
from flashformer.checkpoints.gguf.checkpoint import GGUFCheckpoint, read_gguf
from flashformer.checkpoints.gguf.common import rope_row_permutation
from flashformer.checkpoints.gguf.reader import (
    BLOCK_TYPES,
    FLOAT_TYPES,
    SUPPORTED_TYPES,
    GGUFError,
    QuantizedTensor,
    read_file,
)

__all__ = [
    "ARCHITECTURES",
    "BLOCK_TYPES",
    "FLOAT_TYPES",
    "SUPPORTED_TYPES",
    "GGUFCheckpoint",
    "GGUFError",
    "QuantizedTensor",
    "read_gguf",
    "read_file",
    "rope_row_permutation",
]
