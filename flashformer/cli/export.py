"""`flashformer export MODEL --gguf OUT [--type f16|q8_0|q4_k_m]`: a run's or a Hugging Face
folder's model and tokenizer as one GGUF file (checkpoints.loading.export_gguf), or with --hf OUT
as a Hugging Face folder (export_hf). `--lora PATH --merge-lora` merges LoRA adapters into the
float weights first: the file then runs without them."""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

from flashformer.checkpoints.gguf.writer import FILE_TYPES
from flashformer.checkpoints.loading import export_gguf, export_hf
from flashformer.cli.arguments import add_lora_arguments, lora_from_args
from flashformer.formatting import format_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="a run folder of `flashformer train`, one of its checkpoints or a Hugging Face folder",
    )
    out = parser.add_mutually_exclusive_group(required=True)
    out.add_argument("--gguf", type=Path, metavar="OUT", help="the GGUF file to write")
    out.add_argument("--hf", type=Path, metavar="OUT", help="the Hugging Face folder to write")
    add_lora_arguments(parser)
    parser.add_argument(
        "--merge-lora",
        action="store_true",
        help="merge the --lora adapters into MODEL's float weights (needed with --lora: the written "
        "model has no adapters beside it)",
    )
    parser.add_argument(
        "--type",
        default="f16",
        choices=tuple(FILE_TYPES),
        help="f16 / q8_0: every matrix so (vectors float32); q4_k_m: llama.cpp's Q4_K_M mix (default: f16)",
    )
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main_from_args(args) -> dict:
    start = time.perf_counter()
    adapters = lora_from_args(args)
    if (adapters is None) != (not args.merge_lora):
        raise ValueError("--merge-lora and --lora go together: --lora PATH --merge-lora merges the adapter")
    if args.hf is not None:
        if args.hf.exists() and not args.force:
            raise FileExistsError(f"{args.hf} exists; pass --force to replace it")
        folder = export_hf(args.model, args.hf, adapters)
        print(f"wrote {folder} (a Hugging Face folder) in {time.perf_counter() - start:.1f} s")
        return dict(path=str(folder), adapters=adapters)
    types = export_gguf(
        args.model,
        args.gguf,
        args.type,
        force=args.force,
        show_progress=not args.no_progress,
        adapters=adapters,
    )
    counts = collections.Counter(types.values())
    print(
        f"wrote {args.gguf} ({format_bytes(args.gguf.stat().st_size)}, {len(types)} tensors: "
        + ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
        + f") in {time.perf_counter() - start:.1f} s"
    )
    return dict(path=str(args.gguf), type=args.type, tensors=types)
