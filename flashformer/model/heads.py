"""The heads that sit on a model's last hidden state: BERT's [CLS] pooler and masked-LM head,
the pooling of one vector per sequence, and the task heads an encoder can carry.

Pooling: one vector per sequence over the real tokens only,

    vectors = pool(hidden, attention_mask, "mean")         # (B, L, d) -> (B, d)

in sentence-transformers' modes (its Pooling module): "cls" the first token's state, "mean" the
mean of the real tokens, "max" their elementwise maximum, "mean_sqrt_len" their sum divided by
the square root of their number. A sequence classifier and the sentence embeddings
(encoders.sentence_embeddings) both pool here.

Task heads (ModelConfig.task), with transformers' outputs and losses:

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

from flashformer.checks import IGNORE_INDEX, check_int_tensor
from flashformer.kernels.cpu import Linear, linear
from flashformer.model.config import ModelConfig
from flashformer.model.feed_forward import ACTIVATIONS
from flashformer.model.layers import make_norm

# ---- BERT's pooler and masked-LM head ----


class Pooler(nn.Module):
    """tanh(dense(h[:, 0])): BERT's sentence vector from the [CLS] token."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense = Linear(config.d_model, config.d_model)

    def forward(self, hidden: Tensor) -> Tensor:  # (B, L, d_model) -> (B, d_model)
        return torch.tanh(self.dense(hidden[:, 0]))


class MaskedLMHead(nn.Module):
    """BERT's masked-LM head: dense, activation, norm, then the (usually tied)
    output projection plus a per-token bias."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense = Linear(config.d_model, config.d_model)
        self.act = ACTIVATIONS[config.activation]()
        self.norm = make_norm(config)
        self.decoder = (
            None if config.tie_word_embeddings else Linear(config.d_model, config.vocab_size, bias=False)
        )
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden: Tensor, token_embedding: Tensor) -> Tensor:  # (B, L, d) -> (B, L, vocab)
        weight = token_embedding if self.decoder is None else self.decoder.weight
        return linear(self.norm(self.act(self.dense(hidden))), weight, self.bias)


# ---- one vector per sequence ----

POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len")


def check_pooling_mode(mode: str, name: str = "pooling") -> str:
    if mode not in POOLING_MODES:
        raise ValueError(f"{name} must be one of {POOLING_MODES}; got {mode!r}")
    return mode


def pool(hidden: Tensor, attention_mask: Tensor | None, mode: str) -> Tensor:
    """hidden (B, L, d), attention_mask (B, L) with 1/True on real tokens (None: all real) -> (B, d).

    Padded positions take no part; a row without a real token pools to zeros (mean) rather
    than NaN. Sums run in float32 whatever the hidden states' dtype."""
    check_pooling_mode(mode)
    if mode == "cls":
        return hidden[:, 0]
    if attention_mask is None:
        attention_mask = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
    real = attention_mask.to(torch.bool)[..., None]  # (B, L, 1)
    if mode == "max":
        # padding gets the dtype's lowest value, as sentence-transformers does (-1e9 there)
        lowest = torch.finfo(hidden.dtype).min
        return hidden.masked_fill(~real, lowest).max(dim=1).values
    total = (hidden.float() * real).sum(dim=1)  # (B, d)
    count = real.sum(dim=1).float().clamp(min=1.0)  # (B, 1)
    scale = count if mode == "mean" else count.sqrt()
    return (total / scale).to(hidden.dtype)


# ---- task heads ----


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
