"""The server's paged steps (serve.runner) for a model whose layers differ (Gemma 3's shape:
sliding-window layers beside full ones, softcaps): the separate prompt and decode steps and
the packed step must give the logits of a full forward pass without a cache, for two
sequences at once, past the window."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.sliding import sliding_model

from flashformer.serve.paged_cache import BlockPool
from flashformer.serve.runner import ModelRunner

BLOCK = 4


def sequences(pool: BlockPool, lengths: list[int], total: int) -> list[SimpleNamespace]:
    rows = torch.randint(0, 300, (len(lengths), total), generator=torch.Generator().manual_seed(3)).tolist()
    return [
        SimpleNamespace(
            tokens=row[:length], full=row, blocks=pool.allocate(pool.blocks_for(total)), computed=0
        )
        for row, length in zip(rows, lengths)
    ]


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]  # (vocab,)


def test_separate_and_packed_steps_equal_full_forwards():
    model = sliding_model()
    for packed in (False, True):
        pool = BlockPool(num_blocks=16, block_size=BLOCK)
        runner = ModelRunner(model, pool, max_batch=4, context=24)
        seqs = sequences(pool, [9, 6], 20)
        with torch.no_grad():
            if packed:
                ready, logits = runner.packed([(s, 0, len(s.tokens)) for s in seqs])
                got = [logits[first] for _, first, _ in ready]
            else:
                got = [runner.prefill(s, 0, len(s.tokens)) for s in seqs]
            for _ in range(8):
                for s, logits in zip(seqs, got):
                    torch.testing.assert_close(logits, full_logits(model, s.tokens), atol=1e-5, rtol=0)
                    s.tokens.append(s.full[len(s.tokens)])
                if packed:
                    ready, logits = runner.packed([(s, s.computed, len(s.tokens)) for s in seqs])
                    got = [logits[first] for _, first, _ in ready]
                else:
                    got = list(runner.decode(seqs))


def test_a_model_with_attention_sinks_is_refused_when_its_caches_are_made():
    """gpt-oss's sinks are a term paged attention lacks: the server refuses such a model when it
    starts (its caches are made), naming the field, instead of failing at the first step."""
    model = sliding_model(attention_sinks=True)
    with pytest.raises(ValueError, match=r"no sink term .* attention_sinks=True \(gpt-oss\)"):
        ModelRunner(model, BlockPool(num_blocks=16, block_size=BLOCK), max_batch=4, context=24)
