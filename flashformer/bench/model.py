"""`flashformer bench model`: tokens/s of flashformer against transformers on the same weights.

For each model shape (gpt2-small: GPT2LMHeadModel; bert-base: BertForMaskedLM)
and each dtype (float32; bfloat16 autocast), a fresh worker process builds the
transformers model from its config with random weights, saves it, loads the
same weights into flashformer, and times in turns, in that one process:

- forward: eval mode, no grad, logits for a batch of 8 x 256 tokens;
- train: forward with the loss, backward, AdamW step (train mode).

transformers runs with its default attention (SDPA). Dropout is 0 in both
models unless --dropout is given (with attention dropout > 0, flashformer's
attention takes its seeded-dropout flash path; see attention()'s dropout rule). Under bf16
autocast on a CPU without bf16 matrix units, flashformer computes its bf16
GEMMs with float32 arithmetic (layers.linear); the contender
"flashformer-native-matmul" times the same model with that switched off, to
show how much of the difference it makes. Writes model.json and model.png.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import flashformer
from flashformer.bench.common import add_run_arguments, bench_main, names, run_worker, time_in_turns
from flashformer.files import write_json
from flashformer.kernels import cpu
from flashformer.kernels.machine import machine_info

BATCH, LENGTH = 8, 256
MODELS = ["gpt2", "bert"]
DTYPES = ["float32", "bfloat16"]
FULL = {"models": MODELS, "dtypes": DTYPES, "layers": None, "rounds": 3}
QUICK = {"models": MODELS, "dtypes": DTYPES, "layers": 2, "rounds": 2}
MODULE = "flashformer.bench.model"


def hf_model(name: str, layers: int | None, dropout: float):
    """The transformers model of a shape: gpt2-small or bert-base, randomly initialized."""
    import transformers

    transformers.logging.set_verbosity_error()
    if name == "gpt2":
        config = transformers.GPT2Config(resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
        if layers:
            config.n_layer = layers
        return transformers.GPT2LMHeadModel(config)
    config = transformers.BertConfig(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    if layers:
        config.num_hidden_layers = layers
    return transformers.BertForMaskedLM(config)


def batch(name: str, vocab_size: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (BATCH, LENGTH), generator=generator)
    if name == "gpt2":
        return {"input_ids": ids, "labels": ids}
    scored = torch.rand(BATCH, LENGTH, generator=generator) < 0.15  # BERT scores 15% of the positions
    return {"input_ids": ids, "labels": ids.masked_fill(~scored, -100)}


def _works(name: str, model, inputs: dict, dtype: str, native_matmul: bool = False) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    autocast = dtype == "bfloat16"

    decided = cpu.EMULATED_LOW_PRECISION  # what this CPU's features chose

    def switch(native: bool) -> None:
        """The native bf16 kernels for this work only (FLASHFORMER_NATIVE_LOW_PRECISION_MATMUL
        is read once, at import, so the setting it makes is switched directly)."""
        cpu.EMULATED_LOW_PRECISION = frozenset() if native else decided

    def forward():
        model.eval()
        switch(native_matmul)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(input_ids=inputs["input_ids"])
        switch(False)

    def train():
        model.train()
        switch(native_matmul)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**inputs).loss
        loss.backward()
        switch(False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return {f"{name}/forward": forward, f"{name}/train": train}


def timing_worker(point: dict) -> dict:
    torch.manual_seed(0)
    theirs = hf_model(point["model"], point["layers"], point["dropout"])
    with tempfile.TemporaryDirectory() as folder:
        theirs.save_pretrained(folder)
        ours = flashformer.from_pretrained(folder)
    inputs = batch(point["model"], ours.config.vocab_size)
    works = {}
    works.update(_works("flashformer", ours, inputs, point["dtype"]))
    works.update(_works("transformers", theirs, inputs, point["dtype"]))
    if point["native"]:
        works.update(_works("flashformer-native-matmul", ours, inputs, point["dtype"], native_matmul=True))
    times = time_in_turns(works, rounds=point["rounds"], warmup=True)
    return {
        "times": times,
        "attn_implementation": theirs.config._attn_implementation,
        "layers": ours.config.n_layers,
        "parameters": ours.num_parameters(),
    }


def run(config: dict, out_dir: Path, timeout_s: float, dropout: float) -> dict:
    points = []
    for name in config["models"]:
        for dtype in config["dtypes"]:
            point = {
                "kind": "timing",
                "model": name,
                "dtype": dtype,
                "layers": config["layers"],
                "rounds": config["rounds"],
                "dropout": dropout,
                "native": dtype == "bfloat16",
            }
            result = run_worker(MODULE, point, timeout_s)
            if "error" in result:
                points.append({"model": name, "dtype": dtype, "error": result["error"]})
                print(f"{name:>5} {dtype:>8}  error: {result['error']}", flush=True)
                continue
            for key, seconds in result["times"].items():
                contender, mode = key.split("/")
                points.append(
                    {
                        "model": name,
                        "dtype": dtype,
                        "mode": mode,
                        "contender": contender,
                        "time_s": seconds,
                        "tokens_per_s": BATCH * LENGTH / seconds,
                        "layers": result["layers"],
                        "parameters": result["parameters"],
                        "transformers_attention": result["attn_implementation"],
                    }
                )
            for mode in ("forward", "train"):
                print(_row(points, name, dtype, mode), flush=True)
    payload = {
        "benchmark": "model",
        "batch": BATCH,
        "length": LENGTH,
        "dropout": dropout,
        "machine": machine_info(),
        "config": config,
        "points": points,
        "ratios": ratios(points),
    }
    write_json(out_dir / "model.json", payload)
    plot(payload, out_dir / "model.png")
    return payload


def _lookup(points, name, dtype, mode, contender):
    for p in points:
        if (p.get("model"), p.get("dtype"), p.get("mode"), p.get("contender")) == (
            name,
            dtype,
            mode,
            contender,
        ):
            return p["tokens_per_s"]
    return None


def _row(points, name, dtype, mode) -> str:
    cells = []
    for contender in ("flashformer", "transformers", "flashformer-native-matmul"):
        value = _lookup(points, name, dtype, mode, contender)
        if value is not None:
            cells.append(f"{contender} {value:9.1f} tok/s")
    ours, theirs = (
        _lookup(points, name, dtype, mode, "flashformer"),
        _lookup(points, name, dtype, mode, "transformers"),
    )
    ratio = f"   ratio {ours / theirs:.2f}x" if ours and theirs else ""
    return f"{name:>5} {dtype:>8} {mode:>7}  " + "   ".join(cells) + ratio


def ratios(points: list[dict]) -> dict:
    """flashformer tokens/s over transformers tokens/s, per model, dtype and mode."""
    out = {}
    for name in MODELS:
        for dtype in DTYPES:
            for mode in ("forward", "train"):
                ours = _lookup(points, name, dtype, mode, "flashformer")
                theirs = _lookup(points, name, dtype, mode, "transformers")
                native = _lookup(points, name, dtype, mode, "flashformer-native-matmul")
                if ours and theirs:
                    out[f"{name}/{dtype}/{mode}"] = ours / theirs
                if native and theirs:
                    out[f"{name}/{dtype}/{mode} (native bf16 matmul)"] = native / theirs
    return out


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in payload["points"] if "error" not in p]
    groups = sorted({(p["model"], p["dtype"], p["mode"]) for p in points})
    contenders = ["flashformer", "transformers", "flashformer-native-matmul"]
    colors = {
        "flashformer": "tab:blue",
        "transformers": "tab:orange",
        "flashformer-native-matmul": "tab:gray",
    }
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 5))
    width = 0.27
    for offset, contender in enumerate(contenders):
        xs, ys = [], []
        for index, group in enumerate(groups):
            value = _lookup(points, *group, contender)
            if value is not None:
                xs.append(index + (offset - 1) * width)
                ys.append(value)
        if xs:
            ax.bar(xs, ys, width, label=contender, color=colors[contender])
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m}\n{d}\n{mode}" for m, d, mode in groups], fontsize=8)
    ax.set_ylabel("tokens / s")
    ax.set_yscale("log")
    ax.legend()
    layers = {p["model"]: p["layers"] for p in points}
    ax.set_title(
        f"batch {payload['batch']} x {payload['length']}, layers {layers}, "
        f"{payload['machine']['cpu']}, torch {payload['machine']['torch']}",
        fontsize=9,
    )
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_arguments(parser, quick="2 layers per model, 2 rounds", timeout=7200, what="(model, dtype)")
    parser.add_argument("--models", type=names, help=f"from {','.join(MODELS)}")
    parser.add_argument("--dtypes", type=names, help=f"from {','.join(DTYPES)}")
    parser.add_argument("--layers", type=int, help="override the number of layers (default: the full model)")
    parser.add_argument("--rounds", type=int, help="timed rounds per contender (after one warm-up)")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout of both models (default 0)")


def main_from_args(args: argparse.Namespace) -> dict:
    config = dict(QUICK if args.quick else FULL)
    for key in ("models", "dtypes", "layers", "rounds"):
        if getattr(args, key):
            config[key] = getattr(args, key)
    print(
        f"model benchmark: batch {BATCH} x {LENGTH}, {config['models']}, {config['dtypes']}, "
        f"layers {config['layers'] or 'full'}, each (model, dtype) in a fresh process, contenders timed in turns"
    )
    payload = run(config, args.out, args.timeout, args.dropout)
    print("\nflashformer / transformers tokens/s:")
    for name, value in payload["ratios"].items():
        print(f"  {name}: {value:.2f}x")
    print(f"\nwrote {args.out / 'model.json'} and {args.out / 'model.png'}")
    return payload


def main(argv: list[str] | None = None) -> None:
    bench_main("flashformer bench model", __doc__, add_arguments, main_from_args, timing_worker, argv)


if __name__ == "__main__":
    main()
