"""What a forward's extra rows cost (a speculative verify's drafts, a small batch's sequences): one
forward of each of --rows new rows after a prompt, timed on the session generate() uses (the
native decoder for a GGUF file), rewound after each, best and median of --repeats
(docs/benchmarks.md, "Speculative decoding" and "K-quant products of a few rows").

    python scripts/row_cost.py MODEL.gguf [--threads 2] [--rows 1,2,4,6,11] [--profile]
        [--out JSON --label NAME]

--profile adds where a forward's time goes (the native decoder's phases: norms, products,
attention, ...) at each row count, and what each phase adds per row.

With --out, the run is added to JSON's list of runs under its label (written atomically), with
the machine and its CPU flags: run it in fresh processes, in turns, with PYTHONPATH pointing at
each tree to compare (the table keeps each label's best).

Prompt lookup pays where a row costs little against a one-row step (DraftLength weighs it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import flashformer
from flashformer.files import write_json
from flashformer.generate.sampling import settings_from
from flashformer.generate.session import make_session
from flashformer.kernels.machine import machine_info


def measure(model_path: str, rows_list: list[int], repeats: int, profile: bool = False) -> dict[int, dict]:
    """rows -> best and median seconds of a forward of that many new rows after a 400-token prompt
    (with profile: and the native decoder's mean seconds per phase of a forward, "phases")."""
    model, tokenizer = flashformer.load(model_path, quantize="gguf")
    ids = torch.tensor([tokenizer.encode("Rename the function and show the code. " * 20)])  # (1, P)
    session = make_session(model, ids, None, settings_from(model, max_new_tokens=64))
    session.extend(ids)
    start = session.length
    found = {}
    for rows in rows_list:
        tokens = torch.zeros(1, rows, dtype=torch.long)
        seconds = []
        for _ in range(repeats):
            began = time.perf_counter()
            session.extend(tokens)
            seconds.append(time.perf_counter() - began)
            session.rewind(start)
        found[rows] = {"best_s": min(seconds), "median_s": statistics.median(seconds)}
        if profile and session.native is not None:
            session.native.set_profiling(True)
            for _ in range(repeats):
                session.extend(tokens)
                session.rewind(start)
            found[rows]["phases"] = {name: s / repeats for name, s in session.native.profile().items()}
            session.native.set_profiling(False)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--rows", default="1,2,4,6,11", help="comma-separated rows per forward; the first is 1"
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, help="a JSON file of runs to add this one to")
    parser.add_argument("--label", default="run", help="with --out: what this run measured (e.g. a commit)")
    parser.add_argument(
        "--profile", action="store_true", help="also where each forward's time goes, by phase"
    )
    args = parser.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    if not rows_list or rows_list[0] != 1 or min(rows_list) < 1:
        parser.error(f"--rows: expected positive counts starting with 1, got {args.rows!r}")
    torch.set_num_threads(args.threads)
    found = measure(args.model, rows_list, args.repeats, args.profile)
    one = found[1]["best_s"]
    for rows, times in found.items():
        per_row = (times["best_s"] - one) / (rows - 1) / one if rows > 1 else 0.0
        print(f"{rows:2d} rows: best {times['best_s'] * 1e3:7.2f} ms, median {times['median_s'] * 1e3:7.2f} ms; "
              f"each row past the first {per_row:.2f} of a one-row forward")  # fmt: skip
    if args.profile and "phases" in found[1]:
        print(
            f"mean ms per phase (native decoder); last column: ms a row adds, {rows_list[0]} to {rows_list[-1]} rows"
        )
        print(f"{'phase':14s}" + "".join(f"{rows:>8d}" for rows in rows_list))
        last = rows_list[-1]
        for phase in found[1]["phases"]:
            values = [found[rows]["phases"][phase] * 1e3 for rows in rows_list]
            added = (values[-1] - values[0]) / (last - 1) if last > 1 else 0.0
            print(f"{phase:14s}" + "".join(f"{v:8.3f}" for v in values) + f"   {added:.3f}")
    if args.out:
        payload = (
            json.loads(args.out.read_text()) if args.out.exists() else {"benchmark": "row_cost", "runs": []}
        )
        payload["runs"].append(
            {
                "label": args.label,
                "model": Path(args.model).name,
                "threads": args.threads,
                "repeats": args.repeats,
                "date": time.strftime("%Y-%m-%d %H:%M"),
                "machine": machine_info(),
                "rows": {str(rows): times for rows, times in found.items()},
            }
        )
        write_json(args.out, payload)


if __name__ == "__main__":
    main()
