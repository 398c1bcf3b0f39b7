"""Rerun the encoder study of docs/encoders.md (a maintainer's tool: it writes into docs/).

    python scripts/encoder_study.py                        # all of it: about an hour on 2 CPU cores
    python scripts/encoder_study.py --tasks retrieval --runs a,b    # a part; the rest of the JSON is kept

Each training is a `flashformer train` / `flashformer finetune` command (flashformer.encoders.study);
their folders go to --work, where finished runs are reused (delete one to redo it). The results go
to docs/figures/measured/encoder-study.json, and `python scripts/docs.py --skip-bench` redraws
docs/encoders.md's table and figure from it (this script does too, with --docs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flashformer.encoders import study
from flashformer.files import write_json

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "figures" / "measured" / "encoder-study.json"


def merge(old: dict, new: dict) -> dict:
    """The new payload, keeping the old one's tasks and runs that this invocation did not redo."""
    merged = dict(old, **{k: v for k, v in new.items() if k != "tasks"})
    tasks = dict(old.get("tasks", {}))
    for name, entry in new["tasks"].items():
        runs = dict(tasks.get(name, {}).get("runs", {}), **entry["runs"])
        tasks[name] = dict(entry, runs=runs)
    merged["tasks"] = {name: tasks[name] for name in study.TASKS if name in tasks}
    return merged


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="scripts/encoder_study.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "encoder-study", help="run folders")
    parser.add_argument("--out", type=Path, default=OUT, help="the study's JSON")
    parser.add_argument("--tasks", default=",".join(study.TASKS), help="comma-separated (default: all three)")
    parser.add_argument(
        "--runs", default=",".join(study.RUNS), help="comma-separated of a,b,c,d (default: all)"
    )
    args = parser.parse_args(argv)
    tasks = tuple(t for t in args.tasks.split(",") if t)
    runs = tuple(r for r in args.runs.split(",") if r)
    for value, allowed, name in ((tasks, study.TASKS, "--tasks"), (runs, study.RUNS, "--runs")):
        if not set(value) <= set(allowed):
            parser.error(f"{name} must name some of {allowed}; got {value}")
    payload = study.run(args.work, tasks, runs, log=lambda text: print(text, flush=True))
    if args.out.is_file():
        payload = merge(json.loads(args.out.read_text()), payload)
    write_json(args.out, payload)
    study.plot(payload, args.out.with_suffix(".png"))
    print(study.table(payload))
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}")
    return payload


if __name__ == "__main__":
    main(sys.argv[1:])
