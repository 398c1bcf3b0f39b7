"""`flashformer finetune`: an encoder fine-tuned on a task by the trainer of `flashformer train`
(checkpoints, exact resume, torchrun), and judged on the task: its metrics on the validation
split at each evaluation, and on the test split at the end.

    flashformer finetune MODEL --task classification        # a default task built from Python's stdlib
    flashformer finetune MODEL --task tagging --train-file train.jsonl --validation-file dev.jsonl
    flashformer finetune MODEL --task retrieval --epochs 2 --train.lr 3e-5 --out runs/search
    torchrun --nproc_per_node=2 -m flashformer.cli finetune MODEL --task classification

MODEL: a Hugging Face or sentence-transformers folder with tokenizer.json (MiniLM), a run of
`flashformer train` (an encoder: `--preset bert-tiny`) or one of its checkpoints. With
--from-scratch only MODEL's architecture and tokenizer are used: the weights start random.

The run folder holds what a `flashformer train` run does (checkpoints loadable with their head
by flashformer.load, metrics.jsonl with the task's metrics per evaluation, loss.png, hf/) and
summary.json: the final validation and test metrics, the majority baseline and the minutes.

Data: JSON lines {"text", "label"} (classification; a list of labels is multi-label),
{"tokens", "tags"} (tagging) or {"query", "document"} (retrieval); without --validation-file a
fraction (--train.val_fraction) of the training lines is held out. Without --train-file, the
default task of that kind (flashformer.encoders.DEFAULT_TASKS), split by file.
"""

from __future__ import annotations

import json
import math
import os
import typing
from pathlib import Path

import torch.distributed as dist

from flashformer.checkpoints.checkpoint import CheckpointError
from flashformer.checkpoints.loading import export_hf, load
from flashformer.cli.arguments import convert, parse_dotted
from flashformer.encoders import DEFAULT_TASKS, read_task
from flashformer.encoders.datasets import TaskData
from flashformer.encoders.objectives import Retrieval, TaskSettings, task_objective
from flashformer.encoders.sentence_embeddings import read_pooling, write_sentence_transformers
from flashformer.encoders.stdlib_tasks import stable_score
from flashformer.files import write_json
from flashformer.model.config import ModelConfig
from flashformer.model.models import EncoderModel
from flashformer.train.config import TrainConfig
from flashformer.train.trainer import Trainer

# TrainConfig values for fine-tuning (BERT's recipe: a small lr, decay only on matrices, beta2
# 0.999); the others keep flashformer train's defaults. warmup_steps, eval_every and
# save_every follow the run's length unless set (see training_config).
FINETUNE_DEFAULTS = dict(
    lr=5e-5,
    min_lr=0.0,
    weight_decay=0.01,
    beta2=0.999,
    batch_size=16,
    seq_len=128,
    max_minutes=0.0,
    log_every=10,
    val_fraction=0.1,
)
EVALUATIONS = 5  # per run, when neither --train.eval_every nor epochs decide


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a Hugging Face / sentence-transformers folder, a run or a checkpoint")
    parser.add_argument("--task", required=True, choices=sorted(DEFAULT_TASKS), help="the kind of task")
    parser.add_argument("--train-file", type=Path, help="JSON lines (default: the stdlib task of --task)")
    parser.add_argument("--validation-file", type=Path, help="JSON lines scored at each evaluation")
    parser.add_argument("--test-file", type=Path, help="JSON lines scored at the end")
    parser.add_argument("--out", type=Path, help="run folder (default runs/finetune-TASK)")
    parser.add_argument("--from-scratch", action="store_true", help="MODEL's architecture, random weights")
    parser.add_argument(
        "--pooling",
        help="classification: pooler | cls | mean | max (default pooler); retrieval: cls | mean | max | "
        "mean_sqrt_len (default: the folder's, or mean)",
    )
    parser.add_argument("--epochs", type=float, default=3.0, help="passes over the training set (default 3)")
    parser.add_argument("--max-steps", type=int, help="optimizer steps (instead of --epochs)")
    parser.add_argument("--max-train", type=int, help="use at most this many training examples")
    parser.add_argument("--max-eval", type=int, help="score at most this many validation and test examples")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


# ---- the task's data ----


def hold_out(task: TaskData, fraction: float, seed: int) -> TaskData:
    """A validation split cut from the training examples: those whose line's stable hash falls
    under `fraction` (the same lines on every machine and every run)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"train.val_fraction must be in (0, 1) to hold out validation lines; got {fraction}")
    held = [e for e in task.train if stable_score(e.source, seed) < fraction]
    kept = [e for e in task.train if stable_score(e.source, seed) >= fraction]
    if not held or not kept:
        raise ValueError(
            f"{len(task.train)} training examples are too few to hold out a validation fraction of {fraction}; "
            "give --validation-file"
        )
    task.train, task.validation = kept, held
    return task


def load_task(args, val_fraction: float, seed: int) -> TaskData:
    """The task of --task from the files given, or the default stdlib task; capped by --max-train / --max-eval."""
    caps = {"max_train": args.max_train, "max_validation": args.max_eval, "max_test": args.max_eval}
    if args.train_file is None:
        if args.validation_file or args.test_file:
            raise ValueError("--validation-file and --test-file need --train-file")
        return DEFAULT_TASKS[args.task](**{k: v for k, v in caps.items() if v is not None})
    task = read_task(args.task, args.train_file, args.validation_file, args.test_file)
    if not task.validation:
        task = hold_out(task, val_fraction, seed)
    for split, cap in (("train", args.max_train), ("validation", args.max_eval), ("test", args.max_eval)):
        if cap is not None:
            setattr(task, split, getattr(task, split)[:cap])
    return task


# ---- the configs ----


def training_config(overrides: dict, train_size: int, args) -> TrainConfig:
    """FINETUNE_DEFAULTS and --train.FIELD overrides; max_steps from --max-steps or --epochs;
    unless set, warmup over the first 10 % of the steps, and an evaluation and checkpoint each
    epoch (or EVALUATIONS times in the run, whichever is more often)."""
    config = TrainConfig(**FINETUNE_DEFAULTS)
    hints = typing.get_type_hints(TrainConfig)
    for name, value in overrides.items():
        if name not in hints:
            raise ValueError(f"unknown train field {name!r}; known: {sorted(hints)}")
        setattr(config, name, convert(value, hints[name], f"train.{name}"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_step = config.batch_size * config.grad_accum * world
    steps_per_epoch = max(1, math.ceil(train_size / per_step))
    if args.max_steps is not None:
        config.max_steps = args.max_steps
    elif "max_steps" not in overrides:
        if args.epochs <= 0:
            raise ValueError(f"--epochs must be > 0; got {args.epochs}")
        config.max_steps = max(1, math.ceil(args.epochs * steps_per_epoch))
    if "warmup_steps" not in overrides:
        config.warmup_steps = max(1, config.max_steps // 10)
    if "eval_every" not in overrides:
        config.eval_every = max(1, min(steps_per_epoch, math.ceil(config.max_steps / EVALUATIONS)))
    if "save_every" not in overrides:
        config.save_every = config.eval_every
    return config


def main_from_args(args) -> dict:
    if args.pooling is not None and args.task == "tagging":
        raise ValueError(
            "--pooling chooses a sentence vector: it applies to classification and retrieval, not tagging"
        )
    overrides = parse_dotted(getattr(args, "overrides", []))
    train_overrides = overrides["train"]
    seed = int(train_overrides.get("seed", 0))
    val_fraction = float(train_overrides.get("val_fraction", FINETUNE_DEFAULTS["val_fraction"]))
    task = load_task(args, val_fraction, seed)
    model_path, stored_pooling = read_pooling(args.model)
    model, tokenizer = load(model_path)
    if not isinstance(model, EncoderModel):
        raise ValueError(
            f"finetune needs an encoder (BERT-style); {args.model} holds a {type(model).__name__}"
        )
    model_config = model.config.replace(**_model_overrides(overrides["model"]))
    train_config = training_config(train_overrides, len(task.train), args)
    if "seq_len" not in train_overrides and model_config.position == "learned":
        train_config.seq_len = min(
            train_config.seq_len, model_config.max_seq_len
        )  # a small model's positions
    settings = TaskSettings(max_length=train_config.seq_len, pooling=args.pooling)
    pretrained = None if args.from_scratch else model
    objective = task_objective(task, tokenizer, pretrained, settings, stored_pooling)
    out_dir = args.out or Path(f"runs/finetune-{args.task}")
    trainer = Trainer(
        model_config,
        train_config,
        out_dir,
        resume=args.resume,
        show_progress=not args.no_progress,
        objective=objective,
    )
    summary = trainer.fit()
    test = objective.evaluate(trainer, "test")
    summary.update(test)
    baseline = objective.majority_baseline() if hasattr(objective, "majority_baseline") else {}
    if trainer.dist.is_main:
        if test:
            trainer.log({"step": summary["step"], **test})
        if baseline:
            summary["majority_baseline"] = baseline
        _report(summary, baseline, task)
        if train_config.export_hf and summary["checkpoint"]:
            summary["hf_export"] = _export(summary["checkpoint"], out_dir / "hf", objective)
        write_json(out_dir / "summary.json", summary)
    if dist.is_initialized():
        dist.destroy_process_group()
    return summary


def _model_overrides(values: dict) -> dict:
    hints = typing.get_type_hints(ModelConfig)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ValueError(f"unknown model fields {unknown}")
    return {name: convert(value, hints[name], f"model.{name}") for name, value in values.items()}


def _report(summary: dict, baseline: dict, task: TaskData) -> None:
    shown = {k: v for k, v in summary.items() if k.startswith(("val_", "test_")) and isinstance(v, float)}
    print()
    print(f"step {summary['step']}, {summary['minutes']:.1f} minutes:")
    for name, value in shown.items():
        print(f"  {name:<22} {value:.4f}")
    if baseline:
        print(
            f"  majority class ({task.labels[baseline['label']]!r}) on test: accuracy {baseline['accuracy']:.4f}, "
            f"macro-F1 {baseline['macro_f1']:.4f}"
        )
    print(f"checkpoint: {summary['checkpoint']}")


def _export(checkpoint: str, folder: Path, objective) -> str | None:
    """The model as a Hugging Face folder (with the sentence-transformers files for retrieval);
    None, with the reason printed, where transformers has no counterpart (a mean-pooling classifier)."""
    try:
        export_hf(checkpoint, folder)
    except CheckpointError as error:  # the run's checkpoints stay usable with flashformer.load
        print(f"no Hugging Face export: {error}")
        return None
    if isinstance(objective, Retrieval):
        dimension = json.loads((folder / "config.json").read_text())["hidden_size"] * len(
            objective.pooling.modes
        )
        write_sentence_transformers(folder, objective.pooling, dimension)
    print(f"Hugging Face export (transformers and sentence-transformers load it): {folder}")
    return str(folder)
