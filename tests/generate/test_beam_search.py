"""Beam search against transformers' generate (GPT-2, LLaMA with GQA, T5):
the same beams, scores, stopping rules and filler, on models with every
parameter perturbed (see conftest's pair fixtures)."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_tokens, decoder_prompt_len, eos_of, hf_generate, prompts

BEAM_SETTINGS = [
    {"num_beams": 3},
    {"num_beams": 4, "length_penalty": 0.5, "early_stopping": True},
    {"num_beams": 2, "length_penalty": 1.5, "early_stopping": "never"},
    {"num_beams": 3, "eos_token_id": [5, 11, 23], "repetition_penalty": 1.2, "min_new_tokens": 2},
]


@pytest.mark.parametrize("settings", BEAM_SETTINGS, ids=["plain", "early", "never", "eos-list-penalty"])
def test_beam_search_equals_transformers(pair, settings):
    family, theirs, ours = pair
    ids = prompts()
    expected = hf_generate(theirs, ids, max_new_tokens=12, **settings)
    got = ours.generate(ids, max_new_tokens=12, **settings)
    eos = settings.get("eos_token_id", [eos_of(family)])
    assert_same_tokens(got, expected, eos, decoder_prompt_len(family, ids))


def test_beam_search_rows_that_end_early_equal_transformers(pair):
    """Rows whose best hypothesis ends before max_new_tokens: the
    finished-hypothesis bookkeeping and the filler are exercised."""
    family, theirs, ours = pair
    ids = prompts()
    prompt_len = decoder_prompt_len(family, ids)
    # length_penalty=0 scores a hypothesis by its summed log-probability, which favours short ones
    settings = dict(max_new_tokens=12, num_beams=3, length_penalty=0.0, early_stopping=True)
    free = ours.generate(ids, eos_token_id=[], **settings)
    eos = sorted({int(free[row, prompt_len + 1 + row]) for row in range(3)})  # tokens the beams do produce
    expected = hf_generate(theirs, ids, eos_token_id=eos, **settings)
    got = ours.generate(ids, eos_token_id=eos, **settings)
    assert_same_tokens(got, expected, eos, prompt_len)
    ended = torch.isin(expected[:, prompt_len:], torch.tensor(eos))  # (B, generated)
    ends = [row.nonzero()[0].item() + 1 if row.any() else 12 for row in ended]
    assert min(ends) < 12, "no row ended early: the test is idle"
