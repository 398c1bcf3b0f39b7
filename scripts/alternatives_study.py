"""Rerun the alternatives study of docs/alternatives.md (a maintainer's tool: it writes into docs/).

    python scripts/alternatives_study.py            # the default study: about an hour on 2 CPU cores
    python scripts/alternatives_study.py --quick --threads 1   # minutes: what docs/alternatives.md
                                                               # shows (made on a crowded machine)

The study is `flashformer study alternatives` (flashformer.bench.alternatives); its run folders go
to --work. The results go to docs/figures/measured/alternatives.json (+ .png), and the generated
section of docs/alternatives.md is filled from them, as `python scripts/docs.py
--skip-bench` also does.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import docs  # scripts/docs.py, beside this file
from flashformer.bench import alternatives, alternatives_report
from flashformer.files import write_json

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "figures" / "measured" / "alternatives.json"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="scripts/alternatives_study.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="the --quick study (minutes)")
    parser.add_argument(
        "--families", help=f"comma-separated (default: all of {', '.join(alternatives.FAMILIES)})"
    )
    parser.add_argument(
        "--threads", type=int, help="torch threads (default: torch's; 1 on a crowded machine)"
    )
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "alternatives", help="run folders")
    parser.add_argument("--out", type=Path, default=OUT, help="the study's JSON")
    args = parser.parse_args(argv)
    study = alternatives.QUICK if args.quick else alternatives.DEFAULT
    if args.families:
        study = dataclasses.replace(study, families=tuple(args.families.split(",")))
    if args.threads:
        study = dataclasses.replace(study, threads=args.threads)
    study.family_names()
    payload = alternatives.run(study, args.work, log=lambda text: print(text, flush=True))
    write_json(args.out, payload)
    if args.out.resolve() != OUT:  # the pages show the stored study only
        alternatives_report.plot(payload, args.out.with_suffix(".png"))
        print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}; the docs still show {OUT}")
        return payload
    docs.fill_alternatives(ROOT / "docs")
    print(f"\nwrote {args.out}, {args.out.with_suffix('.png')}, and docs/alternatives.md")
    return payload


if __name__ == "__main__":
    main(sys.argv[1:])
