"""Perplexity of a real model (SmolLM2-135M-Instruct from its GGUF file) against
transformers' sliding-window rule on its own GGUF load."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers.gguf import smollm2_model, smollm2_tokenizer, transformers_smollm2_model

from flashformer.eval.perplexity import perplexity, windows


def test_windows_score_every_token_once():
    for length, context, stride in [(10, 4, 2), (10, 4, 4), (9, 5, 3), (3, 8, 2), (1, 4, 2)]:
        scored = [t for _, end, first in windows(length, context, stride) for t in range(first, end)]
        assert scored == list(range(1, length))
        for begin, end, first in windows(length, context, stride):
            assert end - begin <= context and begin <= first


def transformers_perplexity(model, ids: list[int], context: int, stride: int) -> tuple[float, int]:
    """transformers' perplexity guide, written from its text: windows of `context` tokens, `stride`
    apart, labels -100 before the window's new targets, the loss times the targets scored."""
    input_ids = torch.tensor([ids])
    nll, count, previous_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        target_len = end - previous_end
        window = input_ids[:, begin:end]
        labels = window.clone()
        labels[:, :-target_len] = -100
        with torch.no_grad():
            logits = model(window).logits
        scored = (labels[:, 1:] != -100).sum().item()
        loss = F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")
        nll, count = nll + loss.item(), count + scored
        previous_end = end
        if end == len(ids):
            break
    return nll, count


def test_perplexity_equals_transformers():
    import inspect

    tokenizer = smollm2_tokenizer()
    text = inspect.getsource(json)
    ids = tokenizer.encode(text)[:300]
    text = tokenizer.decode(ids)
    ids = tokenizer.encode(text)
    ours = perplexity(smollm2_model(), tokenizer, [text], context=128, stride=48)
    nll, count = transformers_perplexity(transformers_smollm2_model(), ids, 128, 48)
    assert ours.tokens == count == len(ids) - 1
    assert abs(ours.nll - nll) <= 1e-4 * nll
    assert 1 < ours.perplexity < 100
    assert ours.bits_per_byte == pytest.approx(ours.nll / math.log(2) / len(text.encode()), rel=1e-12)


def test_perplexity_checks_its_arguments():
    model, tokenizer = smollm2_model(), smollm2_tokenizer()
    with pytest.raises(ValueError, match="stride must be an int in \\[1, context=64\\]"):
        perplexity(model, tokenizer, ["x y z"], context=64, stride=65)
    with pytest.raises(ValueError, match="context must be"):
        perplexity(model, tokenizer, ["x y z"], context=1)
    with pytest.raises(ValueError, match="texts is empty"):
        perplexity(model, tokenizer, [])
