"""The alternatives study (docs/alternatives.md): the Transformer and the families that replace
its attention, trained by the same Trainer on the same tokens at matched parameter counts.

    flashformer study alternatives            # about an hour on 2 CPU cores
    flashformer study alternatives --quick    # minutes

What it measures, per family and seed:
    validation bits/byte on the default corpus (Python's stdlib, as `flashformer train` trains);
    accuracy against distance on the synthetic tasks of train/synthetic.py;
    training tokens/s (the runs themselves, and one sequence of n tokens against n);
    decoding tokens/s, the decoding state's bytes and the decode's peak RSS against context n;
and where one family's speed or memory passes another's (alternatives_report.crossovers).

A family is an entry of FAMILIES: how a width becomes its ModelConfig (built by the same
build() as every model), and the widths to choose from; the study picks, per vocabulary, the
width whose parameter count is nearest the Transformer's at StudyConfig.width.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from flashformer.bench import alternatives_speed as speed
from flashformer.bench.alternatives_report import crossovers
from flashformer.kernels.machine import machine_info
from flashformer.model.config import ModelConfig
from flashformer.model.models import build
from flashformer.model.presets import preset
from flashformer.text import bpe
from flashformer.train import synthetic
from flashformer.train.config import TrainConfig
from flashformer.train.language_modeling import LanguageModeling
from flashformer.train.trainer import Trainer

HEAD_DIM = 32

# ---- the families ----


@dataclass(frozen=True)
class Family:
    """name, what it is in a few words, width -> (layers ->) its ModelConfig, candidate widths."""

    name: str
    summary: str
    config: Callable[[int, int, int], ModelConfig]  # (width, layers, max_seq_len) -> config
    widths: tuple[int, ...]


def transformer_config(width: int, layers: int, max_seq_len: int) -> ModelConfig:
    """The default run's GPT (gpt-mini) at another width, with RoPE so that any n works."""
    return preset(
        "gpt-mini",
        d_model=width,
        n_heads=width // HEAD_DIM,
        d_ff=4 * width,
        n_layers=layers,
        position="rope",
        max_seq_len=max_seq_len,
    )


WINDOW, GLOBAL_TOKENS = 32, 4  # the sparse family: each query sees 32 keys and the first 4


def sparse_config(width: int, layers: int, max_seq_len: int) -> ModelConfig:
    """Longformer / BigBird-style: every layer a sliding window plus a few global tokens."""
    return transformer_config(width, layers, max_seq_len).replace(
        layer_types=("sliding_attention",) * layers, sliding_window=WINDOW, global_tokens=GLOBAL_TOKENS
    )


def linear_config(width: int, layers: int, max_seq_len: int) -> ModelConfig:
    """Kernelized linear attention with the elu + 1 feature map (Katharopoulos et al. 2020)."""
    return transformer_config(width, layers, max_seq_len).replace(attention_kind="linear")


def preset_config(name: str, layers_per_block: int = 1) -> Callable[[int, int, int], ModelConfig]:
    """A family that is a preset at another width (and layers_per_block layers per Transformer
    block: two Mamba blocks stand in for one attention + MLP block, as in the Mamba paper)."""

    def config(width: int, layers: int, max_seq_len: int) -> ModelConfig:
        sizes = dict(d_model=width, n_heads=1, n_layers=layers * layers_per_block)  # (no heads to divide)
        return preset(name, **sizes, max_seq_len=max_seq_len)

    return config


RECURRENT_WIDTHS = tuple(range(16, 513, 8))

FAMILIES: dict[str, Family] = {
    "transformer": Family(
        "transformer",
        "causal softmax attention + MLP (gpt-mini's design, RoPE)",
        transformer_config,
        tuple(range(HEAD_DIM, 16 * HEAD_DIM + 1, HEAD_DIM)),
    ),
    "sliding-window": Family(
        "sliding-window",
        f"the transformer with a {WINDOW}-token window and {GLOBAL_TOKENS} global tokens in every layer",
        sparse_config,
        tuple(range(HEAD_DIM, 16 * HEAD_DIM + 1, HEAD_DIM)),
    ),
    "linear-attention": Family(
        "linear-attention",
        "the transformer with causal linear attention, phi = elu + 1",
        linear_config,
        tuple(range(HEAD_DIM, 16 * HEAD_DIM + 1, HEAD_DIM)),
    ),
    "lstm": Family("lstm", "stacked nn.LSTM layers, tied head", preset_config("lstm-mini"), RECURRENT_WIDTHS),
    "gru": Family("gru", "stacked nn.GRU layers, tied head", preset_config("gru-mini"), RECURRENT_WIDTHS),
    "mamba": Family(
        "mamba",
        "Mamba-1 selective SSM blocks (two per Transformer block)",
        preset_config("mamba-mini", layers_per_block=2),
        RECURRENT_WIDTHS,
    ),
}


def parameter_count(config: ModelConfig) -> int:
    torch.manual_seed(0)
    return build(config).num_parameters()


def matched_width(family: Family, vocab_size: int, layers: int, target: int) -> tuple[int, int]:
    """(width, parameters) of the family's candidate width nearest `target` parameters (the smaller
    width on a tie). Parameters grow with the width, so a bisection builds a few models only."""

    def count(width: int) -> int:
        return parameter_count(family.config(width, layers, 1024).replace(vocab_size=vocab_size))

    widths = sorted(family.widths)
    low, high = 0, len(widths) - 1
    while high - low > 1:  # invariant: the nearest is widths[low] or above, widths[high] or below
        middle = (low + high) // 2
        if count(widths[middle]) < target:
            low = middle
        else:
            high = middle
    candidates = {w: count(w) for w in {widths[low], widths[high]}}
    width = min(candidates, key=lambda w: (abs(candidates[w] - target), w))
    return width, candidates[width]


# ---- the study's settings ----


@dataclass(frozen=True)
class StudyConfig:
    families: tuple[str, ...] = ()  # () = every family of FAMILIES
    seeds: tuple[int, ...] = (0, 1)
    layers: int = 2
    width: int = 128  # the Transformer's; the other families match its parameter count
    batch_size: int = 8
    lr: float = 2e-3
    data: tuple[str, ...] = ()  # () = Python's stdlib, the default corpus
    tokenizer: str = "bpe"
    vocab_size: int = 2048
    corpus_seq_len: int = 256
    corpus_steps: int = 300
    tasks: tuple[str, ...] = synthetic.TASKS
    task_seq_len: int = 128
    task_steps: int = 300
    eval_examples: int = 256
    decode_ns: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
    new_tokens: int = 32
    train_ns: tuple[int, ...] = (512, 2048, 8192)
    train_repeats: int = 2
    threads: int | None = None  # torch's threads in the runs and the speed points; None = torch's default
    fresh_processes: bool = True  # each speed point in its own process (False: the tests' tiny run)
    timeout_s: float = 900.0  # per speed point

    def family_names(self) -> tuple[str, ...]:
        names = self.families or tuple(FAMILIES)
        unknown = sorted(set(names) - set(FAMILIES))
        if unknown:
            raise ValueError(f"unknown families {unknown}; expected some of {sorted(FAMILIES)}")
        return names


DEFAULT = StudyConfig()
QUICK = StudyConfig(  # CI's smoke test and the figures of docs/alternatives.md (its minutes: in the JSON)
    width=64,
    batch_size=4,
    corpus_seq_len=128,
    corpus_steps=20,
    task_seq_len=64,
    task_steps=40,
    eval_examples=64,
    decode_ns=(512, 2048, 16384),
    new_tokens=32,
    train_ns=(512, 2048),
    train_repeats=1,
)
# the tests' version: seconds; a few files of the package as its corpus, bytes as tokens
TINY = StudyConfig(
    width=32,
    batch_size=4,
    tokenizer="byte",
    corpus_seq_len=32,
    corpus_steps=3,
    task_seq_len=32,
    task_steps=3,
    eval_examples=8,
    decode_ns=(64, 128),
    new_tokens=4,
    train_ns=(64,),
    train_repeats=1,
    threads=1,  # on a crowded machine one thread runs a tiny model's step many times faster than two
    fresh_processes=False,
)


def train_config(study: StudyConfig, seed: int, seq_len: int, steps: int) -> TrainConfig:
    """The same schedule and token budget for every family: steps x batch x seq_len tokens."""
    return TrainConfig(
        data=list(study.data),
        tokenizer=study.tokenizer,
        vocab_size=study.vocab_size,
        seq_len=seq_len,
        batch_size=study.batch_size,
        lr=study.lr,
        min_lr=study.lr / 10,
        warmup_steps=max(1, min(40, steps // 5)),
        max_steps=steps,
        max_minutes=0.0,  # the same budget for every family, however long it takes
        eval_every=steps,
        eval_batches=8,
        log_every=steps,
        save_every=steps,
        keep_last=1,
        export_hf=False,
        sample_tokens=0,  # no sample text at the end: nobody reads it here
        seed=seed,
    )


def run_training(model_config: ModelConfig, config: TrainConfig, out: Path, objective) -> dict:
    """One Trainer run; its summary with the training tokens/s of its steps and its minutes."""
    started = time.perf_counter()
    summary = Trainer(model_config, config, out, show_progress=False, objective=objective).fit()
    if summary["interrupted"]:  # the Trainer turned Ctrl-C / SIGTERM into a short run: stop the study
        raise KeyboardInterrupt(f"the study was interrupted during {out}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    return dict(summary, train_tokens_per_s=rates[-1], minutes=(time.perf_counter() - started) / 60)


def corpus_run(study: StudyConfig, config: ModelConfig, seed: int, work: Path, name: str) -> dict:
    """Language modelling on the corpus; validation bits/byte (the same formula as the trainer's)."""
    train = train_config(study, seed, study.corpus_seq_len, study.corpus_steps)
    objective = LanguageModeling(train, work / f"data-seed{seed}", True, False)
    found = run_training(config, train, work / f"corpus-{name}-seed{seed}", objective)
    bits = found["val_loss"] / math.log(2) / objective.run_data.val_bytes_per_token
    return {
        "seed": seed,
        "val_loss": found["val_loss"],
        "val_bits_per_byte": bits,
        "tokens": found["step"] * study.batch_size * study.corpus_seq_len,
        "train_tokens_per_s": found["train_tokens_per_s"],
        "minutes": found["minutes"],
    }


def task_run(study: StudyConfig, task: str, config: ModelConfig, seed: int, work: Path, name: str) -> dict:
    train = train_config(study, seed, study.task_seq_len, study.task_steps)
    objective = synthetic.SyntheticTask(task, train, study.eval_examples)
    found = run_training(config, train, work / f"{task}-{name}-seed{seed}", objective)
    keep = ("val_loss", "accuracy", "by_distance", "counts", "train_tokens_per_s", "minutes")
    return {"seed": seed, **{k: found[k] for k in keep}}


# ---- the study ----


def run(study: StudyConfig, work: Path, log: Callable[[str], None] = print) -> dict:
    """Every measurement of the study; run folders under `work` (deleted runs are redone)."""
    threads = torch.get_num_threads()
    if study.threads:
        torch.set_num_threads(study.threads)
    try:
        return _run(study, work, log)
    finally:
        torch.set_num_threads(threads)  # the caller's (a test session's) threads as they were


def _run(study: StudyConfig, work: Path, log: Callable[[str], None]) -> dict:
    started = time.perf_counter()
    names = study.family_names()
    load_start = os.getloadavg()
    corpus_vocab = bpe.ByteTokenizer().vocab_size if study.tokenizer == "byte" else study.vocab_size
    families, configs = {}, {}
    reference = FAMILIES["transformer"]
    for vocab_name, vocab, max_len in (
        ("corpus", corpus_vocab, study.corpus_seq_len),
        ("tasks", synthetic.VOCAB_SIZE, study.task_seq_len),
    ):
        target = parameter_count(reference.config(study.width, study.layers, 1024).replace(vocab_size=vocab))
        for name in names:
            found = (study.width, target) if name == reference.name else None  # the target itself
            width, count = found or matched_width(FAMILIES[name], vocab, study.layers, target)
            entry = families.setdefault(name, {"summary": FAMILIES[name].summary})
            entry[vocab_name] = {"width": width, "parameters": count, "target": target}
            configs[name, vocab_name] = FAMILIES[name].config(width, study.layers, max_len)
            log(f"{name}: width {width}, {count:,} parameters ({vocab_name}; target {target:,})")

    corpus = {name: {"runs": []} for name in names}
    tasks = {task: {name: {"runs": []} for name in names} for task in study.tasks}
    for seed in study.seeds:  # seed by seed, so a cut-short study still has whole seeds
        for name in names:
            found = corpus_run(study, configs[name, "corpus"], seed, work, name)
            corpus[name]["runs"].append(found)
            log(
                f"corpus {name} seed {seed}: {found['val_bits_per_byte']:.3f} bits/byte, {found['minutes']:.1f} min"
            )
            for task in study.tasks:
                found = task_run(study, task, configs[name, "tasks"], seed, work, name)
                tasks[task][name]["runs"].append(found)
                log(
                    f"{task} {name} seed {seed}: accuracy {found['accuracy']:.3f}, {found['minutes']:.1f} min"
                )
    training_minutes = (time.perf_counter() - started) / 60

    decode = {name: [] for name in names}
    train_speed = {name: [] for name in names}
    speed_started = time.perf_counter()
    for n in study.decode_ns:  # families in turns at each n: a noisy neighbour hits them alike
        for name in names:
            config = configs[name, "corpus"].replace(max_seq_len=max(n + study.new_tokens, 1024))
            point = {"kind": "decode", "config": config.to_dict(), "n": n, "new_tokens": study.new_tokens}
            point["threads"] = study.threads
            found = speed.measure(point, study.fresh_processes, study.timeout_s)
            decode[name].append({"n": n, **found})
            log(f"decode {name} n={n}: {found}")
    for n in study.train_ns:
        for name in names:
            config = configs[name, "corpus"].replace(max_seq_len=max(n, 1024))
            point = {"kind": "train", "config": config.to_dict(), "n": n, "repeats": study.train_repeats}
            point["threads"] = study.threads
            found = speed.measure(point, study.fresh_processes, study.timeout_s)
            train_speed[name].append({"n": n, **found})
            log(f"train {name} n={n}: {found}")

    payload = {
        "study": "alternatives",
        "machine": machine_info(),
        "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
        "config": dataclasses.asdict(study),
        "families": families,
        "corpus": corpus,
        "tasks": tasks,
        "decode": decode,
        "train_speed": train_speed,
        "minutes": {
            "total": (time.perf_counter() - started) / 60,
            "training": training_minutes,
            "speed": (time.perf_counter() - speed_started) / 60,
        },
    }
    payload["crossovers"] = crossovers(payload)
    return payload


def deterministic_part(payload: dict) -> dict:
    """What the same seed must reproduce on the same machine: everything but timings, memory
    peaks (the allocator's) and loads."""
    timing = {"minutes", "train_tokens_per_s", "tokens_per_s", "decode_tokens_per_s", "prefill_s"}
    timing |= {"peak_extra_bytes", "load", "load_average", "machine", "crossovers"}

    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in timing}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(payload)
