"""`flashformer train` on the command line: configs from YAML files and
--model.FIELD / --train.FIELD overrides, then a Trainer run and its summary.

Kept apart from train.py, which is the training loop itself: this module only
turns text (a YAML file, command-line strings) into the two typed configs.
"""

from __future__ import annotations

import typing
from pathlib import Path

import torch.distributed as dist

from flashformer.adapters.peft import save_peft
from flashformer.checkpoints.loading import LORA_ADAPTER, export_hf
from flashformer.cli.arguments import convert, parse_dotted
from flashformer.train.config import TrainConfig
from flashformer.train.trainer import Trainer

# ---- the command line: flashformer train ----

DEFAULT_PRESET = "gpt-mini"


def add_arguments(parser) -> None:
    parser.add_argument("config", nargs="?", help="a YAML file with `model:` and `train:` sections")
    parser.add_argument("--preset", help=f"model preset (default {DEFAULT_PRESET})")
    parser.add_argument(
        "--data", nargs="+", help="files, folders or glob patterns (default: Python's stdlib)"
    )
    parser.add_argument("--out", help="run folder (default runs/<preset>)")
    parser.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    lora = parser.add_argument_group("LoRA fine-tuning: an adapter trained beside a frozen base")
    lora.add_argument(
        "--base", metavar="MODEL", help="the model to adapt (a Hugging Face folder, GGUF file or run)"
    )
    lora.add_argument(
        "--lora", action="store_true", help="train a LoRA adapter on --base (checkpoints hold it alone)"
    )
    lora.add_argument(
        "--base-quantize",
        choices=("none", "gguf", "int8", "int4"),
        default="none",
        help="how --base loads: none (float32, default), or quantized (a GGUF file's own blocks: gguf), "
        "the adapter trained beside the blocks",
    )
    lora.add_argument("--lora-rank", type=int, default=8, help="the adapter's rank r (default 8)")
    lora.add_argument(
        "--lora-alpha", type=float, default=16.0, help="its lora_alpha: scaling alpha / r (default 16)"
    )
    lora.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on its input (default 0)")
    lora.add_argument(
        "--lora-targets",
        default="q_proj,v_proj",
        help="transformers' module names it adapts, comma-separated, as PEFT's target_modules (default q_proj,v_proj)",
    )


def configs_from_args(args, extra: list[str]):
    """(ModelConfig, TrainConfig, out_dir) from a YAML file, flags and
    --model.FIELD / --train.FIELD overrides (later ones win)."""
    from flashformer.model.config import ModelConfig
    from flashformer.model.presets import preset

    file = {}
    if args.config:
        import yaml

        file = yaml.safe_load(Path(args.config).read_text()) or {}
        unknown = sorted(set(file) - {"model", "train"})
        if unknown:
            raise ValueError(f"{args.config}: unknown sections {unknown}; expected 'model' and 'train'")
    model_fields = dict(file.get("model") or {})
    train_fields = dict(file.get("train") or {})
    overrides = parse_dotted(extra)
    model_fields.update(overrides.get("model", {}))
    train_fields.update(overrides.get("train", {}))
    preset_name = args.preset or model_fields.pop("preset", None) or DEFAULT_PRESET
    model_fields.pop("preset", None)
    hints = typing.get_type_hints(ModelConfig)
    unknown = sorted(set(model_fields) - set(hints))
    if unknown:
        raise ValueError(f"unknown model fields {unknown}")
    model_config = preset(
        preset_name, **{k: convert(v, hints[k], f"model.{k}") for k, v in model_fields.items()}
    )
    train_config = TrainConfig()
    train_hints = typing.get_type_hints(TrainConfig)
    for name, value in train_fields.items():
        if name not in train_hints:
            raise ValueError(f"unknown train field {name!r}; known: {sorted(train_hints)}")
        setattr(train_config, name, convert(value, train_hints[name], f"train.{name}"))
    if args.data:
        train_config.data = list(args.data)
    if args.max_steps is not None:
        train_config.max_steps = args.max_steps
    if getattr(args, "lora", False) or getattr(args, "base", None):
        if not (args.lora and args.base):
            raise ValueError("--base MODEL and --lora go together: a base is fine-tuned with a LoRA adapter")
        train_config.base = str(Path(args.base).resolve())  # a run loads it again from anywhere
        train_config.lora_rank, train_config.lora_alpha = args.lora_rank, args.lora_alpha
        train_config.lora_dropout, train_config.base_quantize = args.lora_dropout, args.base_quantize
        train_config.lora_targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
        preset_name = f"lora-{Path(args.base).stem}"
    out_dir = Path(args.out or f"runs/{preset_name}")
    return model_config, train_config, out_dir


def main_from_args(args) -> dict:
    """Train; args.overrides holds the --model.FIELD / --train.FIELD arguments."""
    model_config, train_config, out_dir = configs_from_args(args, getattr(args, "overrides", []))
    trainer = Trainer(
        model_config, train_config, out_dir, resume=args.resume, show_progress=not args.no_progress
    )
    summary = trainer.fit()
    if trainer.dist.is_main:
        print()
        print(
            f"step {summary['step']}: validation loss {summary['val_loss']:.4f} "
            f"(perplexity {summary['val_perplexity']:.2f})"
        )
        if "val_bits_per_byte" in summary:
            print(
                f"validation {summary['val_bits_per_byte']:.3f} bits/byte; unigram entropy of the text "
                f"{summary['unigram_bits_per_byte']:.3f} bits/byte"
            )
        if summary["sample"]:
            print("\n---- sample ----")
            print(summary["sample"])
            print("----------------")
        print(f"checkpoint: {summary['checkpoint']}")
        if train_config.lora_rank and summary["checkpoint"]:
            peft_folder = save_peft(trainer.model, LORA_ADAPTER, out_dir / "peft", train_config.base)
            summary["peft_export"] = str(peft_folder)
            print(f"the adapter as a PEFT folder (PeftModel.from_pretrained loads it): {peft_folder}")
        merged = train_config.base_quantize == "none"  # a quantized base's blocks take no merge
        if train_config.export_hf and summary["checkpoint"] and trainer.model_config.hf_model_type and merged:
            summary["hf_export"] = str(export_hf(summary["checkpoint"], out_dir / "hf"))
            print(f"Hugging Face export (transformers' from_pretrained loads it): {summary['hf_export']}")
        print(f"loss curve: {out_dir / 'loss.png'}; metrics: {out_dir / 'metrics.jsonl'}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return summary
