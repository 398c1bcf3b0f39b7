"""`flashformer bench generate --model PATH`: a real model, timed as its users run it.

The model (a GGUF file, a Hugging Face folder or a flashformer run) answers
one chat message, rendered through its own chat template: greedy, batch 1,
`new_tokens` new tokens whatever the model would say (no stop token).
Contenders, timed in turns in one fresh process: transformers on the same
weights (its GGUF loader for a GGUF file), flashformer, and flashformer with
the decode step compiled. Reported per contender: the load time, tokens/s of
the whole call, and the prompt's prefill time apart from the decode steps.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from flashformer.bench.common import time_in_turns

QUESTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def load_transformers(path: Path):
    """transformers' model of the same weights: its GGUF loader for a .gguf file (dequantized by
    the same gguf library), from_pretrained for a folder."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    if path.is_file():
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    if (path / "hf").is_dir():  # a flashformer run: its Hugging Face export
        path = path / "hf"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def timing_worker(point: dict) -> dict:
    import flashformer

    if point.get("threads"):
        torch.set_num_threads(point["threads"])
    path = Path(point["model"])
    result = {"load_before": os.getloadavg()[0], "threads": torch.get_num_threads()}
    started = time.perf_counter()
    ours, tokenizer = flashformer.load(path)
    result["load_s"] = {"flashformer": time.perf_counter() - started}
    started = time.perf_counter()
    theirs = load_transformers(path).eval()
    result["load_s"]["transformers"] = time.perf_counter() - started
    theirs.generation_config.eos_token_id = None  # no early stop: every run makes all its tokens

    messages = [{"role": "user", "content": point["question"]}]
    ids = torch.tensor([tokenizer.apply_chat_template(messages, add_generation_prompt=True)])  # (1, P)
    result["prompt_tokens"] = ids.shape[1]
    new = point["new_tokens"]

    def transformers_generate(n=new):
        with torch.no_grad():
            out = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        return out[0, ids.shape[1] :].tolist()

    def flashformer_generate(n=new, compile=False):
        return ours.generate(ids, max_new_tokens=n, eos_token_id=[], compile=compile)[
            0, ids.shape[1] :
        ].tolist()

    works = {
        "transformers": transformers_generate,
        "flashformer": flashformer_generate,
        "flashformer+compile": lambda n=new: flashformer_generate(n, compile=True),
    }
    started = time.perf_counter()
    flashformer_generate(3, compile=True)  # compiles the specialized and the dynamic graph
    result["compile_s"] = time.perf_counter() - started
    for work in works.values():  # warm: allocator, caches, lazy initialization
        work(3)
    reference = transformers_generate()
    ours_tokens = flashformer_generate()
    result["same_tokens"] = reference == ours_tokens
    result["same_prefix_tokens"] = next(
        (i for i, (a, b) in enumerate(zip(reference, ours_tokens)) if a != b), len(reference)
    )
    result["text"] = tokenizer.decode(ours_tokens)[:400]
    prefill = time_in_turns(
        {name: lambda w=work: w(1) for name, work in works.items()}, rounds=point["rounds"]
    )
    times = time_in_turns(works, rounds=point["rounds"], warmup=False)
    result["load_after"] = os.getloadavg()[0]
    result["seconds"] = times
    result["prefill_s"] = prefill
    result["tokens_per_s"] = {name: new / t for name, t in times.items()}
    result["decode_tokens_per_s"] = {name: (new - 1) / (t - prefill[name]) for name, t in times.items()}
    return result


def run(model: str, config: dict, out_dir: Path, threads: int | None, timeout_s: float) -> dict:
    from flashformer.bench.common import machine_info, run_worker
    from flashformer.files import write_json

    point = {
        "model": str(Path(model).resolve()),
        "question": config["question"],
        "new_tokens": config["new_tokens"],
        "rounds": config["rounds"],
        "threads": threads,
    }
    point.update(run_worker("flashformer.bench.generate", point, timeout_s))
    payload = {"benchmark": "generate-model", "machine": machine_info(), "config": config, "points": [point]}
    write_json(out_dir / "generate-model.json", payload)
    plot(payload, out_dir / "generate-model.png")
    return payload


def table(payload: dict) -> str:
    from flashformer.formatting import markdown_table

    rows = []
    for p in payload["points"]:
        if "error" in p:
            rows.append([Path(p["model"]).name, f"not measured: {p['error']}", "-", "-", "-", "-"])
            continue
        for name, rate in p["tokens_per_s"].items():
            load = p["load_s"].get(name.split("+")[0])
            rows.append(
                [
                    name,
                    "-" if load is None else f"{load:.1f}",
                    f"{1e3 * p['prefill_s'][name]:.0f}",
                    f"{rate:.1f}",
                    f"{p['decode_tokens_per_s'][name]:.1f}",
                    f"{rate / p['tokens_per_s']['transformers']:.2f}x",
                ]
            )
    first = payload["points"][0]
    head = (
        f"{Path(first['model']).name}, {first.get('prompt_tokens', '?')}-token chat prompt, "
        f"{payload['config']['new_tokens']} new tokens, greedy, batch 1; same greedy tokens as transformers: "
        f"{first.get('same_tokens')} (first {first.get('same_prefix_tokens')} equal)\n\n"
    )
    header = ["contender", "load s", "prefill ms", "tokens/s", "decode tokens/s", "/ transformers"]
    return head + markdown_table(header, rows)


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    point = payload["points"][0]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    if "error" in point:
        ax.text(0.5, 0.5, f"not measured: {point['error'][:80]}", ha="center", va="center")
    else:
        names = list(point["tokens_per_s"])
        ax.barh(names, [point["decode_tokens_per_s"][n] for n in names], color="tab:blue", label="decode")
        ax.barh(
            names,
            [point["tokens_per_s"][n] for n in names],
            color="tab:orange",
            height=0.4,
            label="whole call",
        )
        ax.set_xlabel("tokens/s (batch 1, greedy)")
        ax.legend(fontsize=8)
    ax.set_title(f"{Path(point['model']).name}: {payload['config']['new_tokens']} new tokens", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
