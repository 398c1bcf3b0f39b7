"""The task heads an encoder can carry (ModelConfig.task), with transformers' outputs and losses.

    sequence classification   pooled state -> dropout -> linear: (B, L, d) -> (B, num_labels)
    token classification      dropout -> linear on every token: (B, L, d) -> (B, L, num_labels)

as transformers' BertForSequenceClassification / BertForTokenClassification compute them (their
`classifier` is our `task_head.classifier`), and the same losses:

    single_label_classification   cross-entropy; labels (B,) integer ids
    multi_label_classification    binary cross-entropy with logits; labels (B, num_labels) of 0/1 floats
    regression                    mean squared error; labels (B,) or (B, num_labels) floats
    token classification          cross-entropy over tokens whose label is not -100; labels (B, L)

With ModelConfig.problem_type None the kind is inferred from the labels as transformers does:
one label is regression, integer labels single-label, float labels multi-label.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashformer.config import ModelConfig
from flashformer.inputs import IGNORE_INDEX, check_int_tensor
from flashformer.kernels.cpu import Linear
from flashformer.pooling import pool


class SequenceClassificationHead(nn.Module):
    """A vector per sequence (config.classifier_pooling), dropout, then one linear layer."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_labels, self.problem_type = config.num_labels, config.problem_type
        self.pooling = config.classifier_pooling
        dropout = config.dropout if config.classifier_dropout is None else config.classifier_dropout
        self.dropout = nn.Dropout(dropout)
        self.classifier = Linear(config.d_model, config.num_labels)

    def forward(
        self, hidden: Tensor, pooled: Tensor | None, padding_mask: Tensor | None, labels: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """hidden (B, L, d); pooled (B, d), the model's pooler output (pooling "pooler");
        padding_mask (B, L) bool or None -> (logits (B, num_labels), loss or None)."""
        vector = pooled if self.pooling == "pooler" else pool(hidden, padding_mask, self.pooling)  # (B, d)
        logits = self.classifier(self.dropout(vector))  # (B, num_labels)
        if labels is None:
            return logits, None
        return logits, sequence_classification_loss(logits, labels, self.problem_type)


class TokenClassificationHead(nn.Module):
    """Dropout, then one linear layer on every token's hidden state."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_labels = config.num_labels
        dropout = config.dropout if config.classifier_dropout is None else config.classifier_dropout
        self.dropout = nn.Dropout(dropout)
        self.classifier = Linear(config.d_model, config.num_labels)

    def forward(
        self, hidden: Tensor, pooled: Tensor | None, padding_mask: Tensor | None, labels: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """hidden (B, L, d) -> (logits (B, L, num_labels), loss or None); labels (B, L), -100 = not scored."""
        logits = self.classifier(self.dropout(hidden))  # (B, L, num_labels)
        if labels is None:
            return logits, None
        return logits, token_classification_loss(logits, labels)


def make_task_head(config: ModelConfig) -> nn.Module | None:
    """The head of config.task, or None without a task."""
    if config.task is None:
        return None
    head = SequenceClassificationHead if config.task == "sequence-classification" else TokenClassificationHead
    return head(config)


# ---- losses ----


def problem_type_of(labels: Tensor, num_labels: int, problem_type: str | None) -> str:
    """problem_type, or the one transformers infers when it is None."""
    if problem_type is not None:
        return problem_type
    if num_labels == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def sequence_classification_loss(logits: Tensor, labels: Tensor, problem_type: str | None) -> Tensor:
    """transformers' loss of a sequence classifier; logits (B, num_labels) -> a float32 scalar."""
    if not isinstance(labels, Tensor):
        raise ValueError(f"labels must be a torch.Tensor; got {type(labels).__name__}")
    batch, num_labels = logits.shape
    kind = problem_type_of(labels, num_labels, problem_type)
    if kind == "single_label_classification":
        if labels.dtype.is_floating_point or labels.dtype in (torch.bool, torch.complex64, torch.complex128):
            raise ValueError(f"single-label classification needs integer label ids; got dtype {labels.dtype}")
        if tuple(labels.shape) != (batch,):
            raise ValueError(
                f"labels must have shape ({batch},): one label id per sequence; got {tuple(labels.shape)}"
            )
        if not torch.compiler.is_compiling():
            bad = (labels < 0) | (labels >= num_labels)
            if bool(bad.any()):
                raise ValueError(f"labels must be in [0, num_labels={num_labels}); got {int(labels[bad][0])}")
        return F.cross_entropy(logits.float(), labels)
    if not labels.dtype.is_floating_point:
        raise ValueError(f"{kind} needs float labels; got dtype {labels.dtype}")
    if kind == "multi_label_classification":
        if tuple(labels.shape) != (batch, num_labels):
            raise ValueError(
                f"multi-label labels must have shape ({batch}, {num_labels}): a 0/1 target per label; "
                f"got {tuple(labels.shape)}"
            )
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
    # regression: transformers squeezes both sides when there is one output
    if num_labels == 1:
        if labels.numel() != batch:
            raise ValueError(
                f"regression labels must hold one value per sequence ({batch}); got {tuple(labels.shape)}"
            )
        return F.mse_loss(logits.float().squeeze(), labels.float().squeeze())
    if tuple(labels.shape) != (batch, num_labels):
        raise ValueError(
            f"regression labels must have shape ({batch}, {num_labels}); got {tuple(labels.shape)}"
        )
    return F.mse_loss(logits.float(), labels.float())


def token_classification_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy over the tokens whose label is not -100; logits (B, L, num_labels)."""
    check_int_tensor("labels", labels, "label ids")
    batch, length, num_labels = logits.shape
    if tuple(labels.shape) != (batch, length):
        raise ValueError(
            f"labels must have shape ({batch}, {length}): one label per token; got {tuple(labels.shape)}"
        )
    if not torch.compiler.is_compiling():
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= num_labels))
        if bool(bad.any()):
            raise ValueError(
                f"labels must be in [0, num_labels={num_labels}) or {IGNORE_INDEX} (not scored); "
                f"got {int(labels[bad][0])}"
            )
    return F.cross_entropy(
        logits.reshape(-1, num_labels).float(), labels.reshape(-1), ignore_index=IGNORE_INDEX
    )
