"""generate/proposers.py: one table of speculative proposers. Each row is reached by vLLM's name
(generate's speculative_method, --speculative-config's method) and, where transformers has one,
by its argument; an unknown name is refused naming the argument, the value and the choices; the
CLI's and the server's choices are the table's; greedy tokens with every model-free row are plain
greedy's."""

from __future__ import annotations

import argparse

import pytest
import torch
from helpers import prompts

from flashformer.cli.arguments import add_sampling_arguments
from flashformer.generate import speculative
from flashformer.generate.proposers import PROPOSERS, ProposerInputs, proposer_kind
from flashformer.generate.sampling import GenerationSettings, settings_from
from flashformer.generate.session import DecoderSession
from flashformer.serve.speculation import SpeculativeConfig

# a prompt that repeats itself: the lookups find it, the drafts get kept
REPEATING = torch.tensor([[5, 9, 14, 3, 22, 7, 5, 9, 14, 3, 22, 7, 5, 9, 14]])
COSTS = {"PromptLookup": 0.25, "DraftModel": 0.25, "SuffixLookup": 0.25}  # fixed: counts, not timings


def test_each_row_by_both_naming_schemes():
    assert set(PROPOSERS) == {"ngram", "draft_model", "suffix"}
    for kind in PROPOSERS.values():
        assert proposer_kind(GenerationSettings(speculative_method=kind.method)) is kind  # vLLM's name
        assert (
            SpeculativeConfig.from_json(
                f'{{"method": "{kind.method}"' + (', "model": "d.gguf"}' if kind.needs_model else "}")
            ).method
            == kind.method
        )
    by_transformers = {
        "ngram": GenerationSettings(prompt_lookup_num_tokens=4),
        "draft_model": GenerationSettings(assistant_model=object()),
    }
    for method, settings in by_transformers.items():
        assert PROPOSERS[method].asked_by in ("prompt_lookup_num_tokens", "assistant_model")
        assert proposer_kind(settings) is PROPOSERS[method]
    assert proposer_kind(GenerationSettings()) is None  # no speculation
    assert proposer_kind(GenerationSettings(prompt_lookup_num_tokens=0)) is None


def test_an_unknown_name_names_the_argument_the_value_and_the_choices(decoder_pair):
    _, _, model = decoder_pair
    choices = str(sorted(PROPOSERS)).replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(ValueError, match=rf"speculative_method must be one of {choices}; got 'eagle'"):
        model.generate(prompts(batch=1), prompt_lookup_num_tokens=3, speculative_method="eagle")
    with pytest.raises(ValueError, match=r"method must be one of \('ngram', 'draft_model', 'suffix'\)"):
        SpeculativeConfig.from_json('{"method": "eagle"}')
    with pytest.raises(ValueError, match="speculative_method 'suffix' drafts up to prompt_lookup_num_tokens"):
        model.generate(prompts(batch=1), speculative_method="suffix")
    with pytest.raises(ValueError, match="assistant_model goes with speculative_method"):
        model.generate(prompts(batch=1), speculative_method="draft_model", num_assistant_tokens=3)
    with pytest.raises(ValueError, match="not both"):
        model.generate(prompts(batch=1), prompt_lookup_num_tokens=3, assistant_model=model)


def test_the_cli_offers_the_table():
    parser = argparse.ArgumentParser()
    add_sampling_arguments(parser, 20)
    action = next(a for a in parser._actions if a.dest == "speculative_method")
    assert sorted(action.choices) == sorted(PROPOSERS)


def test_every_row_builds_a_proposer_of_the_protocol(decoder_pair):
    _, _, model = decoder_pair
    s = settings_from(model, max_new_tokens=4)
    for kind in PROPOSERS.values():
        inputs = ProposerInputs(REPEATING, s, None, 8, 4, 1, model if kind.needs_model else None)
        proposer = kind.make(inputs)
        context = REPEATING[0].tolist()
        assert proposer.match(context) >= 1
        drafts, q = proposer.draft(context, 3)
        assert len(drafts) <= 3 and q is None  # greedy: no distribution
        if not kind.needs_model:
            assert drafts == [3, 22, 7]  # both lookups: what followed 5 9 14 before


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_tokens_are_plain_greedy_s(decoder_pair, method):
    _, _, model = decoder_pair
    speculative._ROW_COSTS[model] = dict(COSTS)
    for ids in (REPEATING, prompts(batch=1, length=9, seed=5)):
        plain = model.generate(ids, max_new_tokens=24)
        for n in (1, 3, 8):
            drafted = model.generate(
                ids, max_new_tokens=24, prompt_lookup_num_tokens=n, speculative_method=method
            )
            assert torch.equal(drafted, plain), (method, n)
    s = settings_from(model, max_new_tokens=24, prompt_lookup_num_tokens=4, speculative_method=method)
    counters = speculative.Counters()
    tokens = list(
        speculative.speculative_tokens(
            DecoderSession(model, REPEATING, None, s), s, None, None, counters=counters
        )
    )
    assert len(tokens) == 24 and counters.accepted > 0 and counters.forwards < 23  # several kept a forward
