"""Fine-tuning tasks for encoders: datasets (users' JSON lines, and three default tasks built
from Python's standard library) and the metrics that judge them."""

from flashformer.encoders.datasets import (
    PairExample,
    TaggedExample,
    TaskData,
    TextExample,
    read_pair_examples,
    read_tagged_examples,
    read_task,
    read_text_examples,
)
from flashformer.encoders.stdlib_tasks import (
    DEFAULT_TASKS,
    stdlib_classification,
    stdlib_retrieval,
    stdlib_tagging,
)

__all__ = [
    "DEFAULT_TASKS",
    "PairExample",
    "TaggedExample",
    "TaskData",
    "TextExample",
    "read_pair_examples",
    "read_tagged_examples",
    "read_task",
    "read_text_examples",
    "stdlib_classification",
    "stdlib_retrieval",
    "stdlib_tagging",
]
