"""The sampling module's score changes against independent references: transformers' logits
processors where they exist (top-k, min-p, the repetition penalty, sequence bias, generate()
itself), a float64 numpy formula for OpenAI's presence and frequency penalties and logit_bias,
and a step-by-step reference loop over full forwards for generate() with them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import VOCAB, hf_generate, prompts
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TypicalLogitsWarper,
)

from flashformer.generate.sampling import (
    GenerationSettings,
    LogitsProcessor,
    TokenHistory,
    filter_min_p,
    first_argmax,
    penalize_presence_and_frequency,
    penalize_repetition,
)
from flashformer.generate.sampling_options import filter_typical


def scores_and_tokens(seed=0):
    torch.manual_seed(seed)
    scores = torch.randn(3, VOCAB) * 3  # (B, V)
    prompt = torch.randint(0, VOCAB, (3, 6))
    generated = torch.randint(0, VOCAB, (3, 9))  # repeats: counts above 1
    return scores, prompt, generated


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("min_keep", [1, 3])
def test_min_p_filter_equals_transformers(min_p, min_keep):
    scores, _, _ = scores_and_tokens()
    expected = MinPLogitsWarper(min_p, min_tokens_to_keep=min_keep)(None, scores)
    assert torch.equal(filter_min_p(scores, min_p, min_keep), expected)


@pytest.mark.parametrize("penalty", [0.7, 1.3])
def test_repetition_penalty_over_prompt_and_output_equals_transformers(penalty):
    scores, prompt, generated = scores_and_tokens()
    history = TokenHistory(prompt, None, VOCAB)
    for step in generated.T:
        history.add(step)
    expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.cat([prompt, generated], 1), scores)
    assert torch.allclose(penalize_repetition(scores, history.seen, penalty), expected, atol=1e-6)


def test_presence_and_frequency_penalties_equal_openais_formula():
    """OpenAI's rule: logit[j] -= count[j] * frequency + (count[j] > 0) * presence, counts over the
    generated tokens only (a token seen only in the prompt is not penalized)."""
    scores, prompt, generated = scores_and_tokens()
    history = TokenHistory(prompt, None, VOCAB)
    for step in generated.T:
        history.add(step)
    counts = np.zeros((3, VOCAB))
    for row, tokens in enumerate(generated.tolist()):
        for token in tokens:
            counts[row, token] += 1
    expected = scores.double().numpy() - counts * 0.6 - (counts > 0) * 1.5
    got = penalize_presence_and_frequency(scores, history.counts, 1.5, 0.6)
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-5)


def test_the_processor_applies_bias_then_penalties_then_min_length():
    """logit_bias is added before the repetition penalty (vLLM's order), the min-length mask last."""
    scores, prompt, generated = scores_and_tokens()
    history = TokenHistory(prompt, None, VOCAB)
    history.add(generated[:, 0])
    s = GenerationSettings(
        logit_bias={4: 5.0, 9: -100.0},
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        min_new_tokens=2,
        eos_token_id=[7],
    )
    got = LogitsProcessor(s, "cpu")(scores, history, 1).double().numpy()
    x = scores.double().numpy().copy()
    x[:, 4] += 5.0
    x[:, 9] -= 100.0
    seen = history.seen.numpy()
    x = np.where(seen, np.where(x < 0, x * 1.2, x / 1.2), x)
    counts = history.counts.numpy()
    x = x - counts * -0.25 - (counts > 0) * 0.5
    x[:, 7] = -np.inf
    np.testing.assert_allclose(got, x, atol=1e-5)


def test_top_k_as_the_processor_applies_it_equals_transformers():
    scores, _, _ = scores_and_tokens()
    s = GenerationSettings(do_sample=True, top_k=7)
    assert torch.equal(LogitsProcessor(s, "cpu")(scores, None, 0), TopKLogitsWarper(7)(None, scores))


@pytest.mark.parametrize("typical_p", [0.05, 0.4, 0.9, 0.999])
@pytest.mark.parametrize("min_keep", [1, 3])
def test_typical_filter_equals_transformers(typical_p, min_keep):
    """Random logits, one row already cut by a filter before it (-inf scores): the same kept
    tokens as transformers' TypicalLogitsWarper, bit for bit."""
    scores, _, _ = scores_and_tokens()
    scores[1, :20] = -math.inf
    expected = TypicalLogitsWarper(typical_p, min_tokens_to_keep=min_keep)(None, scores)
    assert torch.equal(filter_typical(scores, typical_p, min_keep), expected)
    s = GenerationSettings(do_sample=True, typical_p=typical_p)
    assert torch.equal(LogitsProcessor(s, "cpu", min_keep)(scores, None, 0), expected)


# ---- generate() with the new settings ----


@pytest.mark.parametrize(
    "settings",
    [
        {"do_sample": True, "temperature": 0.8, "min_p": 0.1},
        {"do_sample": True, "top_k": 5, "min_p": 0.2, "repetition_penalty": 1.2},
        {"sequence_bias": {(5,): 4.0, (11,): -3.0}},
        {"do_sample": True, "top_k": 0, "typical_p": 0.5},
        {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "typical_p": 0.8},
    ],
    ids=["min_p", "top_k_min_p_repetition", "bias", "typical_p", "top_k_top_p_typical_p"],
)
def test_generate_equals_transformers(decoder_pair, settings):
    """transformers has min-p and a per-token bias (sequence_bias of one-token sequences: our
    logit_bias); both draw from the global generator under the same seed."""
    family, theirs, ours = decoder_pair
    ids = prompts()
    mine = dict(settings)
    if "sequence_bias" in mine:
        mine["logit_bias"] = {key[0]: value for key, value in mine.pop("sequence_bias").items()}
    torch.manual_seed(5)
    expected = hf_generate(theirs, ids, max_new_tokens=10, **settings)
    torch.manual_seed(5)
    got = ours.generate(ids, max_new_tokens=10, **mine)
    assert got.tolist() == expected.tolist()


def reference_loop(model, ids, steps, bias, presence, frequency, repetition, sample_seed=None):
    """Greedy or seeded tokens, each step from a full forward (no cache) and numpy's formulas."""
    rows = ids.tolist()
    generator = None if sample_seed is None else torch.Generator().manual_seed(sample_seed)
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor(rows)).logits[:, -1].double().numpy()  # (B, V)
        for r, row in enumerate(rows):
            x = logits[r].copy()
            for token, value in bias.items():
                x[token] += value
            seen = np.zeros(VOCAB, dtype=bool)
            seen[row] = True
            x = np.where(seen, np.where(x < 0, x * repetition, x / repetition), x)
            counts = np.bincount(row[ids.shape[1] :], minlength=VOCAB)
            x = x - counts * frequency - (counts > 0) * presence
            if generator is None:
                token = int(np.argmax(x))
            else:
                probs = torch.from_numpy(x).float().softmax(-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            row.append(token)
    return rows


@pytest.mark.parametrize("sample_seed", [None, 3], ids=["greedy", "seeded"])
def test_generate_with_openai_penalties_equals_a_reference_loop(decoder_pair, sample_seed):
    family, _, ours = decoder_pair
    ids = prompts(batch=1)
    bias, presence, frequency, repetition = {3: 2.0, 8: -1.0}, 0.7, 0.9, 1.1
    expected = reference_loop(ours, ids, 10, bias, presence, frequency, repetition, sample_seed)
    got = ours.generate(
        ids,
        max_new_tokens=10,
        do_sample=sample_seed is not None,
        seed=sample_seed,
        logit_bias=bias,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        eos_token_id=[],
    )
    assert got.tolist() == expected


def test_ignore_eos_keeps_generating_past_eos(decoder_pair):
    family, _, ours = decoder_pair
    ids = prompts(batch=1)
    free = ours.generate(ids, max_new_tokens=8, eos_token_id=[])
    first = int(free[0, ids.shape[1]])
    assert ours.generate(ids, max_new_tokens=8, eos_token_id=[first]).shape[1] == ids.shape[1] + 1
    kept = ours.generate(ids, max_new_tokens=8, eos_token_id=[first], ignore_eos=True)
    assert kept.tolist() == free.tolist()


BAD = [
    (dict(min_p=1.5), "min_p"),
    (dict(typical_p=0.0), "typical_p"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(logit_bias={VOCAB: 1.0}), "logit_bias"),
    (dict(logit_bias={3: 101}), r"logit_bias\[3\]"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
]


@pytest.mark.parametrize("changes,named", BAD, ids=[named for _, named in BAD])
def test_bad_settings_are_refused_by_name(decoder_pair, changes, named):
    family, _, ours = decoder_pair
    with pytest.raises(ValueError, match=named):
        ours.generate(prompts(batch=1), max_new_tokens=2, **changes)


@pytest.mark.parametrize("vocab", [7, 1024, 1500, 50257, 262144])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_argmax_equals_torchs_argmax_ties_nans_and_infinities(vocab, dtype):
    """The chunked argmax gives torch.argmax's index in every case that decides between equals:
    ties (scores from a handful of values, so the maximum repeats across chunks and inside one,
    and the tail), NaNs (the first wins, wherever it is), infinities, whole rows of -inf, and a
    row view that is not contiguous; one row alone too. float32 scores go to numpy's argmax,
    bfloat16 ones to the chunked passes."""
    generator = torch.Generator().manual_seed(vocab)
    rows = torch.randint(0, 4, (12, vocab), generator=generator).to(dtype)  # (B, V), many ties
    rows[1] = torch.randn(vocab, generator=generator).to(dtype)  # no tie
    rows[2, -1] = 9  # the maximum in the tail alone
    rows[3, vocab // 2] = float("nan")
    rows[4, -1] = float("nan")  # a NaN in the tail only
    rows[5, 0] = rows[5, -1] = float("nan")
    rows[6] = float("-inf")
    rows[7, vocab // 3] = float("inf")
    rows[7, -1] = float("inf")
    rows[8, -1] = 3  # ties the body's maximum: the body's first index wins
    for scores in (rows, rows[:, : vocab - 1] if vocab > 1 else rows, torch.cat([rows, rows], 1)[:, ::2]):
        assert torch.equal(first_argmax(scores), scores.argmax(dim=-1)), scores.shape
        for row in scores.split(1):  # (1, V)
            assert torch.equal(first_argmax(row), row.argmax(dim=-1)), row
