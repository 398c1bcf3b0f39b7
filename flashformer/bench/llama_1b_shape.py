"""A random-weight model of Llama-3.2-1B's shapes, written as a GGUF file by our exporter: the
memory-bound case of `flashformer bench generate --model` (weights far larger than the caches).

    python -m flashformer.bench.llama_1b_shape /tmp/llama-1b-shape.q4_k_m.gguf [--type q4_k_m]
    flashformer bench generate --write-1b-shape /tmp/llama-1b-shape.q4_k_m.gguf --quantize gguf

Shapes: d_model 2048, 16 layers, 32 query heads and 8 KV heads of 64, feed-forward 8192,
vocabulary 128,256, tied embedding (1.24B parameters). The weights are N(0, 0.02), drawn tensor
by tensor from a generator seeded by the tensor's name, so the file is the same on every
machine and only one tensor is in memory at a time. Llama 3.1's RoPE scaling is left out (the
writer does not write rope_freqs yet); it does not change the bytes read per token. The
tokenizer is a small byte-level BPE trained on a few standard-library files, padded to the
vocabulary with unused tokens, with a plain chat template so the bench can ask its question.
"""

from __future__ import annotations

import argparse
import os
import time
import zlib
from pathlib import Path

import torch

from flashformer.checkpoints.gguf.architectures import ARCHITECTURES
from flashformer.checkpoints.gguf.writer import FILE_TYPES, write_gguf
from flashformer.text.bpe import train_bpe

HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": True,
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
STD = 0.02


def random_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """N(0, 0.02) weights (norms: ones), the same for a name on every machine."""
    if len(shape) == 1:
        return torch.ones(shape)
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * STD


def small_tokenizer():
    files = sorted(Path(os.__file__).parent.glob("*.py"))[:20]
    tokenizer = train_bpe((path.read_text(errors="replace") for path in files), 2048, show_progress=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_llama_1b_shape(path: str | Path, file_type: str = "q4_k_m", show_progress: bool = True) -> dict:
    """Write the file at `path` (whole or not at all); returns its size, tensor types and the
    seconds the export took (tokenizer training excluded)."""
    shapes = {spec.hf: spec.shape for spec in ARCHITECTURES["llama"].tensors(HF_CONFIG)}
    tokenizer = small_tokenizer()
    start = time.perf_counter()
    types = write_gguf(
        path,
        HF_CONFIG,
        lambda name: random_tensor(name, shapes[name]),
        tokenizer,
        file_type,
        name="llama-1b-shape-random",
        source="the Llama-3.2-1B-shape model",
        show_progress=show_progress,
    )
    seconds = time.perf_counter() - start
    return {"path": str(path), "bytes": Path(path).stat().st_size, "seconds": seconds, "types": types}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="the GGUF file to write")
    parser.add_argument("--type", default="q4_k_m", choices=tuple(FILE_TYPES))
    args = parser.parse_args(argv)
    result = write_llama_1b_shape(args.path, args.type)
    counts: dict[str, int] = {}
    for kind in result["types"].values():
        counts[kind] = counts.get(kind, 0) + 1
    print(
        f"wrote {args.path}: {result['bytes'] / 1e9:.3f} GB, {counts}, in {result['seconds']:.1f} s "
        f"({torch.get_num_threads()} threads)"
    )
    return result


if __name__ == "__main__":
    main()
