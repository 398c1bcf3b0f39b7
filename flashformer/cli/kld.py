"""`flashformer eval kld MODEL --save-base FILE --data GLOB` writes a base model's log-probabilities
in llama-perplexity's --kl-divergence-base format; `flashformer eval kld MODEL --base FILE` measures
MODEL's KL divergence from them (flashformer.eval.kld), printed as llama-perplexity prints it and
written as JSON. MODEL may itself be a base file, another program's log-probabilities on the same
tokens (llama-perplexity's of a quantized model): then the statistic alone is measured."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flashformer.cli.arguments import add_cache_type_arguments, add_model_arguments, load_model
from flashformer.eval.base_logits import is_base_logits, read_base_logits
from flashformer.eval.kld import (
    DEFAULT_CTX,
    KLDResult,
    cached_chunk_logits,
    chunk_logits,
    file_divergence,
    kl_divergence,
    save_base,
)
from flashformer.files import write_json
from flashformer.train.corpus import read_text, resolve_corpus


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument(
        "--save-base",
        type=Path,
        metavar="FILE",
        help="run MODEL over --data and write its log-probabilities here",
    )
    mode.add_argument(
        "--base",
        type=Path,
        metavar="FILE",
        help="a base file (--save-base's or llama-perplexity --kl-divergence-base's): measure MODEL against it",
    )
    parser.add_argument(
        "--data",
        nargs="+",
        help="with --save-base: text files, folders or glob patterns (quote globs), read as one text",
    )
    parser.add_argument(
        "--tokens-of",
        type=Path,
        metavar="FILE",
        help="with --save-base: the chunks of this base file (its tokens) instead of --data, so that two "
        "bases (a float KV cache's and llama.cpp's, say) hold the very same tokens",
    )
    parser.add_argument(
        "--ctx",
        type=int,
        help=f"tokens per chunk, as llama-perplexity's -c (default {DEFAULT_CTX}; --base: the file's)",
    )
    parser.add_argument("--chunks", type=int, help="at most this many chunks (default: all)")
    add_cache_type_arguments(parser)
    parser.add_argument("--out", type=Path, help="also write the result as JSON here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def read_data(patterns: list[str]) -> str:
    """The files as llama-perplexity's -f reads one: the texts joined by a newline, less one final newline."""
    text = "\n".join(read_text(d.path) for d in resolve_corpus(patterns))
    return text[:-1] if text.endswith("\n") else text


def main_from_args(args, logits=chunk_logits) -> dict:
    """logits: how a chunk's logits are computed (flashformer.eval.kld.ChunkLogits)."""
    from tqdm import tqdm

    if args.save_base is not None and bool(args.data) == (args.tokens_of is not None):
        raise ValueError("--save-base needs the text to run over: give --data FILES or --tokens-of BASE")
    if args.tokens_of is not None and args.save_base is None:
        raise ValueError("--tokens-of goes with --save-base")
    if args.base is not None and args.data:
        raise ValueError("--data goes with --save-base; with --base the tokens are the base file's")
    base = read_base_logits(args.base) if args.base is not None else None
    if base is not None and args.ctx not in (None, base.ctx):
        raise ValueError(
            f"--ctx {args.ctx} differs from {args.base}'s chunks of {base.ctx} tokens (leave it out)"
        )
    if is_base_logits(args.model):  # another program's log-probabilities: the statistic alone
        _check_logits_file(args, base)
        result = file_divergence(read_base_logits(args.model), base, args.chunks)
        return _finish(args, dict(model=str(args.model), **result.to_dict()), report(result))
    model, tokenizer = load_model(args)
    if args.cache_type_k is not None or args.cache_type_v is not None:  # each chunk through such a cache
        logits = cached_chunk_logits(args.cache_type_k, args.cache_type_v)
    with tqdm(desc="scoring", unit="tok", disable=args.no_progress) as bar:
        if base is None:
            text = read_data(args.data) if args.data else read_base_logits(args.tokens_of).tokens
            ctx = DEFAULT_CTX if args.ctx is None else args.ctx
            saved = save_base(model, tokenizer, text, args.save_base, ctx, args.chunks, logits, bar.update)
            data = list(args.data) if args.data else [f"the tokens of {args.tokens_of}"]
            payload = dict(model=str(args.model), data=data, **saved.to_dict())
            lines = [
                f"{args.save_base}: {saved.chunks} chunks of {saved.ctx} tokens, {saved.tokens} scored, "
                f"vocabulary {saved.vocab}; PPL(base) {saved.perplexity:.4f}"
            ]
        else:
            result = kl_divergence(model, tokenizer, base, args.chunks, logits, bar.update)
            payload, lines = dict(model=str(args.model), **result.to_dict()), report(result)
    return _finish(args, payload, lines)


def _check_logits_file(args, base) -> None:
    """MODEL is a base file: it can only be measured against --base, and has no KV cache."""
    if base is None:
        raise ValueError(
            f"MODEL {args.model} is a base logits file; it is measured against another: give --base FILE "
            "(--save-base runs a model)"
        )
    if args.cache_type_k is not None or args.cache_type_v is not None:
        raise ValueError(
            f"--cache-type-k/--cache-type-v choose a model's KV cache; MODEL {args.model} is a logits file"
        )


def _finish(args, payload: dict, lines: list[str]) -> dict:
    """Print the report, then the JSON to --out (or after the report)."""
    print("\n".join(lines))
    if args.out is not None:
        write_json(args.out, payload)
    else:
        print(json.dumps(payload))
    return payload


def report(result: KLDResult) -> list[str]:
    """The statistics in llama-perplexity --kl-divergence's words and units."""
    s = result.stats
    kld, p_diff = s["kld"], s["p_diff"]
    lines = [
        f"{result.chunks} chunks of {result.ctx} tokens, {result.tokens} scored, against {result.base}",
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {s['ppl']['value']:10.6f} ± {s['ppl']['error']:10.6f}",
        f"Mean PPL(base)                : {s['ppl_base']['value']:10.6f} ± {s['ppl_base']['error']:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['correlation']:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ratio']['value']:10.6f} ± {s['ln_ratio']['error']:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {s['ratio']['value']:10.6f} ± {s['ratio']['error']:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {s['difference']['value']:10.6f} ± {s['difference']['error']:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {kld['mean']:10.6f} ± {kld['error']:10.6f}",
    ]

    def label(key: str) -> str:
        return {"max": "Maximum", "median": "Median ", "min": "Minimum"}.get(key) or f"{float(key):4.1f}%  "

    lines += [f"{label(k)} KLD: {v:10.6f}" for k, v in kld["percentiles"].items()]
    lines += [
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {100 * p_diff['mean']:6.3f} ± {100 * p_diff['error']:5.3f} %",
    ]
    lines += [f"{label(k)} Δp: {100 * v:6.3f}%" for k, v in p_diff["percentiles"].items()]
    lines += [
        f"RMS Δp    : {100 * p_diff['rms']:6.3f} ± {100 * p_diff['rms_error']:5.3f} %",
        f"Same top p: {100 * s['same_top']['mean']:6.3f} ± {100 * s['same_top']['error']:5.3f} %",
    ]
    return lines
