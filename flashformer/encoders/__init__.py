"""Fine-tuning tasks for encoders: datasets (users' JSON lines, and three default tasks built
from Python's standard library) and the metrics that judge them. The names below are imported at
their first use (flashformer.startup): serving an encoder's embeddings imports this room, and
need not import the trainer the default tasks read their corpus with."""

from typing import TYPE_CHECKING

from flashformer.startup import lazy_exports

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

lazy_exports(
    __name__,
    {
        **dict.fromkeys(
            (
                "PairExample",
                "TaggedExample",
                "TaskData",
                "TextExample",
                "read_pair_examples",
                "read_tagged_examples",
                "read_task",
                "read_text_examples",
            ),
            "flashformer.encoders.datasets",
        ),
        **dict.fromkeys(
            ("DEFAULT_TASKS", "stdlib_classification", "stdlib_retrieval", "stdlib_tagging"),
            "flashformer.encoders.stdlib_tasks",
        ),
    },
)

if TYPE_CHECKING:  # the same names, for type checkers, editors and the room order's test
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
