"""Task heads in Hugging Face folders: which head a folder holds (its `architectures`), the labels
(`id2label`), `problem_type` and `classifier_dropout`, read into ModelConfig fields and written back
as transformers writes them for its *ForSequenceClassification / *ForTokenClassification classes."""

from __future__ import annotations

from torch import Tensor

from flashformer.model.config import ModelConfig

CLASS_SUFFIXES = {
    "sequence-classification": "ForSequenceClassification",
    "token-classification": "ForTokenClassification",
}


def task_from_hf(hf: dict, weights: dict[str, Tensor], class_prefix: str, head_weight: str) -> dict:
    """The ModelConfig fields of the task head in a config.json ({} when the weights hold none).

    class_prefix: the family's class names' start ("Bert"); head_weight: the classifier's
    weight in the file, (num_labels, d_model), whose rows say how many labels there are."""
    if head_weight not in weights:
        return {}
    architectures = hf.get("architectures") or []
    tasks = [task for task, suffix in CLASS_SUFFIXES.items() if f"{class_prefix}{suffix}" in architectures]
    if len(tasks) != 1:
        supported = [f"{class_prefix}{suffix}" for suffix in CLASS_SUFFIXES.values()]
        raise ValueError(
            f"config.json: the weights hold a classifier ({head_weight}) but architectures={architectures!r} "
            f"names none of the heads flashformer has: {supported}"
        )
    num_labels = weights[head_weight].shape[0]
    id2label = hf.get("id2label") or {}
    labels = None
    if id2label:
        labels = [id2label.get(str(i), id2label.get(i)) for i in range(num_labels)]
        if len(id2label) != num_labels or None in labels:
            raise ValueError(
                f"config.json: id2label must name labels 0 .. {num_labels - 1} (the classifier has "
                f"{num_labels} rows); got {id2label!r}"
            )
    return {
        "task": tasks[0],
        "num_labels": num_labels,
        "labels": labels,
        "problem_type": hf.get("problem_type"),
        "classifier_dropout": hf.get("classifier_dropout"),
    }


def label_names(config: ModelConfig) -> list[str]:
    """The label names in id order; transformers' LABEL_0, LABEL_1, ... where none are given."""
    return list(config.labels) if config.labels else [f"LABEL_{i}" for i in range(config.num_labels)]


def task_to_hf(config: ModelConfig, class_prefix: str) -> dict:
    """The config.json entries of the task head ({} without one)."""
    if config.task is None:
        return {}
    if config.task == "sequence-classification" and config.classifier_pooling != "pooler":
        raise ValueError(
            f"ModelConfig.classifier_pooling={config.classifier_pooling!r} cannot be saved as a Hugging Face "
            f"{class_prefix}ForSequenceClassification, which classifies the pooler's output (it needs 'pooler')"
        )
    labels = label_names(config)
    return {
        "architectures": [f"{class_prefix}{CLASS_SUFFIXES[config.task]}"],
        "id2label": {str(i): label for i, label in enumerate(labels)},
        "label2id": {label: i for i, label in enumerate(labels)},
        "problem_type": config.problem_type,
        "classifier_dropout": config.classifier_dropout,
    }
