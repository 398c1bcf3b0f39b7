"""Where the memory of a GGUF load goes: the model alone against the model and its tokenizer.

    python scripts/gguf_memory.py FILE.gguf [--runs 3]

Each load runs in a fresh process (a process's heap remembers what came before); "held" is
the RSS after the load less the RSS before it, as `bench generate` reports it. The model alone
is `_load_gguf(..., with_tokenizer=False)`, the same read of the file without building the
tokenizer, so the difference is what the tokenizer holds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

WORKER = """
import json, sys, time
from pathlib import Path
import torch
from flashformer.bench.common import rss_bytes
from flashformer.checkpoints import loading

torch.set_num_threads(2)
path, with_tokenizer = Path(sys.argv[1]), sys.argv[2] == "1"
before, started = rss_bytes(), time.perf_counter()
model, _ = loading._load_gguf(path, None, "gguf", "int8", with_tokenizer=with_tokenizer)
seconds = time.perf_counter() - started
weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
print(json.dumps({"held": rss_bytes() - before, "weights": weights, "load_s": seconds}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    size = args.file.stat().st_size
    print(f"{args.file.name}: {size / 1e6:.1f} MB")
    for with_tokenizer in (False, True):
        runs = [
            json.loads(
                subprocess.check_output(
                    [sys.executable, "-c", WORKER, str(args.file), str(int(with_tokenizer))]
                )
            )
            for _ in range(args.runs)
        ]
        low, high = min(r["held"] for r in runs), max(r["held"] for r in runs)
        load = [r["load_s"] for r in runs]
        what = "model and tokenizer" if with_tokenizer else "model alone"
        print(
            f"{what:20s} held {low / 1e6:.0f}-{high / 1e6:.0f} MB = {low / size:.2f}-{high / size:.2f}x "
            f"the file; weights {runs[0]['weights'] / 1e6:.0f} MB; load {min(load):.2f}-{max(load):.2f} s"
        )


if __name__ == "__main__":
    main()
