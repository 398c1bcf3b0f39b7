"""The `flashformer` command."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashformer", description="The Transformer, exact and measured.")
    commands = parser.add_subparsers(dest="command", required=True)

    from flashformer import train

    train.add_arguments(
        commands.add_parser(
            "train",
            help="train a model (default: a small GPT on Python's standard library)",
            description="Extra --model.FIELD VALUE and --train.FIELD VALUE arguments override any config field.",
        )
    )

    bench = commands.add_parser("bench", help="run a benchmark (JSON + PNG)")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True)
    from flashformer.bench import attention as bench_attention
    from flashformer.bench import model as bench_model

    bench_attention.add_arguments(
        benchmarks.add_parser("attention", help="time and memory of the attention backends against n")
    )
    bench_model.add_arguments(
        benchmarks.add_parser(
            "model", help="tokens/s of flashformer against transformers, forward and training"
        )
    )
    return parser


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
        from flashformer import train

        try:
            train.main_from_args(args, extra)
        except (ValueError, FileNotFoundError) as error:
            parser.exit(2, f"flashformer train: error: {error}\n")
    elif args.command == "bench" and args.benchmark == "attention":
        from flashformer.bench import attention as bench_attention

        bench_attention.main_from_args(args)
    if args.command == "bench" and args.benchmark == "model":
        from flashformer.bench import model as bench_model

        bench_model.main_from_args(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
