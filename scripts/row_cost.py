"""What a verify forward's extra rows cost: one forward of 1, 2, 4, 6 and 11 new rows after a
prompt, timed on the session generate() uses (the native decoder for a GGUF file), rewound after
each, best and median of 20 (docs/benchmarks.md, "Speculative decoding").

    python scripts/row_cost.py MODEL.gguf [--threads 2]

Prompt lookup pays where a row costs little against a one-row step (DraftLength weighs it).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashformer
from flashformer.generate.sampling import settings_from
from flashformer.generate.session import make_session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = flashformer.load(args.model, quantize="gguf")
    ids = torch.tensor([tokenizer.encode("Rename the function and show the code. " * 20)])  # (1, P)
    session = make_session(model, ids, None, settings_from(model, max_new_tokens=64))
    session.extend(ids)
    start = session.length
    one = None
    for rows in (1, 2, 4, 6, 11):
        tokens = torch.zeros(1, rows, dtype=torch.long)
        seconds = []
        for _ in range(20):
            began = time.perf_counter()
            session.extend(tokens)
            seconds.append(time.perf_counter() - began)
            session.rewind(start)
        best = min(seconds)
        one = one or best
        per_row = (best - one) / (rows - 1) / one if rows > 1 else 0.0
        print(f"{rows:2d} rows: best {best * 1e3:6.2f} ms, median {statistics.median(seconds) * 1e3:6.2f} ms; "
              f"each row past the first {per_row:.2f} of a one-row forward")  # fmt: skip


if __name__ == "__main__":
    main()
