"""The `flashformer` command."""

from __future__ import annotations

import argparse
import importlib
import sys

# `flashformer bench NAME` runs flashformer/bench/NAME.py (its add_arguments and main_from_args)
BENCHMARKS = {
    "attention": "time and memory of the attention backends against n",
    "model": "tokens/s of flashformer against transformers, forward and training",
    "generate": "tokens/s of generation against transformers' generate",
    "train": "training tokens/s and MFU against transformers (gpt2-small shape)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashformer", description="The Transformer, exact and measured.")
    commands = parser.add_subparsers(dest="command", required=True)

    from flashformer import train_command as train

    train.add_arguments(
        commands.add_parser(
            "train",
            help="train a model (default: a small GPT on Python's standard library)",
            description="Extra --model.FIELD VALUE and --train.FIELD VALUE arguments override any config field.",
        )
    )

    add_generate_arguments(
        commands.add_parser(
            "generate",
            help="continue a prompt with a trained or converted model, printing text as it comes",
            description="CHECKPOINT: a run folder of `flashformer train` (its newest checkpoint), one "
            "checkpoint folder, or a Hugging Face folder with tokenizer.json. Samples with temperature 0.8 "
            "and top-k 50 unless --greedy or --num-beams is given.",
        )
    )

    bench = commands.add_parser("bench", help="run a benchmark (JSON + PNG)")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True)
    for name, help_text in BENCHMARKS.items():
        importlib.import_module(f"flashformer.bench.{name}").add_arguments(
            benchmarks.add_parser(name, help=help_text)
        )

    from flashformer.costs import report

    report.add_arguments(
        commands.add_parser(
            "cost",
            help="FLOPs, memory, KV cache and memory traffic from the formulas (table, JSON, PNG)",
            description="Per-component FLOPs and bytes of a model, and a plot of how each part grows with n.",
        )
    )

    viz = commands.add_parser("viz", help="draw attention maps or the positional encodings (PNG)")
    pictures = viz.add_subparsers(dest="picture", required=True)
    from flashformer.viz import attention as viz_attention
    from flashformer.viz import positional as viz_positional

    viz_attention.add_arguments(
        pictures.add_parser(
            "attention",
            help="per-layer, per-head attention maps of a text",
            description="A grid of attention maps (rows: layers, columns: heads) from a run, checkpoint or HF folder.",
        )
    )
    viz_positional.add_arguments(
        pictures.add_parser(
            "positional",
            help="sinusoidal and RoPE similarity against distance, T5 buckets, ALiBi biases",
        )
    )

    docs = commands.add_parser("docs", help="regenerate the documentation's figures and tables")
    docs_parts = docs.add_subparsers(dest="part", required=True)
    from flashformer import docs as docs_module

    docs_module.add_arguments(
        docs_parts.add_parser(
            "figures",
            help="every figure under docs/figures and every generated table in docs/*.md",
            description="Runs the quick attention benchmark (or reuses its JSON) and redraws every figure.",
        )
    )

    return parser


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="run folder, checkpoint folder or Hugging Face folder")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=50, help="0 = no top-k filter")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    parser.add_argument("--greedy", action="store_true", help="the most likely token at every step")
    parser.add_argument("--num-beams", type=int, default=1, help="beam search (prints the result at the end)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step")


def generate_main(args) -> None:
    """Load, encode the prompt, and print the continuation as it is generated."""
    import torch

    from flashformer.checkpoint import load
    from flashformer.data import EOS

    model, tokenizer = load(args.checkpoint)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise ValueError(f"--prompt {args.prompt!r} encodes to no tokens; give some text")
    input_ids = torch.tensor([ids])
    settings = dict(
        max_new_tokens=args.max_new_tokens,
        do_sample=not args.greedy and args.num_beams == 1,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        num_beams=args.num_beams,
        seed=args.seed,
        compile=args.compile,
        eos_token_id=_eos_ids(model, tokenizer, EOS),
    )
    decoder = model.config.arch == "decoder"
    if decoder:
        print(args.prompt, end="", flush=True)
    if args.num_beams > 1:
        out = model.generate(input_ids, **settings)[0]
        new = out[len(ids) :] if decoder else out[1:]
        print(tokenizer.decode(new.tolist()), flush=True)
        return
    new, shown = [], ""
    for tokens in model.stream(input_ids, **settings):
        new.append(int(tokens[0]))
        text = tokenizer.decode(new)
        if not text.endswith("\ufffd"):  # hold back a character whose UTF-8 bytes are still coming
            print(text[len(shown) :], end="", flush=True)
            shown = text
    print(tokenizer.decode(new)[len(shown) :], flush=True)


def _eos_ids(model, tokenizer, eos_token: str) -> list[int]:
    """The model's eos ids if its config has usable ones, else the tokenizer's
    end-of-text token (what `flashformer train` puts between documents), else none."""
    configured = model.config.eos_token_id
    configured = [configured] if isinstance(configured, int) else list(configured or [])
    usable = [i for i in configured if 0 <= i < model.config.vocab_size]
    if usable:
        return usable
    try:
        eos = tokenizer.token_id(eos_token)
    except KeyError:
        return []
    return [eos] if 0 <= eos < model.config.vocab_size else []


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Pull `--model.FIELD VALUE` / `--train.FIELD=VALUE` pairs out of argv,
    so that argparse never mistakes an override's value for a positional."""
    rest, overrides = [], []
    items = list(argv)
    while items:
        item = items.pop(0)
        if item.startswith(("--model.", "--train.")):
            overrides.append(item)
            if "=" not in item and items:
                overrides.append(items.pop(0))
        else:
            rest.append(item)
    return rest, overrides


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv, extra = split_overrides(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if extra and args.command != "train":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "train":
        from flashformer import train_command as train

        try:
            train.main_from_args(args, extra)
        except (ValueError, FileNotFoundError) as error:
            parser.exit(2, f"flashformer train: error: {error}\n")
    elif args.command == "generate":
        from flashformer.checkpoint import CheckpointError

        try:
            generate_main(args)
        except (CheckpointError, ValueError) as error:
            parser.exit(2, f"flashformer generate: error: {error}\n")
    elif args.command == "bench":
        importlib.import_module(f"flashformer.bench.{args.benchmark}").main_from_args(args)
    elif args.command == "viz":
        from flashformer.viz import attention as viz_attention
        from flashformer.viz import positional as viz_positional

        draw = viz_attention if args.picture == "attention" else viz_positional
        try:
            draw.main_from_args(args)
        except (ValueError, FileNotFoundError) as error:
            parser.exit(2, f"flashformer viz {args.picture}: error: {error}\n")
    elif args.command == "docs":
        from flashformer import docs as docs_module

        try:
            docs_module.main_from_args(args)
        except (ValueError, FileNotFoundError, RuntimeError) as error:
            parser.exit(2, f"flashformer docs figures: error: {error}\n")
    elif args.command == "cost":
        from flashformer.costs import report

        try:
            report.main_from_args(args)
        except (ValueError, TypeError, FileNotFoundError) as error:
            parser.exit(2, f"flashformer cost: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
