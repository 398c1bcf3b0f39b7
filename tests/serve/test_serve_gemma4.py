"""The server and Gemma 4: its paged KV cache has one block shape and each layer's own keys and
values, so a model with KV-shared layers and wider full-layer heads is refused when the runner
starts, by name, never at a request's first step (tests/helpers/gemma4.py: the tiny model)."""

from __future__ import annotations

import pytest
from helpers.gemma4 import tiny_gemma4

import flashformer
from flashformer.serve.paged_cache import BlockPool
from flashformer.serve.runner import ModelRunner


def test_the_runner_refuses_gemma4_naming_what_paged_attention_lacks(tmp_path):
    tiny_gemma4().save_pretrained(tmp_path)
    model = flashformer.from_pretrained(tmp_path).eval()
    with pytest.raises(ValueError, match=r"kv_shared_layers=2 and global_head_dim=512 beside head_dim=32"):
        ModelRunner(model, BlockPool(num_blocks=16, block_size=16), max_batch=2, context=32)
