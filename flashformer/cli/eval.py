"""`flashformer eval perplexity MODEL --data GLOB`: perplexity and bits per
byte of a causal LM on text files (flashformer.eval.perplexity), printed and
written as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flashformer.cli.arguments import add_lora_arguments, add_model_arguments, load_model, lora_from_args
from flashformer.eval.perplexity import perplexity
from flashformer.files import write_json
from flashformer.train.corpus import read_text, resolve_corpus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_lora_arguments(parser)
    parser.add_argument(
        "--data", nargs="+", required=True, help="text files, folders or glob patterns (quote globs)"
    )
    parser.add_argument("--context", type=int, help="tokens per window (default: max_seq_len, at most 2048)")
    parser.add_argument("--stride", type=int, help="tokens between window starts (default: --context)")
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main_from_args(args) -> dict:
    from tqdm import tqdm

    documents = resolve_corpus(args.data)
    texts = [read_text(d.path) for d in documents]
    model, tokenizer = load_model(args)
    with tqdm(desc="scoring", unit="tok", disable=args.no_progress) as bar:
        result = perplexity(model, tokenizer, texts, args.context, args.stride, progress=bar.update)
    payload = dict(
        model=str(args.model), adapters=lora_from_args(args), data=list(args.data), **result.to_dict()
    )
    print(
        f"{result.texts} files, {result.tokens} tokens scored (context {result.context}, stride {result.stride}): "
        f"NLL {result.mean_nll:.4f} nats/token, perplexity {result.perplexity:.3f}, "
        f"{result.bits_per_byte:.4f} bits/byte"
    )
    if args.out is not None:
        write_json(args.out, payload)
    else:
        print(json.dumps(payload))
    return payload
