"""`flashformer study alternatives`: the Transformer against the families that replace its
attention, trained alike at matched parameter counts (flashformer.bench.alternatives); its JSON,
PNG and Markdown tables go to --out."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flashformer.bench import alternatives, alternatives_report
from flashformer.bench.common import names, numbers
from flashformer.files import write_json


def add_arguments(parser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="fewer steps, shorter tasks, fewer n (CI's smoke test: minutes)"
    )
    parser.add_argument(
        "--families", type=names, help=f"comma-separated (default: all of {', '.join(alternatives.FAMILIES)})"
    )
    parser.add_argument("--seeds", type=numbers, help="comma-separated training seeds (default 0,1)")
    parser.add_argument("--decode-ns", type=numbers, help="context lengths of the decoding points")
    parser.add_argument("--train-ns", type=numbers, help="sequence lengths of the training-speed points")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads for every run and point (default: torch's; 1 beats 2 on a crowded machine)",
    )
    parser.add_argument("--work", type=Path, default=Path("runs/alternatives"), help="the runs' folders")
    parser.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="folder for JSON, PNG and Markdown"
    )


def study_config(args) -> alternatives.StudyConfig:
    config = alternatives.QUICK if args.quick else alternatives.DEFAULT
    given = {
        "families": args.families,
        "seeds": args.seeds,
        "decode_ns": args.decode_ns,
        "train_ns": args.train_ns,
    }
    config = dataclasses.replace(config, **{k: tuple(v) for k, v in given.items() if v})
    if args.threads:
        config = dataclasses.replace(config, threads=args.threads)
    config.family_names()  # unknown names fail before any training
    return config


def main_from_args(args) -> dict:
    payload = alternatives.run(study_config(args), args.work, log=lambda text: print(text, flush=True))
    out = args.out / "alternatives.json"
    write_json(out, payload)
    alternatives_report.plot(payload, out.with_suffix(".png"))
    text = alternatives_report.table(payload)
    out.with_suffix(".md").write_text(text + "\n")
    print("\n" + text + f"\n\nwrote {out}, {out.with_suffix('.png')} and {out.with_suffix('.md')}")
    return payload
