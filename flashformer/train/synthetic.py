"""Synthetic tasks that isolate the use of distant tokens, and their objective for the Trainer.

Three tasks, each a next-token problem whose loss and accuracy count only the answer tokens, and
where every answer token has a known distance d to the token it must be read from:

    recall             associative recall (Zoology's MQAR): key-value pairs, then queries; after a
                       query key, the value that followed the same key d tokens earlier
    copying            M tokens, a gap of blanks, a delimiter, then the M tokens again (d = M + gap + 1)
    selective-copying  Gu & Dao's task (Mamba, section 4.1.1): M tokens scattered among blanks, a
                       delimiter, then the M tokens in order, without the blanks

A fixed-state model (an LSTM, a GRU, an SSM) must squeeze what it may be asked for into its
state; attention can look back. Accuracy against d shows where each family stops remembering.

Examples are functions of (seed, split, index): example i is the same on every machine and in
every run, so the Trainer's sampler draws them like windows of a corpus and a validation set is
fixed by its seed alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from flashformer.model.models import cross_entropy

BLANK, SEPARATOR = 0, 1  # the noise / padding token and the delimiter (query marker)
FIRST_DATA = 2
KEYS = VALUES = 64  # recall: key and value vocabularies (keys distinct within an example)
DATA = 64  # copying tasks: the vocabulary of the tokens to copy
VOCAB_SIZE = FIRST_DATA + KEYS + VALUES  # one vocabulary for the three tasks
IGNORE = -100
TASKS = ("recall", "copying", "selective-copying")


@dataclass(frozen=True)
class Example:
    """tokens (L + 1,) int64; answer (L + 1,) bool: tokens[t] is an answer to predict from
    tokens[:t]; distance (L + 1,) int64: for an answer, how far back its source token is (else 0)."""

    tokens: np.ndarray
    answer: np.ndarray
    distance: np.ndarray


def _empty(length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return (
        np.full(length, BLANK, dtype=np.int64),
        np.zeros(length, dtype=bool),
        np.zeros(length, dtype=np.int64),
    )


def log_uniform(rng: np.random.Generator, low: int, high: int) -> int:
    """An integer in [low, high], uniform in log: every octave of distances gets as many examples."""
    return int(min(high, max(low, math.floor(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))))


def recall_example(rng: np.random.Generator, seq_len: int) -> Example:
    """P = seq_len // 4 pairs "k v" with distinct keys, then queries "k v" up to seq_len + 1 tokens.
    Each query's pair is chosen at a log-uniform distance, so short and long lookups are both seen."""
    pairs = seq_len // 4
    if not 1 <= pairs <= KEYS:
        raise ValueError(
            f"recall: seq_len={seq_len} gives {pairs} pairs; expected 1 to {KEYS} (seq_len 4..256)"
        )
    tokens, answer, distance = _empty(seq_len + 1)
    keys = FIRST_DATA + rng.choice(KEYS, size=pairs, replace=False)
    values = FIRST_DATA + KEYS + rng.integers(0, VALUES, size=pairs)
    tokens[0 : 2 * pairs : 2], tokens[1 : 2 * pairs : 2] = keys, values
    last_seen = {int(k): 2 * i for i, k in enumerate(keys)}  # a key's latest position
    for position in range(2 * pairs, seq_len, 2):  # a query key at `position`, its value after it
        pair = min(pairs - 1, (position - log_uniform(rng, 2, position)) // 2)
        key = int(keys[pair])
        tokens[position], tokens[position + 1] = key, values[pair]
        # an earlier query of the same key is the nearest copy of the answer
        answer[position + 1], distance[position + 1] = True, position - last_seen[key]
        last_seen[key] = position
    return Example(tokens, answer, distance)


def copying_example(rng: np.random.Generator, seq_len: int) -> Example:
    """M = seq_len // 8 tokens, a gap of blanks (log-uniform length), the separator, the M tokens;
    blanks after. Every copied token's source lies M + gap + 1 tokens back."""
    count = max(1, seq_len // 8)
    gap = log_uniform(rng, 1, seq_len - 2 * count) - 1
    tokens, answer, distance = _empty(seq_len + 1)
    data = FIRST_DATA + rng.integers(0, DATA, size=count)
    start = count + gap + 1  # the first copied token
    tokens[:count], tokens[count + gap], tokens[start : start + count] = data, SEPARATOR, data
    answer[start : start + count], distance[start : start + count] = True, start
    return Example(tokens, answer, distance)


def selective_copying_example(rng: np.random.Generator, seq_len: int) -> Example:
    """M = seq_len // 16 tokens at random places among seq_len - M blanks, the separator, then the M
    tokens in order: the model must keep the tokens and forget the blanks (content-aware selection)."""
    count = max(1, seq_len // 16)
    region = seq_len - count
    tokens, answer, distance = _empty(seq_len + 1)
    places = np.sort(rng.choice(region, size=count, replace=False))
    data = FIRST_DATA + rng.integers(0, DATA, size=count)
    tokens[places], tokens[region] = data, SEPARATOR
    outputs = np.arange(region + 1, region + 1 + count)
    tokens[outputs], answer[outputs], distance[outputs] = data, True, outputs - places
    return Example(tokens, answer, distance)


MAKERS = {
    "recall": recall_example,
    "copying": copying_example,
    "selective-copying": selective_copying_example,
}


def example(task: str, seq_len: int, seed: int, split: int, index: int) -> Example:
    """Example `index` of a task's split (0 train, 1 validation) under `seed`."""
    if task not in MAKERS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    return MAKERS[task](np.random.default_rng([seed, split, index]), seq_len)


def batch(task: str, seq_len: int, seed: int, split: int, indices) -> dict:
    """input_ids (B, L); targets (B, L) with IGNORE except at answers; distance (B, L)."""
    examples = [example(task, seq_len, seed, split, int(i)) for i in indices]
    tokens = torch.from_numpy(np.stack([e.tokens for e in examples]))  # (B, L + 1)
    answer = torch.from_numpy(np.stack([e.answer for e in examples]))[:, 1:]  # (B, L)
    targets = torch.where(answer, tokens[:, 1:], torch.full_like(tokens[:, 1:], IGNORE))
    distance = torch.from_numpy(np.stack([e.distance for e in examples]))[:, 1:]  # (B, L)
    return {"input_ids": tokens[:, :-1], "targets": targets, "distance": distance}


# ---- accuracy against distance ----


def distance_bucket(d: int) -> int:
    """The octave of a distance: bucket b holds 2**b <= d < 2**(b + 1)."""
    return int(math.floor(math.log2(d)))


def bucket_label(bucket: int) -> str:
    return f"{2**bucket}-{2 ** (bucket + 1) - 1}"


def accuracy_by_distance(predictions: torch.Tensor, targets: torch.Tensor, distance: torch.Tensor) -> dict:
    """predictions, targets, distance (B, L); only answers (targets != IGNORE) count.
    Returns {"accuracy": all answers, "by_distance": {octave label: accuracy}, "counts": {label: n}}."""
    answers = targets != IGNORE
    correct = (predictions == targets)[answers].double()
    buckets = torch.floor(torch.log2(distance[answers].double())).long()
    by_distance, counts = {}, {}
    for b in sorted(set(buckets.tolist())):
        chosen = buckets == b
        by_distance[bucket_label(b)] = correct[chosen].mean().item()
        counts[bucket_label(b)] = int(chosen.sum())
    return {"accuracy": correct.mean().item(), "by_distance": by_distance, "counts": counts}


# ---- the objective the Trainer runs (interface: train/language_modeling.py) ----


class TaskVocabulary:
    """The tasks' tokens have no text: a vocabulary size is all the Trainer needs of a tokenizer."""

    vocab_size = VOCAB_SIZE


class SyntheticTask:
    """A synthetic task as a Trainer objective: examples drawn by the sampler, loss on the answer
    tokens, and validation accuracy against distance on `eval_examples` fixed examples."""

    train_size = 1 << 20  # examples the sampler permutes; far more than any run reads

    def __init__(self, task: str, config, eval_examples: int = 256):
        if task not in MAKERS:
            raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
        self.task, self.config, self.eval_examples = task, config, eval_examples
        self.tokenizer = TaskVocabulary()

    def model_config(self, model_config):
        return model_config.replace(
            vocab_size=VOCAB_SIZE, max_seq_len=max(model_config.max_seq_len, self.config.seq_len)
        )

    def initialize(self, model) -> None:
        """From build()'s random weights."""

    def train_batch(self, indices: list[int], generator: torch.Generator) -> dict:
        found = batch(self.task, self.config.seq_len, self.config.seed, 0, indices)
        return {"input_ids": found["input_ids"], "targets": found["targets"]}

    def loss(self, model, batch: dict) -> torch.Tensor:
        return cross_entropy(model(input_ids=batch["input_ids"]).logits, batch["targets"])

    def tokens(self, batch: dict) -> int:
        return batch["input_ids"].numel()

    @torch.no_grad()
    def evaluate(self, trainer) -> dict:
        """Validation loss and accuracy (overall and per octave of distance) on the answers."""
        trainer.train_model.eval()
        predictions, targets, distances, losses = [], [], [], []
        size = self.config.batch_size
        for start in range(0, self.eval_examples, size):
            indices = range(start, min(start + size, self.eval_examples))
            found = batch(self.task, self.config.seq_len, self.config.seed, 1, indices)
            logits = trainer.train_model(input_ids=found["input_ids"].to(trainer.device)).logits.float().cpu()
            losses.append(cross_entropy(logits, found["targets"]).item() * len(indices))
            predictions.append(logits.argmax(-1))
            targets.append(found["targets"])
            distances.append(found["distance"])
        scores = accuracy_by_distance(torch.cat(predictions), torch.cat(targets), torch.cat(distances))
        return {"val_loss": sum(losses) / self.eval_examples, **scores}

    def sample(self, trainer, seed: int = 0) -> str:
        return ""

    def describe(self, trainer) -> str:
        return f"task {self.task}, {self.config.batch_size * self.config.seq_len} tokens per step"

    def summary(self) -> dict:
        return {"task": self.task}

    def checkpoint_files(self) -> dict[str, str]:
        return {}

    def checkpoint_config(self) -> dict:
        return {"task": self.task}

    def finish(self, trainer) -> None:
        """Nothing to draw: the study plots accuracy against distance."""
