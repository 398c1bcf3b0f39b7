"""Random-weight models of Llama 3's published shapes, written as GGUF files by our exporter: the
memory-bound cases of `flashformer bench generate` (weights far larger than the caches), at the
sizes people run.

    python -m flashformer.bench.model_shapes llama-3.1-8b /tmp/llama-8b-shape.q4_k_m.gguf [--type q4_k_m]
    flashformer bench generate --write-shape llama-3.1-8b /tmp/llama-8b-shape.q4_k_m.gguf --llama-cpp-dir DIR

The shapes are those of the published config.json files (meta-llama/Llama-3.2-1B, -3B and
Llama-3.1-8B, Qwen/Qwen2.5-0.5B on the Hugging Face hub), read from them:

| name         | hidden | layers | heads / KV heads x head_dim | intermediate | vocab   | embedding | RoPE scaling (llama3) | parameters    |
|--------------|--------|--------|-----------------------------|--------------|---------|-----------|-----------------------|---------------|
| llama-3.2-1b | 2048   | 16     | 32 / 8 x 64                 | 8192         | 128,256 | tied      | factor 32             | 1,235,814,400 |
| llama-3.2-3b | 3072   | 28     | 24 / 8 x 128                | 8192         | 128,256 | tied      | factor 32             | 3,212,749,824 |
| llama-3.1-8b | 4096   | 32     | 32 / 8 x 128                | 14336        | 128,256 | untied    | factor 8              | 8,030,261,248 |
| qwen2.5-0.5b | 896    | 24     | 14 / 2 x 64                 | 4864         | 151,936 | tied      | none (theta 1e6)      | 494,032,768   |

The Llamas: SiLU gated feed-forward, RMSNorm eps 1e-5, RoPE theta 500,000 with Llama 3's scaling
(low_freq_factor 1, high_freq_factor 4, original context 8192; written as rope_freqs.weight, as
llama.cpp's converter does), 131,072 positions, no biases. Qwen2.5-0.5B (Qwen/Qwen2.5-0.5B's
config.json), a qwen2 file: biases on q, k and v, RMSNorm eps 1e-6, RoPE theta 1,000,000 unscaled,
32,768 positions (the long-context case of bench serve --long-context). The parameter counts are the models'
published ones; tests/bench/test_model_shapes.py counts them from the file's tensor table.

The weights are N(0, 0.02) (norms: ones), drawn tensor by tensor from a generator seeded by the
tensor's name, so a file is the same on every machine and only one tensor is in memory at a time
(the 8B's largest, its untied output matrix, is 2.1 GB in float32). Random weights read the same
bytes per token as trained ones, which is what these files measure; their text is noise. The
tokenizer is a small byte-level BPE trained on a few standard-library files, padded to the
vocabulary with unused tokens, with a plain chat template so the bench can ask its question.
"""

from __future__ import annotations

import argparse
import os
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from flashformer.checkpoints.gguf.architectures import ARCHITECTURES
from flashformer.checkpoints.gguf.writer import FILE_TYPES, write_gguf
from flashformer.text.bpe import train_bpe

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
STD = 0.02


@dataclass(frozen=True)
class Shape:
    """One model's shape: what config.json says of its sizes."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool
    rope_factor: float  # Llama 3's RoPE scaling: 32 for 3.2, 8 for 3.1
    vocab: int = 128256
    positions: int = 131072
    family: str = "llama"  # or "qwen2": biases on q, k, v, RoPE theta 1e6 unscaled

    def hf_config(self) -> dict:
        """config.json's values, as transformers' LlamaConfig (or Qwen2Config) names them."""
        sizes = {
            "model_type": self.family,
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.positions,
            "tie_word_embeddings": self.tied,
        }
        if self.family == "qwen2":
            return {**sizes, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "use_sliding_window": False}
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": self.rope_factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        return {
            **sizes,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_parameters": rope,
            "attention_bias": False,
            "mlp_bias": False,
        }


# one row per model: the names `bench generate --write-shape` takes
SHAPES = {
    "llama-3.2-1b": Shape(2048, 16, 32, 8, 64, 8192, tied=True, rope_factor=32.0),
    "llama-3.2-3b": Shape(3072, 28, 24, 8, 128, 8192, tied=True, rope_factor=32.0),
    "llama-3.1-8b": Shape(4096, 32, 32, 8, 128, 14336, tied=False, rope_factor=8.0),
    "qwen2.5-0.5b": Shape(
        896, 24, 14, 2, 64, 4864, tied=True, rope_factor=1.0, vocab=151936, positions=32768, family="qwen2"
    ),
}


def shape_named(name: str) -> Shape:
    if name not in SHAPES:
        raise ValueError(f"shape must be one of {', '.join(SHAPES)}; got {name!r}")
    return SHAPES[name]


def weight_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """transformers' name -> (out, in) shape of every weight the file holds (rope_freqs aside)."""
    specs = ARCHITECTURES[shape.family].tensors(shape.hf_config())  # a tied model has no lm_head.weight
    return {spec.hf: spec.shape for spec in specs if spec.hf is not None}


def parameter_count(shape: Shape) -> int:
    return sum(torch.Size(dims).numel() for dims in weight_shapes(shape).values())


def random_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """N(0, 0.02) weights (norms: ones; biases: zeros), the same for a name on every machine."""
    if len(shape) == 1:
        return torch.zeros(shape) if name.endswith(".bias") else torch.ones(shape)
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator).mul_(STD)  # in place: the 8B head is 2.1 GB


def small_tokenizer():
    files = sorted(Path(os.__file__).parent.glob("*.py"))[:20]
    tokenizer = train_bpe((path.read_text(errors="replace") for path in files), 2048, show_progress=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_shape(
    name: str,
    path: str | Path,
    file_type: str = "q4_k_m",
    show_progress: bool = True,
    shape: Shape | None = None,
) -> dict:
    """Write the model of shape `name` at `path` (whole or not at all); returns its size, tensor
    types and the seconds the export took (tokenizer training excluded). `shape` overrides the
    table's (a tiny model, in tests)."""
    shape = shape or shape_named(name)
    config = shape.hf_config()
    shapes = weight_shapes(shape)
    tokenizer = small_tokenizer()
    start = time.perf_counter()
    types = write_gguf(
        path,
        config,
        lambda weight: random_tensor(weight, shapes[weight]),
        tokenizer,
        file_type,
        name=f"{name}-shape-random",
        source=f"the {name}-shape model",
        show_progress=show_progress,
    )
    seconds = time.perf_counter() - start
    return {"path": str(path), "bytes": Path(path).stat().st_size, "seconds": seconds, "types": types}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=tuple(SHAPES), help="the model whose shapes the file has")
    parser.add_argument("path", type=Path, help="the GGUF file to write")
    parser.add_argument("--type", default="q4_k_m", choices=tuple(FILE_TYPES))
    args = parser.parse_args(argv)
    result = write_shape(args.shape, args.path, args.type)
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
