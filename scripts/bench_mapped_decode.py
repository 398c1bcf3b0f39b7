"""Decoding from a GGUF file's map against the same blocks on the allocator's (huge) pages.

    python scripts/bench_mapped_decode.py FILE.gguf [NEW_TOKENS]

Two loads of the file in one process; in the second, every quantized layer whose blocks lie in
the file's map gets a copy of them (torch's allocator: huge pages where flashformer.load turned
them on). Both decode the same prompt greedily, timed in turns (bench.common.time_in_turns), so
a neighbour's load weighs on both alike; the tokens must be equal. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import flashformer
from flashformer.bench.common import memory_status, time_in_turns
from flashformer.kernels.quantized import QuantizedEmbedding, QuantizedLinear


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    lines = Path("/proc/self/maps").read_text().splitlines()
    return [
        tuple(int(x, 16) for x in line.split()[0].split("-")) for line in lines if line.endswith(str(path))
    ]


def main() -> None:
    path = Path(sys.argv[1]).resolve()
    new = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    torch.set_num_threads(2)
    mapped, tokenizer = flashformer.load(path, quantize="gguf")
    copied, _ = flashformer.load(path, quantize="gguf")
    ranges = mapped_ranges(path)
    for module in copied.modules():
        if isinstance(module, QuantizedLinear | QuantizedEmbedding):
            if any(lo <= module.qweight.data_ptr() < hi for lo, hi in ranges):
                module.qweight = module.qweight.clone()
    if copied.config.tie_word_embeddings and isinstance(copied.lm_head, QuantizedLinear):
        copied.lm_head.qweight = copied.embeddings.tokens.qweight  # one table, as the load ties it
    ids = torch.tensor([tokenizer.encode("Once upon a time there was")])  # (1, P)

    def generate(model, n: int):
        return lambda: model.generate(ids, max_new_tokens=n, eos_token_id=[])

    full = time_in_turns({"mapped": generate(mapped, new), "copied": generate(copied, new)}, rounds=5)
    first = time_in_turns({"mapped": generate(mapped, 1), "copied": generate(copied, 1)}, rounds=5)
    assert torch.equal(generate(mapped, 8)(), generate(copied, 8)())
    rates = {name: (new - 1) / (full[name] - first[name]) for name in full}
    print(
        json.dumps(
            {"decode_tokens_per_s": rates, "full_s": full, "first_s": first, "memory": memory_status()}
        )
    )


if __name__ == "__main__":
    main()
