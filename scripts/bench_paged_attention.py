"""Per-step cost of paged attention at SmolLM2-135M's shapes; writes JSON and a PNG.

One decode step of SmolLM2-135M attends 30 times (30 layers, 9 query heads,
3 KV heads, head dim 64), each layer over its own pools (blocks of 16 keys).
For batches of 1, 4 and 16 and sequences of 50, 1000, or 50..1000 keys this
times the whole step's attention (30 calls) for:

- paged/<backend>: flashformer.attention.paged_attention (on the CPU the C++
  kernel, one call for the batch, and per sequence: gather + attention() with
  SDPA or flash; on CUDA also the Triton kernel at several split lengths);
- batched (not invariant): every sequence's blocks gathered, padded to the
  longest, one attention() call with a key padding mask — the obvious batched
  formulation, measured to show what per-sequence calls cost; its bitwise
  batch invariance is checked and reported;
- dense: attention() on a preallocated (B, Hk, L_max, D) cache with a key
  padding mask, what a static cache pays (no gather at all).

Times are the minimum over rounds (a shared machine's noise only adds).

    python scripts/bench_paged_attention.py [--device cpu|cuda] [--threads N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from flashformer.attention import attention, paged_attention
from flashformer.kernels.machine import machine_info

LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 9, 3, 64, 16
MAX_LEN = 1000
LENGTHS = ("50", "1000", "50..1000")


def lengths_for(name: str, batch: int, gen: torch.Generator) -> list[int]:
    if name == "50..1000":
        return torch.randint(50, MAX_LEN + 1, (batch,), generator=gen).tolist()
    return [int(name)] * batch


class Step:
    """One decode step's inputs: 30 layers of pools, a shuffled block table, queries."""

    def __init__(self, lengths: list[int], device: str, gen: torch.Generator):
        batch = len(lengths)
        self.max_blocks = -(-MAX_LEN // BLOCK_SIZE)
        num_blocks = batch * self.max_blocks
        shape = (KV_HEADS, num_blocks, BLOCK_SIZE, HEAD_DIM)
        self.pools = [
            (torch.randn(shape, generator=gen).to(device), torch.randn(shape, generator=gen).to(device))
            for _ in range(LAYERS)
        ]
        order = torch.randperm(num_blocks, generator=gen)
        self.block_tables = order.view(batch, self.max_blocks).int().to(device)
        self.seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
        self.q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, generator=gen).to(device)
        longest = max(lengths)
        self.padding = (torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]).to(device)
        self.dense = [  # a static cache of the same keys, (B, Hk, L_max, D)
            tuple(gather_padded(pool, self.block_tables, longest) for pool in pair) for pair in self.pools
        ]

    def paged(self, backend: str, **extra):
        for k_pool, v_pool in self.pools:
            out = paged_attention(
                self.q, k_pool, v_pool, self.block_tables, self.seq_lens, backend=backend, **extra
            )
        return out

    def batched(self):
        return batched_attention(self.pools, self.q, self.block_tables, self.padding)

    def static(self):
        for k, v in self.dense:
            out = attention(self.q, k, v, causal=True, key_padding_mask=self.padding)
        return out


def gather_padded(pool: torch.Tensor, block_tables: torch.Tensor, longest: int) -> torch.Tensor:
    """Every sequence's keys, padded to the longest: (B, Hk, longest, D)."""
    batch, blocks = block_tables.shape[0], -(-longest // BLOCK_SIZE)
    gathered = pool.index_select(1, block_tables[:, :blocks].reshape(-1))  # (Hk, B * blocks, block_size, D)
    gathered = gathered.view(KV_HEADS, batch, blocks * BLOCK_SIZE, HEAD_DIM).transpose(0, 1)
    return gathered[:, :, :longest]


def batched_attention(pools, q, block_tables, padding):
    """One padded attention() call per layer for the whole batch."""
    for k_pool, v_pool in pools:
        k = gather_padded(k_pool, block_tables, padding.shape[1])
        v = gather_padded(v_pool, block_tables, padding.shape[1])
        out = attention(q, k, v, causal=True, key_padding_mask=padding)
    return out


def best_ms(fn, device: str, rounds: int) -> float:
    fn()  # warm up (and compile, on CUDA)
    times = []
    for _ in range(rounds):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def batched_is_invariant(step: Step, device: str) -> bool:
    """Does the batched formulation give sequence 0 the same bits alone and in the batch?"""
    pools = step.pools[:1]
    alone = batched_attention(
        pools, step.q[:1], step.block_tables[:1], step.padding[:1, : int(step.seq_lens[0])]
    )
    together = batched_attention(pools, step.q, step.block_tables, step.padding)
    return bool(torch.equal(alone[0], together[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--out", default="bench_paged")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    variants = {"paged/auto": lambda s: s.paged("auto"), "paged/flash": lambda s: s.paged("flash")}
    if device == "cpu":  # auto is the C++ kernel when built; name each way
        variants = {
            "paged/cpu (one call)": lambda s: s.paged("cpu"),
            "paged/torch (per sequence, SDPA)": lambda s: s.paged("torch"),
            "paged/flash": lambda s: s.paged("flash"),
        }
    if device == "cuda":
        for split_len in (64, 128, 256, 512):
            variants[f"paged/triton split {split_len}"] = lambda s, n=split_len: _triton(s, n)
    variants["batched (not invariant)"] = Step.batched
    variants["dense static cache"] = Step.static

    results = []
    gen = torch.Generator().manual_seed(0)
    for batch in (int(b) for b in args.batches.split(",")):
        for lengths_name in LENGTHS:
            step = Step(lengths_for(lengths_name, batch, gen), device, gen)
            row = {"batch": batch, "lengths": lengths_name, "ms_per_step": {}}
            for name, fn in variants.items():
                row["ms_per_step"][name] = round(
                    best_ms(lambda fn=fn, step=step: fn(step), device, args.rounds), 3
                )
            if batch > 1:
                row["batched_invariant"] = batched_is_invariant(step, device)
            print(json.dumps(row), flush=True)
            results.append(row)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = {"machine": machine_info(), "device": device, "layers": LAYERS, "results": results}
    (out / f"paged_attention_{device}.json").write_text(json.dumps(info, indent=1))
    _plot(results, out / f"paged_attention_{device}.png", device)


def _triton(step: Step, split_len: int):
    from flashformer.attention.masks import ScoreRules
    from flashformer.attention.triton import triton_paged_attention

    rules = ScoreRules(step.q.shape[0], Q_HEADS, 1, step.max_blocks * BLOCK_SIZE, causal=True)
    for k_pool, v_pool in step.pools:
        out, _ = triton_paged_attention(
            step.q, k_pool, v_pool, step.block_tables, step.seq_lens, rules, HEAD_DIM**-0.5, split_len
        )
    return out


def _plot(results: list[dict], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results[0]["ms_per_step"])
    labels = [f"B={r['batch']}\n{r['lengths']}" for r in results]
    fig, ax = plt.subplots(figsize=(max(8, len(results) * 0.9), 4.5))
    width = 0.8 / len(names)
    for index, name in enumerate(names):
        xs = [i + index * width for i in range(len(results))]
        ax.bar(xs, [r["ms_per_step"][name] for r in results], width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(results))], labels, fontsize=8)
    ax.set_ylabel("ms per decode step (30 layers)")
    ax.set_yscale("log")
    ax.set_title(f"Paged attention, SmolLM2-135M shapes, {device}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
