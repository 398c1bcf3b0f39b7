"""Fine-tuning objectives for the Trainer (train.py; the interface is in language_modeling.py):
an encoder trained on a task and judged on it.

    SequenceClassification   a label per text (or a set of labels): accuracy and macro-F1
    TokenClassification      a tag per word, on the first sub-token of each word: token-level and
                             entity-level F1, scored per word
    Retrieval                a bi-encoder (one encoder for queries and documents) trained with
                             in-batch negatives: MRR@10, recall@1 and recall@10

Each encodes its task's examples once, at construction; a batch is padded to its longest input.
evaluate() scores a whole held-out split ("validation" at each evaluation, "test" at the end)
with every process computing all of it (FSDP needs every rank in each forward; the splits are
small), so the figures do not depend on the number of processes.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from flashformer.checks import IGNORE_INDEX
from flashformer.encoders import metrics
from flashformer.encoders.datasets import TaskData
from flashformer.encoders.sentence_embeddings import Pooling, embed
from flashformer.model.models import load_shared_weights
from flashformer.text.encoder_inputs import (
    batches_by_length,
    encode_texts,
    encode_words,
    pad_batch,
    pad_id_of,
)
from flashformer.train.loss_plot import plot_losses

PREFIXES = {"validation": "val_", "test": "test_"}


@dataclass
class TaskSettings:
    """How a task is fed to the model.

    max_length: tokens per input, special tokens included (longer inputs are cut).
    pooling: classification: the classifier's pooling (ModelConfig.classifier_pooling);
        retrieval: the sentence vector's (pooling.POOLING_MODES), normalized; None = "pooler"
        for classification, and for retrieval the pretrained folder's pooling, else "mean".
    eval_batch_size: inputs per forward pass when scoring a split.
    scale: retrieval: the in-batch logits are cosine similarities times scale (20, as
        sentence-transformers' MultipleNegativesRankingLoss).
    """

    max_length: int = 128
    pooling: str | None = None
    eval_batch_size: int = 64
    scale: float = 20.0


class TaskObjective:
    """What the three tasks share: the tokenizer, the pretrained weights, the splits, the files."""

    def __init__(self, task: TaskData, tokenizer, pretrained, settings: TaskSettings):
        if not task.train:
            raise ValueError(f"task {task.name!r} has no training examples")
        if not task.validation:
            raise ValueError(f"task {task.name!r} has no validation examples to evaluate on")
        self.task, self.tokenizer, self.pretrained, self.settings = task, tokenizer, pretrained, settings
        self.pad_id = pad_id_of(tokenizer)
        self.splits = {name: self.encode(examples) for name, examples in task.splits.items()}

    # ---- for the trainer ----

    def encode(self, examples: list) -> list:
        raise NotImplementedError

    def initialize(self, model) -> None:
        """The pretrained encoder's weights (embeddings, blocks, and the pooler where the head
        reads it); the new head keeps build()'s initialization, which is transformers'. From
        scratch (no pretrained model), build()'s random weights throughout."""
        if self.pretrained is None:
            return
        fresh = load_shared_weights(model, self.pretrained)
        lost = [name for name in fresh if not name.startswith(("task_head.", "pooler."))]
        if lost:
            raise ValueError(f"the pretrained model lacks weights the encoder needs: {lost[:5]}")
        self.pretrained = None  # not needed again: a resumed run reads its checkpoint

    @property
    def train_size(self) -> int:
        return len(self.splits["train"])

    def tokens(self, batch: dict) -> int:
        """Real (not padding) tokens in a batch."""
        return int(sum(mask.sum() for name, mask in batch.items() if name.endswith("attention_mask")))

    def describe(self, trainer) -> str:
        cfg = trainer.config
        per_step = cfg.batch_size * cfg.grad_accum * trainer.dist.world_size
        sizes = ", ".join(f"{len(examples)} {name}" for name, examples in self.task.splits.items())
        return f"task {self.task.name} ({self.task.kind}): {sizes} examples; {per_step} examples per step"

    def summary(self) -> dict:
        return {}

    def sample(self, trainer, seed: int = 0) -> str:
        return ""

    def checkpoint_files(self) -> dict[str, str]:
        """The tokenizer's files (tokenizer.json, tokenizer_config.json), so that a checkpoint
        loads with flashformer.load."""
        with tempfile.TemporaryDirectory() as folder:
            self.tokenizer.save(folder)
            return {path.name: path.read_text() for path in sorted(Path(folder).iterdir()) if path.is_file()}

    def checkpoint_config(self) -> dict:
        task = {
            "name": self.task.name,
            "kind": self.task.kind,
            "labels": [str(label) for label in self.task.labels],
            "max_length": self.settings.max_length,
        }
        return {"task": task}

    def finish(self, trainer) -> None:
        plot_losses(trainer.out_dir / "metrics.jsonl", trainer.out_dir / "loss.png")

    # ---- evaluation helpers ----

    def _eval_batches(self, sequences: list[list[int]]):
        """Index lists of similar lengths, eval_batch_size at a time."""
        return batches_by_length([len(s) for s in sequences], self.settings.eval_batch_size)

    def evaluate(self, trainer, split: str = "validation") -> dict:
        """The task's metrics on a held-out split, keys prefixed "val_" or "test_"; {} for an empty split."""
        if not self.splits[split]:
            return {}
        model = trainer.model
        model.eval()
        with torch.no_grad(), trainer.autocast():
            scores = self.score(model, self.splits[split], trainer.to_device)
        return {PREFIXES[split] + name: value for name, value in scores.items()}

    def score(self, model, examples: list, to_device) -> dict:
        raise NotImplementedError


# ---- sequence classification ----


class SequenceClassification(TaskObjective):
    """A label per text (kind "classification"), or a set of labels (kind "multilabel")."""

    def model_config(self, config):
        multilabel = self.task.kind == "multilabel"
        return config.replace(
            task="sequence-classification",
            num_labels=len(self.task.labels),
            labels=[str(label) for label in self.task.labels],
            problem_type="multi_label_classification" if multilabel else "single_label_classification",
            classifier_pooling=self.settings.pooling or "pooler",
        )

    def encode(self, examples: list) -> list:
        ids = encode_texts(self.tokenizer, [example.text for example in examples], self.settings.max_length)
        label_ids = self.task.label_ids
        if self.task.kind == "multilabel":
            targets = []
            for example in examples:
                target = [0.0] * len(label_ids)
                for label in example.label:
                    target[label_ids[label]] = 1.0
                targets.append(target)
        else:
            targets = [label_ids[example.label] for example in examples]
        return list(zip(ids, targets))

    def _batch(self, examples: list) -> dict:
        batch = pad_batch([ids for ids, _ in examples], self.pad_id)
        dtype = torch.float32 if self.task.kind == "multilabel" else torch.long
        batch["labels"] = torch.tensor([target for _, target in examples], dtype=dtype)
        return batch

    def train_batch(self, indices: list[int], generator) -> dict:
        return self._batch([self.splits["train"][i] for i in indices])

    def loss(self, model, batch: dict) -> torch.Tensor:
        return model(**batch).loss

    def score(self, model, examples: list, to_device) -> dict:
        logits = torch.empty(len(examples), len(self.task.labels))
        for indices in self._eval_batches([ids for ids, _ in examples]):
            batch = to_device(pad_batch([examples[i][0] for i in indices], self.pad_id))
            logits[indices] = model(**batch).logits.float().cpu()
        targets = self._batch(examples)["labels"]
        if self.task.kind == "multilabel":
            predicted = (logits > 0).tolist()
            ids = range(len(self.task.labels))
            results = metrics.multilabel_scores(
                [{i for i in ids if row[i]} for row in targets.tolist()],
                [{i for i in ids if row[i]} for row in predicted],
                labels=list(ids),
            )
            return {"loss": F.binary_cross_entropy_with_logits(logits, targets).item(), **results}
        predicted = logits.argmax(-1).tolist()
        gold = targets.tolist()
        return {
            "loss": F.cross_entropy(logits, targets).item(),
            "accuracy": metrics.accuracy(gold, predicted),
            "macro_f1": metrics.macro_f1(gold, predicted, labels=list(range(len(self.task.labels)))),
        }

    def majority_baseline(self, split: str = "test") -> dict:
        """Always the most frequent training label: the floor the metrics mean something above."""
        if self.task.kind == "multilabel" or not self.splits[split]:
            return {}
        train = [target for _, target in self.splits["train"]]
        gold = [target for _, target in self.splits[split]]
        return metrics.majority_baseline(train, gold, labels=list(range(len(self.task.labels))))


# ---- token classification ----


class TokenClassification(TaskObjective):
    """A tag per word; the loss and the prediction sit on each word's first sub-token, and the
    metrics are computed per word (a word the input lost, cut by max_length, counts with the
    most frequent training tag as its prediction)."""

    def model_config(self, config):
        return config.replace(
            task="token-classification",
            num_labels=len(self.task.labels),
            labels=[str(label) for label in self.task.labels],
        )

    def encode(self, examples: list) -> list:
        words = encode_words(self.tokenizer, [e.tokens for e in examples], self.settings.max_length)
        label_ids = self.task.label_ids
        return [(encoded, [label_ids[tag] for tag in e.tags]) for encoded, e in zip(words, examples)]

    def _batch(self, examples: list) -> dict:
        return pad_batch(
            [encoded.ids for encoded, _ in examples],
            self.pad_id,
            labels=[encoded.labels(tags) for encoded, tags in examples],
        )

    def train_batch(self, indices: list[int], generator) -> dict:
        return self._batch([self.splits["train"][i] for i in indices])

    def loss(self, model, batch: dict) -> torch.Tensor:
        return model(**batch).loss

    def fallback_tag(self) -> int:
        return metrics.majority_label([tag for _, tags in self.splits["train"] for tag in tags])

    def score(self, model, examples: list, to_device) -> dict:
        fallback = self.fallback_tag()
        predicted: list[list[int]] = [[] for _ in examples]
        loss_sum, scored, lost = 0.0, 0, 0
        for indices in self._eval_batches([encoded.ids for encoded, _ in examples]):
            batch = self._batch([examples[i] for i in indices])
            logits = model(**to_device(batch)).logits.float().cpu()  # (B, L, tags)
            labels = batch["labels"]
            loss_sum += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                labels.reshape(-1),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            ).item()
            scored += int((labels != IGNORE_INDEX).sum())
            best = logits.argmax(-1)  # (B, L)
            for row, index in enumerate(indices):
                encoded = examples[index][0]
                predicted[index] = [int(best[row, p]) if p >= 0 else fallback for p in encoded.first_token]
                lost += sum(p < 0 for p in encoded.first_token)
        names = self.task.labels
        gold_tags = [[names[t] for t in tags] for _, tags in examples]
        predicted_tags = [[names[t] for t in tags] for tags in predicted]
        outside = "O" if "O" in names else None
        tokens = metrics.token_scores(gold_tags, predicted_tags, outside=outside)
        if self.task.tag_scheme == "bio":
            entity_f1 = metrics.entity_scores(gold_tags, predicted_tags, scheme="bio")["f1"]
        else:  # plain tags: every tagged token is an entity of its own, so entity F1 is token F1
            entity_f1 = tokens["f1"]
        return {
            "loss": loss_sum / max(1, scored),
            "token_accuracy": tokens["accuracy"],
            "token_f1": tokens["f1"],
            "token_macro_f1": tokens["macro_f1"],
            "entity_f1": entity_f1,
            "words_cut": lost,
        }


# ---- retrieval ----


class Retrieval(TaskObjective):
    """A bi-encoder: queries and documents through the same encoder and pooling, normalized;
    each query's document is its positive and the batch's other documents its negatives
    (cross-entropy over cosine similarities times `scale`)."""

    def __init__(
        self, task: TaskData, tokenizer, pretrained, settings: TaskSettings, pooling: Pooling | None = None
    ):
        super().__init__(task, tokenizer, pretrained, settings)
        modes = (settings.pooling,) if settings.pooling else (pooling.modes if pooling else ("mean",))
        self.pooling = Pooling(modes, normalize=True, max_length=settings.max_length)

    def model_config(self, config):
        return config.replace(task=None, mlm_head=False, pooler=False)  # the vectors read no head

    def encode(self, examples: list) -> list:
        length = self.settings.max_length
        queries = encode_texts(self.tokenizer, [e.query for e in examples], length)
        documents = encode_texts(self.tokenizer, [e.document for e in examples], length)
        return list(zip(queries, documents))

    def train_batch(self, indices: list[int], generator) -> dict:
        pairs = [self.splits["train"][i] for i in indices]
        queries = pad_batch([q for q, _ in pairs], self.pad_id)
        documents = pad_batch([d for _, d in pairs], self.pad_id)
        return {f"query_{k}": v for k, v in queries.items()} | {
            f"document_{k}": v for k, v in documents.items()
        }

    def loss(self, model, batch: dict) -> torch.Tensor:
        queries = embed(
            model,
            {k.removeprefix("query_"): v for k, v in batch.items() if k.startswith("query_")},
            self.pooling,
        )
        documents = embed(
            model,
            {k.removeprefix("document_"): v for k, v in batch.items() if k.startswith("document_")},
            self.pooling,
        )
        scores = queries.float() @ documents.float().T * self.settings.scale  # (B, B)
        return F.cross_entropy(scores, torch.arange(len(scores), device=scores.device))

    def _vectors(self, model, sequences: list[list[int]], to_device) -> torch.Tensor:
        vectors = torch.empty(len(sequences), self.pooling_dimension(model))
        for indices in self._eval_batches(sequences):
            batch = to_device(pad_batch([sequences[i] for i in indices], self.pad_id))
            vectors[indices] = embed(model, batch, self.pooling).float().cpu()
        return vectors

    def pooling_dimension(self, model) -> int:
        return model.config.d_model * len(self.pooling.modes)

    def score(self, model, examples: list, to_device) -> dict:
        queries = self._vectors(model, [q for q, _ in examples], to_device)
        documents = self._vectors(model, [d for _, d in examples], to_device)
        similarity = queries @ documents.T  # (N, N) cosine
        loss = F.cross_entropy(similarity * self.settings.scale, torch.arange(len(examples))).item()
        return {"loss": loss, **metrics.paired_retrieval_scores(similarity)}

    def checkpoint_config(self) -> dict:
        return super().checkpoint_config() | {"embedding": self.pooling.to_dict()}


OBJECTIVES = {
    "classification": SequenceClassification,
    "multilabel": SequenceClassification,
    "tagging": TokenClassification,
    "retrieval": Retrieval,
}


def task_objective(
    task: TaskData, tokenizer, pretrained, settings: TaskSettings, pooling: Pooling | None = None
):
    """The objective of a task's kind; pretrained: the model whose encoder starts the run (None:
    from scratch); pooling: a retrieval model's stored pooling (a sentence-transformers folder's)."""
    if task.kind == "retrieval":
        return Retrieval(task, tokenizer, pretrained, settings, pooling)
    return OBJECTIVES[task.kind](task, tokenizer, pretrained, settings)
