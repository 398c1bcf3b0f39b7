"""flashformer: the Transformer, exact, IO-aware and measured.

The package is a house of rooms, each importing only the rooms before it (docs/architecture.md):
kernels, attention, text, generate, model, checkpoints, train, encoders, eval, serve, costs,
viz, bench, cli. This module re-exports the entry points most code needs, each imported at its
first use (flashformer.startup): `import flashformer` costs no torch until one is read.
"""

import importlib
import os
from typing import TYPE_CHECKING

from flashformer.startup import lazy_exports

__version__ = "0.1.0"
__all__ = [
    "attention",
    "add_task_head",
    "build",
    "from_pretrained",
    "load",
    "load_tokenizer",
    "preset",
    "ModelConfig",
    "ModelOutput",
    "EncoderModel",
    "DecoderModel",
    "EncoderDecoderModel",
]

lazy_exports(
    __name__,
    {
        "attention": "flashformer.attention.api",
        "from_pretrained": "flashformer.checkpoints.loading",
        "load": "flashformer.checkpoints.loading",
        "load_tokenizer": "flashformer.checkpoints.loading",
        "ModelConfig": "flashformer.model.config",
        "preset": "flashformer.model.presets",
        **dict.fromkeys(
            ("DecoderModel", "EncoderDecoderModel", "EncoderModel", "ModelOutput", "add_task_head", "build"),
            "flashformer.model.models",
        ),
    },
)

# FLASHFORMER_CPU_ISA moves PyTorch's own kernels too (kernels.machine.follow_isa_request): ATen
# reads its variable once, at its first operation, and none has run while flashformer is being
# imported. Unset, there is nothing to set, and no torch is imported for it.
if os.environ.get("FLASHFORMER_CPU_ISA", "").strip():
    importlib.import_module("flashformer.kernels.machine").follow_isa_request()

if TYPE_CHECKING:  # the same names, for type checkers, editors and the room order's test
    from flashformer.attention.api import attention
    from flashformer.checkpoints.loading import from_pretrained, load, load_tokenizer
    from flashformer.model.config import ModelConfig
    from flashformer.model.models import (
        DecoderModel,
        EncoderDecoderModel,
        EncoderModel,
        ModelOutput,
        add_task_head,
        build,
    )
    from flashformer.model.presets import preset
