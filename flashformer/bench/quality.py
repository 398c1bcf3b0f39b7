"""`flashformer bench quality MODEL.gguf [--run RUN]`: what quantizing costs, in perplexity.

The text: the first --files validation files of the default corpus (Python's
standard library, split by file as `flashformer train` splits it), scored by
flashformer.eval.perplexity's sliding windows (--context, --stride). Contenders,
each its own load of the same file:

- float32: the GGUF file dequantized (gguf's dequantizer);
- int8, int4: those float weights quantized at load (per-row int8; 4-bit
  groups of 32 with scale and minimum, GGUF's Q4_1);
- gguf: the file's own Q4_1 / Q8_0 blocks, with int8 activations (as
  llama.cpp) and with float32 activations;
- llama.cpp (llama-cpp-python, when installed) on the same file, fed the same
  token ids in the same windows, scored from its logits the same way.

With --run (a `flashformer train` run or any float decoder), float32, int8
and int4 of that model too: the GPT-2 family, quantized from float.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
from pathlib import Path

import numpy as np
import torch

from flashformer.files import write_json
from flashformer.formatting import markdown_table
from flashformer.kernels.machine import machine_info

GGUF_CONTENDERS = {  # label -> (quantize, activations)
    "float32": (None, "int8"),
    "int8": ("int8", "float32"),
    "int4": ("int4", "float32"),
    "gguf blocks, int8 activations": ("gguf", "int8"),
    "gguf blocks, float32 activations": ("gguf", "float32"),
}
RUN_CONTENDERS = {"float32": (None, "int8"), "int8": ("int8", "float32"), "int4": ("int4", "float32")}


def validation_texts(files: int) -> tuple[list[str], list[str]]:
    """(names, texts) of the first `files` validation files of the default corpus, by name."""
    from flashformer.train.config import TrainConfig
    from flashformer.train.corpus import read_text, resolve_corpus, split_documents

    _, validation = split_documents(resolve_corpus(None), TrainConfig.val_fraction)
    chosen = sorted(validation, key=lambda d: d.name)[:files]
    return [d.name for d in chosen], [read_text(d.path) for d in chosen]


def score_flashformer(path: str, quantize, activations: str, texts, context: int, stride: int) -> dict:
    import flashformer
    from flashformer.eval.perplexity import perplexity

    started = time.perf_counter()
    model, tokenizer = flashformer.load(path, quantize=quantize, activations=activations)
    if context > model.config.max_seq_len:  # a shorter model: its whole window, half of it as stride
        context, stride = model.config.max_seq_len, model.config.max_seq_len // 2
    result = perplexity(model, tokenizer, texts, context, stride)
    return dict(result.to_dict(), seconds=time.perf_counter() - started)


def score_llama_cpp(path: str, texts, context: int, stride: int, threads: int) -> dict | None:
    """llama.cpp's logits over flashformer's windows of flashformer's token ids."""
    if not Path(path).is_file() or importlib.util.find_spec("llama_cpp") is None:
        return None
    from llama_cpp import Llama

    from flashformer.checkpoints.gguf.tokenizer import read_tokenizer
    from flashformer.eval.perplexity import windows

    started = time.perf_counter()
    tokenizer = read_tokenizer(path)  # the ids flashformer reads (no model needed for them)
    llm = Llama(model_path=path, n_ctx=context, n_batch=context, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False)  # fmt: skip
    nll, tokens, size = 0.0, 0, 0
    for text in texts:
        ids = tokenizer.encode(text)
        size += len(text.encode("utf-8"))
        for begin, end, first in windows(len(ids), context, stride):
            llm.reset()
            llm.eval(ids[begin:end])
            logits = np.asarray(llm.scores[: end - begin], dtype=np.float64)  # (L, vocab)
            rows = logits[first - begin - 1 : end - begin - 1]  # predicting ids[first:end]
            log_z = np.log(np.exp(rows - rows.max(-1, keepdims=True)).sum(-1)) + rows.max(-1)
            targets = np.asarray(ids[first:end])
            nll += float((log_z - rows[np.arange(len(targets)), targets]).sum())
            tokens += len(targets)
    return dict(tokens=tokens, nll=nll, mean_nll=nll / tokens, perplexity=math.exp(nll / tokens),
                bits_per_byte=nll / math.log(2) / size, seconds=time.perf_counter() - started)  # fmt: skip


def run(model: str, run_path: str | None, args) -> dict:
    names, texts = validation_texts(args.files)
    torch.set_num_threads(args.threads)
    payload = {
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d"),
        "texts": names,
        "context": args.context,
        "stride": args.stride,
        "models": {},
    }
    jobs = [(Path(model).name, model, GGUF_CONTENDERS)]
    if run_path is not None:
        jobs.append((Path(run_path).name, run_path, RUN_CONTENDERS))
    for name, path, contenders in jobs:
        results = {}
        for label, (quantize, activations) in contenders.items():
            print(f"{name}: {label} ...", flush=True)
            results[label] = score_flashformer(path, quantize, activations, texts, args.context, args.stride)
        if path.endswith(".gguf"):
            print(f"{name}: llama.cpp ...", flush=True)
            found = score_llama_cpp(path, texts, args.context, args.stride, args.threads)
            if found is not None:
                results["llama.cpp (the file's blocks, 8-bit activations)"] = found
        payload["models"][name] = results
    return payload


def table(payload: dict) -> str:
    """Per model and contender: perplexity, its change against float32, bits per byte."""
    rows = []
    for name, results in payload["models"].items():
        base = results["float32"]["perplexity"]
        for label, result in results.items():
            change = result["perplexity"] / base - 1
            rows.append([name, label, f"{result['perplexity']:.4f}", f"{change * 100:+.2f} %",
                         f"{result['bits_per_byte']:.4f}", str(result["tokens"])])  # fmt: skip
    header = ["model", "weights", "perplexity", "vs float32", "bits/byte", "tokens scored"]
    notes = []
    for name, results in payload["models"].items():
        peer = next((r for label, r in results.items() if label.startswith("llama.cpp")), None)
        ours = results.get("gguf blocks, int8 activations")
        if peer is not None and ours is not None:
            notes.append(f"{name}: flashformer on the file's blocks / llama.cpp = "
                         f"{ours['perplexity'] / peer['perplexity']:.4f} (perplexity ratio)")  # fmt: skip
    windows = {
        name: (r["float32"].get("context"), r["float32"].get("stride"))
        for name, r in payload["models"].items()
    }
    text = (
        f"{len(payload['texts'])} validation files of the stdlib corpus ({', '.join(payload['texts'])}); "
        + ", ".join(f"{name}: context {c}, stride {s}" for name, (c, s) in windows.items())
        + ".\n\n"
        + markdown_table(header, rows)
    )
    return text + ("\n\n" + "\n".join(notes) if notes else "")


def plot(payload: dict, path: Path) -> None:
    """Perplexity relative to float32, per contender, one group per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(payload["models"]), figsize=(6 * len(payload["models"]), 3.8), squeeze=False
    )
    for ax, (name, results) in zip(axes[0], payload["models"].items()):
        base = results["float32"]["perplexity"]
        labels = list(results)
        values = [(results[k]["perplexity"] / base - 1) * 100 for k in labels]
        ax.barh(range(len(labels)), values, color="tab:blue")
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.axvline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel("perplexity vs float32 (%)")
        ax.set_title(name, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help="a GGUF file (SmolLM2's Q4_1 file)")
    parser.add_argument("--run", help="also a float decoder quantized from float (a flashformer train run)")
    parser.add_argument("--files", type=int, default=3, help="validation files scored")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--stride", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for JSON and PNG")


def main_from_args(args: argparse.Namespace) -> dict:
    payload = run(args.model, args.run, args)
    write_json(args.out / "quality.json", payload)
    plot(payload, args.out / "quality.png")
    print(table(payload))
    print(f"\nwrote {args.out / 'quality.json'} and {args.out / 'quality.png'}")
    return payload
