"""The `flashformer` command."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashformer", description="The Transformer, exact and measured.")
    commands = parser.add_subparsers(dest="command", required=True)

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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.benchmark == "attention":
        from flashformer.bench import attention as bench_attention

        bench_attention.main_from_args(args)
    if args.command == "bench" and args.benchmark == "model":
        from flashformer.bench import model as bench_model

        bench_model.main_from_args(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
