"""The trainer: one loop for the three families, one process or many.

    flashformer train                                  # the default small GPT on Python's stdlib
    flashformer train run.yaml --train.lr 3e-4         # a config file, any field overridden
    torchrun --nproc_per_node=2 -m flashformer.cli train --preset gpt-mini   # DDP (or --train.distributed fsdp)

A run folder holds metrics.jsonl, loss.png, the tokenizer and token files,
and checkpoints (see checkpoint.py). `--resume` continues from the newest
checkpoint exactly: model, optimizer, schedule, RNG streams and data position
all come back, so a resumed run reaches the same weights as one that never
stopped (bitwise on the CPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from flashformer.checkpoints import checkpoint as ckpt
from flashformer.checkpoints.loading import adapter_names, lora_run_model
from flashformer.model.config import ModelConfig
from flashformer.model.models import build
from flashformer.train import corpus
from flashformer.train.config import TrainConfig, check_train_config
from flashformer.train.language_modeling import LanguageModeling
from flashformer.train.run_folder import archive_previous_run


def learning_rate(step: int, config: TrainConfig) -> float:
    """Linear warmup to lr, then a cosine decay to min_lr at max_steps."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (projections, embeddings); none on biases and
    norm gains, whose size should not be pulled towards zero."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# ---- distributed ----


@dataclass
class Distributed:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environment(cls) -> Distributed:
        """torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; without them, one process."""
        if "RANK" not in os.environ:
            return cls()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend=backend)
        return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))

    def all_mean(self, value: float) -> float:
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor)
        return tensor.item() / self.world_size


class GracefulInterrupt:
    """Turns Ctrl-C (SIGINT) and SIGTERM into a flag the loop checks between
    steps, so the run saves a checkpoint and exits instead of dying mid-step."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


def elapsed_minutes(started: float) -> float:
    return (time.perf_counter() - started) / 60


# ---- the trainer ----


RUNTIME_ONLY_FIELDS = {"activation_checkpointing", "attention_backend"}  # may change across a resume


class Trainer:
    """Builds a run (data, model, optimizer) and trains it; see the module docstring.

    objective: what is trained (its data, batches, loss and evaluation; the interface is in
    language_modeling.py); None = language modelling on the corpus of config.data, the
    objective of `flashformer train`. The fine-tuning tasks bring theirs (tasks/objectives.py).
    """

    def __init__(
        self,
        model_config,
        config: TrainConfig,
        out_dir: Path,
        resume: bool = False,
        show_progress: bool = True,
        objective=None,
    ):
        check_train_config(config)
        self.config, self.out_dir, self.show_progress = config, Path(out_dir), show_progress
        self.dist = Distributed.from_environment()
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", self.dist.local_rank) if cuda else torch.device("cpu")
        if config.deterministic:
            torch.use_deterministic_algorithms(True)
        if not resume and self.dist.is_main:
            archive_previous_run(self.out_dir)
        if objective is None:
            objective = LanguageModeling(config, self.out_dir / "data", self.dist.is_main, show_progress)
        self.objective = objective
        self.tokenizer = objective.tokenizer

        torch.manual_seed(config.seed)  # the same initial weights on every rank
        # a LoRA run: the base's model (its config, not model_config's) and the adapter beside it
        base = lora_run_model(dataclasses.asdict(config)) if config.lora_rank else None
        self.trainable = adapter_names(base) if base is not None else None  # what checkpoints hold
        model_config = objective.model_config(model_config if base is None else base.config)
        if base is not None:
            model_config = base.config  # the base's vocabulary (the tokenizer's may be smaller)
            if self.tokenizer.vocab_size > model_config.vocab_size:
                raise ValueError(
                    f"train.base {config.base}: its tokenizer has {self.tokenizer.vocab_size} tokens, "
                    f"the model {model_config.vocab_size}"
                )
        self.model_config = model_config.replace(
            activation_checkpointing=config.activation_checkpointing or model_config.activation_checkpointing,
        )
        if self.model_config.position == "learned" and config.seq_len > self.model_config.max_seq_len:
            raise ValueError(
                f"train.seq_len ({config.seq_len}) exceeds the model's learned positions "
                f"(max_seq_len {self.model_config.max_seq_len})"
            )
        self.model = build(self.model_config) if base is None else base
        resume_from = self._latest_checkpoint() if resume else None
        if resume_from is not None:  # before sharding: a plain, checked load
            ckpt.load_weights(resume_from, self.model, names=self.trainable)
        elif base is None:
            objective.initialize(self.model)  # a fine-tuning task's pretrained weights
        self.model.to(self.device)
        self.train_model = self._wrap(self.model)  # DDP / FSDP / compiled view used for training
        self.optimizer = torch.optim.AdamW(
            parameter_groups(self.model, config.weight_decay),
            lr=config.lr,
            betas=(config.beta1, config.beta2),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: learning_rate(step, config) / config.lr
        )
        self.sampler = corpus.ShardedSampler(
            objective.train_size, config.seed, self.dist.rank, self.dist.world_size
        )
        self.generator = torch.Generator().manual_seed(config.seed * 7919 + self.dist.rank)
        torch.manual_seed(config.seed * 104729 + self.dist.rank)  # dropout differs across ranks
        self.step = 0
        self.tokens_seen = 0
        if resume_from is not None:
            self._load_state(resume_from)

    def _wrap(self, model):
        if self.dist.world_size > 1:
            if self.config.distributed == "fsdp":
                from torch.distributed.fsdp import fully_shard

                for module in model.modules():
                    if type(module).__name__ in ("EncoderBlock", "DecoderBlock"):
                        fully_shard(module)
                model = fully_shard(model)
            else:
                from torch.nn.parallel import DistributedDataParallel

                model = DistributedDataParallel(
                    model, device_ids=[self.device.index] if self.device.index else None
                )
        if self.config.compile:
            model = torch.compile(model)
        return model

    # ---- checkpoints ----

    def _full_states(self) -> tuple[dict, dict]:
        """Whole (unsharded) model and optimizer state dicts, on the CPU;
        collective under FSDP, so every rank calls it."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(self.model, options=options)
        if self.trainable is not None:  # a LoRA run's checkpoint: the adapter alone
            weights = {name: tensor for name, tensor in weights.items() if name in self.trainable}
        optimizer = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        return weights, optimizer

    def save(self) -> Path | None:
        weights, optimizer_state = self._full_states()
        rank_state = {
            "rng": torch.get_rng_state(),
            "generator": self.generator.get_state(),
            "sampler": self.sampler.state_dict(),
        }
        ranks = [rank_state]
        if self.dist.world_size > 1:
            ranks = [None] * self.dist.world_size
            dist.all_gather_object(ranks, rank_state)
        if not self.dist.is_main:
            return None
        state = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "ranks": ranks,
        }
        run_config = {"model": self.model_config.to_dict(), "train": dataclasses.asdict(self.config)}
        extra = {
            "config.json": json.dumps(run_config | self.objective.checkpoint_config(), indent=2),
            **self.objective.checkpoint_files(),
        }
        return ckpt.save_checkpoint(self.out_dir, self.step, weights, state, extra, self.config.keep_last)

    def _latest_checkpoint(self) -> Path:
        found = ckpt.list_checkpoints(self.out_dir)
        if not found:
            raise ckpt.CheckpointError(f"--resume: no checkpoint in {self.out_dir}")
        folder = found[-1]
        ckpt.verify_checkpoint(folder)
        # both resolved, so that a checkpoint written before derived sizes were stored (None) compares equal
        saved = ModelConfig.from_dict(json.loads((folder / "config.json").read_text())["model"]).to_dict()
        ours = self.model_config.to_dict()
        changed = sorted(
            k for k in set(saved) | set(ours) if k not in RUNTIME_ONLY_FIELDS and saved.get(k) != ours.get(k)
        )
        if changed:
            raise ckpt.CheckpointError(
                f"checkpoint {folder} was made with another model config: "
                + ", ".join(f"{k} {saved.get(k)!r} != {ours.get(k)!r}" for k in changed)
            )
        return folder

    def _load_state(self, folder: Path) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        state = ckpt.load_trainer_state(folder)
        if len(state["ranks"]) != self.dist.world_size:
            raise ckpt.CheckpointError(
                f"checkpoint {folder} was written by {len(state['ranks'])} process(es); "
                f"this run has {self.dist.world_size}"
            )
        set_optimizer_state_dict(
            self.model, self.optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True)
        )
        self.scheduler.load_state_dict(state["scheduler"])
        mine = state["ranks"][self.dist.rank]
        self.sampler.load_state_dict(mine["sampler"])
        self.generator.set_state(mine["generator"])
        torch.set_rng_state(mine["rng"])
        self.step, self.tokens_seen = state["step"], state["tokens_seen"]
        if self.dist.is_main:
            print(f"resumed from {folder} at step {self.step}", flush=True)

    # ---- the loop ----

    def autocast(self):
        enabled = self.config.precision == "bf16"
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _train_step(self) -> tuple[float, int]:
        """One optimizer step over grad_accum micro-batches; returns the mean loss and the tokens
        the step read on this process."""
        cfg = self.config
        self.train_model.train()
        total, tokens = 0.0, 0
        for micro in range(cfg.grad_accum):
            batch = self.objective.train_batch(self.sampler.next_indices(cfg.batch_size), self.generator)
            tokens += self.objective.tokens(batch)
            batch = self.to_device(batch)
            last = micro == cfg.grad_accum - 1
            sync = contextlib.nullcontext()
            if not last and hasattr(self.train_model, "no_sync"):  # DDP: all-reduce once per step
                sync = self.train_model.no_sync()
            with sync:
                with self.autocast():
                    loss = self.objective.loss(self.train_model, batch) / cfg.grad_accum
                loss.backward()
            total += loss.item()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, tokens

    def evaluate(self) -> dict:
        """The objective's held-out figures (validation loss; a task's metrics)."""
        return self.objective.evaluate(self)

    def sample(self, seed: int = 0) -> str:
        """A continuation of the sample prompt (decoders), for a look at what the model learned."""
        return self.objective.sample(self, seed)

    def fit(self, until_step: int | None = None) -> dict:
        """Train to max_steps (or stop after `until_step`, with a checkpoint, as
        an interrupted run would; the schedule still runs to max_steps)."""
        from tqdm import tqdm

        cfg, is_main = self.config, self.dist.is_main
        started = time.perf_counter()
        progress = tqdm(
            total=cfg.max_steps,
            initial=self.step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not (self.show_progress and is_main),
        )
        if is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            print(
                f"model: {self.model_config.arch}, {self.model.num_parameters() / 1e6:.2f}M parameters; "
                + self.objective.describe(self),
                flush=True,
            )
        window_started, window_tokens, last_eval = time.perf_counter(), 0, None
        with GracefulInterrupt() as interrupt:
            while self.step < cfg.max_steps:
                loss, tokens = self._train_step()
                loss = self.dist.all_mean(loss)
                tokens *= self.dist.world_size  # every rank reads as many (exactly so for packed windows)
                self.step += 1
                self.tokens_seen += tokens
                window_tokens += tokens
                record = None
                if self.step % cfg.log_every == 0 or self.step == cfg.max_steps:
                    rate = window_tokens / (time.perf_counter() - window_started)
                    window_started, window_tokens = time.perf_counter(), 0
                    record = {
                        "step": self.step,
                        "loss": loss,
                        "lr": learning_rate(self.step - 1, cfg),
                        "tokens_per_s": rate,
                        "tokens": self.tokens_seen,
                        "elapsed_s": time.perf_counter() - started,
                    }
                    progress.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:,.0f}")
                if self.step % cfg.eval_every == 0:
                    last_eval = self.evaluate()
                    record = dict(record or {"step": self.step, "loss": loss}, **last_eval)
                if record is not None and is_main:
                    self.log(record)
                if self.step % cfg.save_every == 0:
                    self.save()
                progress.update(1)
                out_of_time = cfg.max_minutes > 0 and elapsed_minutes(started) >= cfg.max_minutes
                reached = until_step is not None and self.step >= until_step
                if self._anyone(interrupt.requested or out_of_time or reached):
                    break
        progress.close()
        if last_eval is None or self.step % cfg.eval_every != 0:
            last_eval = self.evaluate()
            if is_main:
                self.log(dict({"step": self.step}, **last_eval))
        folder = self.save()
        sample = self.sample()
        summary = {
            "step": self.step,
            "checkpoint": str(folder) if folder else None,
            **last_eval,
            **self.objective.summary(),
            "interrupted": interrupt.requested,
            "sample": sample,
            "minutes": elapsed_minutes(started),
        }
        if is_main:
            self.objective.finish(self)
        return summary

    def _anyone(self, flag: bool) -> bool:
        """True on every rank if it is true on any (so all ranks stop together)."""
        if self.dist.world_size == 1:
            return flag
        tensor = torch.tensor([int(flag)], device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return bool(tensor.item())

    def log(self, record: dict) -> None:
        """Append one record to the run's metrics.jsonl (rank 0 calls it)."""
        with open(self.out_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
