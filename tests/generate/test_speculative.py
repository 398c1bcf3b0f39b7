"""Speculative decoding (generate/speculative.py): prompt lookup and a draft model.

Greedy must give plain greedy's tokens, and the verify forward's rows the bits of single-token
steps on the native decoder (float32 and quantized); sampling must follow the target's
distribution (a chi-square test against the exact probabilities of a tiny model); the cache a
chat keeps afterwards must hold only the tokens said; bad settings name the argument.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import VOCAB, perturbed, prompts
from helpers.gguf import smollm2_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

import flashformer
from flashformer.checkpoints.gguf.packaged_models import smollm2_path
from flashformer.generate import speculative
from flashformer.generate.chat import Chat
from flashformer.generate.constraints import Constraint
from flashformer.generate.draft_model import DraftModel
from flashformer.generate.prompt_lookup import PromptLookup
from flashformer.generate.sampling import TokenHistory, settings_from
from flashformer.generate.session import DecoderSession

# a prompt that repeats itself: the lookup finds its n-grams, the drafts get kept
REPEATING = torch.tensor([[5, 9, 14, 3, 22, 7, 5, 9, 14, 3, 22, 7, 5, 9, 14]])


def run_counting(model, ids, **kwargs):
    """The new tokens of a speculative run (1, n) and its counters. The costs the draft length
    weighs are fixed here (typical of this CPU), not timed: the counts do not depend on the load."""
    speculative._ROW_COSTS[model] = {"PromptLookup": 0.25, "DraftModel": 0.25}
    s = settings_from(model, **kwargs)
    session = DecoderSession(model, ids, None, s)
    history = TokenHistory.for_settings(s, ids, None, model.config.vocab_size)
    counters = speculative.Counters()
    tokens = list(speculative.speculative_tokens(session, s, history, None, counters=counters))
    return torch.stack(tokens, dim=1), counters


def test_prompt_lookup_drafts_what_followed_the_latest_match():
    lookup = PromptLookup([1, 2, 3, 9, 1, 2, 4, 7, 8, 1, 2], max_ngram=2)
    assert lookup.propose(3) == [4, 7, 8]  # (1, 2) last seen at 4, followed by 4 7 8
    lookup.extend([5])
    assert lookup.propose(3) == []  # neither (2, 5) nor (5,) occurred before
    lookup.extend([9])
    assert lookup.propose(2) == [1, 2]  # no (5, 9); (9,) at 3, followed by 1 2
    assert PromptLookup([4, 4, 4], max_ngram=3).propose(5) == [4]  # (4, 4) at 0


def test_a_match_is_the_agreeing_run_before_the_drafts_source():
    lookup = PromptLookup([], max_ngram=3)
    line = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    assert lookup.match([5, 6, 20]) == 0  # 20 occurred nowhere before
    assert lookup.match([5, 6, 20, 7, 8, 20]) == 1  # (8, 20) no; (20,) at 2: preceded by 6, not 8
    copied = [1] + line + [2] + line[:9]  # the line again, up to its last token
    lookup = PromptLookup([], max_ngram=3)
    assert lookup.match(copied) == 8  # counted back to LONGEST_MATCH, past the 3-gram found
    assert lookup.propose(2) == [29, 2]
    assert DraftModel.match(None, [1, 2]) == 1


def test_draft_length_counts_each_match_length_apart():
    speed = speculative.DraftLength(limit=8, cost=0.25)
    assert speed.next(match=0) == 0  # nothing to draft from
    first = speed.next(match=3)
    assert first >= 1  # one kept and one lost assumed: a draft pays at this cost
    for _ in range(20):
        speed.observe(4, 4, match=3)  # after matches of 3 every draft is kept
        speed.observe(1, 0, match=1)  # after matches of 1 none is
    assert speed.next(match=3) == 8
    assert [speed.next(match=1) for _ in range(speed.PROBE_EVERY)][-1] == 1  # only a probe
    assert speed.next(match=1) == 0


@pytest.mark.parametrize("native", [True, False])
def test_greedy_lookup_gives_plain_greedy_tokens(decoder_pair, native):
    _, _, model = decoder_pair
    for ids in (REPEATING, prompts(batch=1, length=9, seed=5)):
        plain = model.generate(ids, max_new_tokens=24, native=native)
        for n in (1, 3, 8):
            looked = model.generate(ids, max_new_tokens=24, native=native, prompt_lookup_num_tokens=n)
            assert torch.equal(looked, plain), f"prompt_lookup_num_tokens={n}"
    _, counters = run_counting(model, REPEATING, max_new_tokens=24, native=native, prompt_lookup_num_tokens=4)
    assert counters.drafted > 0 and counters.forwards < 23  # drafts were checked, several kept per forward


def test_greedy_with_a_draft_model_gives_plain_greedy_tokens(decoder_pair):
    _, _, model = decoder_pair
    draft = perturbed(copy.deepcopy(model), scale=0.05, seed=7)
    ids = prompts(batch=1, length=6, seed=11)
    plain = model.generate(ids, max_new_tokens=20)
    for k in (1, 4):
        assert torch.equal(
            model.generate(ids, max_new_tokens=20, assistant_model=draft, num_assistant_tokens=k), plain
        )
    _, counters = run_counting(model, ids, max_new_tokens=20, assistant_model=draft)
    assert counters.accepted > 0  # a near copy of the model drafts tokens it keeps


def test_eos_and_penalties_as_plain_decoding(decoder_pair):
    _, _, model = decoder_pair
    plain = model.generate(REPEATING, max_new_tokens=30, repetition_penalty=1.3, eos_token_id=[])
    eos = int(plain[0, REPEATING.shape[1] + 6])  # a token it says on the way: it must stop there
    kwargs = dict(max_new_tokens=30, repetition_penalty=1.3, eos_token_id=[eos])
    expected = model.generate(REPEATING, **kwargs)
    assert torch.equal(model.generate(REPEATING, prompt_lookup_num_tokens=5, **kwargs), expected)
    assert int(expected[0, -1]) == eos or expected.shape[1] == REPEATING.shape[1] + 30


@pytest.mark.parametrize("quantize", [None, "gguf"])
def test_verify_rows_have_the_bits_of_single_steps(quantize):
    """The native decoder computes each row alone: a 6-token verify forward's logits are the
    bits of 6 single-token steps (SmolLM2, float32 and its own Q4_1 weights)."""
    model, tokenizer = flashformer.load(smollm2_path(), quantize=quantize)
    ids = torch.tensor([tokenizer.encode("The cat sat on the mat. The cat sat on")])
    more = torch.tensor([[278, 3644, 30, 378, 2789, 314]])
    s = settings_from(model, max_new_tokens=8)
    stepped = DecoderSession(model, ids, None, s)
    stepped.prefill()
    rows = torch.stack([stepped.step(more[:, i]) for i in range(more.shape[1])], dim=1)  # (1, 6, V)
    verified = DecoderSession(model, ids, None, s)
    assert verified.native is not None
    verified.prefill()
    assert torch.equal(verified.extend(more), rows)


def test_quantized_lookup_and_a_constraint_give_plain_tokens():
    model, tokenizer = flashformer.load(smollm2_path(), quantize="gguf")
    ids = torch.tensor([tokenizer.encode("List: apple, pear, plum, apple, pear, plum, apple,")])
    plain = model.generate(ids, max_new_tokens=24, eos_token_id=[])
    assert torch.equal(
        model.generate(ids, max_new_tokens=24, eos_token_id=[], prompt_lookup_num_tokens=6), plain
    )
    constraint = Constraint.from_spec(
        {"regex": r"( (apple|pear|plum),){4}"}, smollm2_tokenizer(), model.config.vocab_size
    )
    kwargs = dict(max_new_tokens=24, constraint=constraint)
    constrained = model.generate(ids, **kwargs)
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=6, **kwargs), constrained)
    text = tokenizer.decode(constrained[0, ids.shape[1] :].tolist())
    assert text.count(",") == 4, text


def test_a_chat_cache_keeps_only_what_was_said():
    """A chat turn that stops mid-forward (a caller breaking off) leaves no unverified draft in the
    cache: the next turn's reuse of it gives the tokens a fresh chat gives."""
    model, tokenizer = flashformer.load(smollm2_path(), quantize="gguf")
    chat = Chat(model, tokenizer, do_sample=False, prompt_lookup_num_tokens=8, max_new_tokens=40)
    fresh = Chat(model, tokenizer, do_sample=False, max_new_tokens=40)
    question = "Repeat after me: the quick brown fox jumps over the lazy dog."
    for a, b in zip(chat.send(question), fresh.send(question)):
        assert a == b
    again = "And once more, please."
    speculative._ROW_COSTS.pop(model, None)  # timed again now, with the earlier turns in the cache
    assert "".join(chat.send(again)) == "".join(fresh.send(again))


# ---- sampling: the target's distribution ----

SMALL_VOCAB = 6


@pytest.fixture(scope="module")
def small_vocab_model(tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=SMALL_VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=1,
    )
    folder = tmp_path_factory.mktemp("small-vocab")
    perturbed(LlamaForCausalLM(config), scale=1.0).save_pretrained(folder)
    return flashformer.from_pretrained(folder)


def exact_pair_probabilities(model, ids, temperature: float) -> torch.Tensor:
    """P(first two new tokens = (a, b)) (V, V), from full forwards."""

    def next_probs(seq):
        return (model(seq).logits[0, -1].double() / temperature).softmax(-1)

    first = next_probs(ids)
    rows = [first[a] * next_probs(torch.cat([ids, torch.tensor([[a]])], dim=1)) for a in range(SMALL_VOCAB)]
    return torch.stack(rows)


@pytest.mark.parametrize("proposer", ["lookup", "draft"])
def test_sampling_follows_the_target_distribution(small_vocab_model, proposer):
    model = small_vocab_model
    ids = torch.tensor([[2, 3, 4, 2, 3, 4, 2, 3]])  # lookup drafts 4 2 ... here
    exact = exact_pair_probabilities(model, ids, temperature=1.5)
    extra = (
        dict(prompt_lookup_num_tokens=2)
        if proposer == "lookup"
        else dict(assistant_model=perturbed(copy.deepcopy(model), scale=1.0, seed=3), num_assistant_tokens=2)
    )
    # a row costs nothing here: every round drafts what it may (the second token is a draft's)
    speculative._ROW_COSTS[model] = {"PromptLookup": 0.0, "DraftModel": 0.0}
    runs = 3000
    counts = torch.zeros(SMALL_VOCAB, SMALL_VOCAB)
    generator = torch.Generator().manual_seed(1)
    for _ in range(runs):
        out = model.generate(
            ids,
            max_new_tokens=3,
            do_sample=True,
            temperature=1.5,
            eos_token_id=[],
            generator=generator,
            **extra,
        )
        counts[int(out[0, -3]), int(out[0, -2])] += 1
    expected = exact.flatten() * runs
    keep = expected >= 5  # chi-square cells with enough expected count; the rest lumped together
    observed = torch.cat([counts.flatten()[keep], counts.flatten()[~keep].sum()[None]])
    expected = torch.cat([expected[keep], expected[~keep].sum()[None]]).float()
    chi2 = float(((observed - expected) ** 2 / expected.clamp(min=1e-9)).sum())
    df = int(keep.sum())  # cells - 1, with the lumped one
    # the chi-square quantile at p = 1e-4 is below df + 4 sqrt(2 df) + 10 for these df (20-36)
    assert chi2 < df + 4 * math.sqrt(2 * df) + 10, (chi2, df)


# ---- bad input ----


def test_bad_speculative_settings_name_the_argument(decoder_pair):
    _, _, model = decoder_pair
    ids = prompts(batch=1)
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        model.generate(ids, prompt_lookup_num_tokens=-1)
    with pytest.raises(ValueError, match="max_matching_ngram_size"):
        model.generate(ids, prompt_lookup_num_tokens=3, max_matching_ngram_size=0)
    with pytest.raises(ValueError, match="num_beams"):
        model.generate(ids, prompt_lookup_num_tokens=3, num_beams=2)
    with pytest.raises(ValueError, match=r"one unpadded prompt.*\(2, 7\)"):
        model.generate(prompts(batch=2), prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="not both"):
        model.generate(ids, prompt_lookup_num_tokens=3, assistant_model=model)
    with pytest.raises(ValueError, match="assistant_model"):
        model.generate(ids, assistant_model="a path")
    assert VOCAB == model.config.vocab_size
