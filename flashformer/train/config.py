"""TrainConfig: every setting of a training run, each a `--train.FIELD` flag or a `train:` key of
a YAML file, checked before the run starts."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainConfig:
    # data
    data: list[str] = field(default_factory=list)  # files, folders, globs; [] = Python's stdlib
    tokenizer: str = "bpe"  # "bpe" (trained on the corpus) or "byte"
    vocab_size: int = 2048  # BPE vocabulary (the model's vocab_size follows the tokenizer)
    seq_len: int = 256
    val_fraction: float = 0.02
    # optimization
    batch_size: int = 8  # sequences per process per micro-step
    grad_accum: int = 1  # micro-steps per optimizer step
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 40
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    max_steps: int = 500  # the default run: about 6 minutes of training on 2 CPU cores (~3,000 tokens/s)
    max_minutes: float = 8.0  # stop (and save) after this long, so the default run ends in time; 0 = no limit
    precision: str = "fp32"  # "fp32" or "bf16" (autocast)
    compile: bool = False
    activation_checkpointing: bool = False
    distributed: str = "ddp"  # under torchrun: "ddp" or "fsdp" (FSDP2 fully_shard)
    # evaluation, logging, checkpoints
    eval_every: int = 50
    eval_batches: int = 8
    sample_tokens: int = 200
    sample_prompt: str = "def "
    log_every: int = 10
    save_every: int = 100
    keep_last: int = 3
    export_hf: bool = True  # at the end, also write <out>/hf: the model as a Hugging Face folder
    seed: int = 0
    deterministic: bool = False
    # LoRA fine-tuning (--base MODEL --lora): the base frozen, an adapter trained beside it; the
    # base's tokenizer replaces tokenizer / vocab_size, and checkpoints hold the adapter alone
    base: str = ""  # a Hugging Face folder, GGUF file or run to adapt ("" = train from scratch)
    base_quantize: str = "none"  # the base as loaded: "none" (float32) or gguf / int8 / int4 (QLoRA's way)
    lora_rank: int = 0  # 0 = no adapter
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])  # PEFT's target_modules


def check_train_config(config: TrainConfig) -> None:
    positive = (
        "seq_len",
        "batch_size",
        "grad_accum",
        "max_steps",
        "eval_every",
        "eval_batches",
        "log_every",
        "save_every",
        "vocab_size",
    )
    for name in positive:
        if getattr(config, name) < 1:
            raise ValueError(f"train.{name} must be >= 1; got {getattr(config, name)}")
    if config.tokenizer not in ("bpe", "byte"):
        raise ValueError(f"train.tokenizer must be 'bpe' or 'byte'; got {config.tokenizer!r}")
    if config.precision not in ("fp32", "bf16"):
        raise ValueError(f"train.precision must be 'fp32' or 'bf16'; got {config.precision!r}")
    if config.distributed not in ("ddp", "fsdp"):
        raise ValueError(f"train.distributed must be 'ddp' or 'fsdp'; got {config.distributed!r}")
    if config.lora_rank < 0 or (config.lora_rank > 0 and not config.base):
        raise ValueError(
            f"train.lora_rank={config.lora_rank}: an adapter needs train.base (--base MODEL, the model to adapt) "
            f"and a rank >= 1"
        )
    if config.base and config.lora_rank == 0:
        raise ValueError(
            f"train.base={config.base!r} without train.lora_rank: a base is fine-tuned with an adapter "
            f"(--lora); full fine-tuning from a base is not offered"
        )
    if config.base_quantize not in ("none", "gguf", "int8", "int4"):
        raise ValueError(
            f"train.base_quantize must be 'none', 'gguf', 'int8' or 'int4'; got {config.base_quantize!r}"
        )
    if config.lora_rank and not (
        config.lora_alpha > 0 and 0 <= config.lora_dropout < 1 and config.lora_targets
    ):
        raise ValueError(
            f"need train.lora_alpha > 0, 0 <= train.lora_dropout < 1 and some train.lora_targets; got "
            f"{config.lora_alpha}, {config.lora_dropout}, {config.lora_targets!r}"
        )
    if not (0 < config.lr and 0 <= config.min_lr <= config.lr):
        raise ValueError(
            f"need 0 < train.lr and 0 <= train.min_lr <= train.lr; got {config.lr}, {config.min_lr}"
        )
