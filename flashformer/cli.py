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

    bench_attention.add_arguments(
        benchmarks.add_parser("attention", help="time and memory of the attention backends against n")
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
