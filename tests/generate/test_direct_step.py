"""A compiled decode step called without dynamo's guards (flashformer.generate.direct_step):
the guards are checked at a session's two ends, a graph that does not fit both is never called
directly, and sessions that go direct make the same tokens as dynamo's path."""

from __future__ import annotations

import pytest
import torch
from helpers import left_padded

from flashformer.generate import session
from flashformer.generate.direct_step import DirectStep, direct_call


def toy_step(model, tokens, attention_mask, position_ids, caches, cache_position):
    """A step with a branch on the position: dynamo guards its graph with `position < 6`."""
    scale = 2.0 if cache_position < 6 else 3.0
    return tokens * scale + caches[0][:, : cache_position + 1].sum()


def toy_args(position: int, batch: int = 1, caches=None) -> tuple:
    caches = caches if caches is not None else [torch.arange(16.0)[None]]
    return None, torch.ones(batch, 1), None, None, caches, position


@pytest.fixture
def toy_compiled():
    torch._dynamo.reset()
    compiled = torch.compile(toy_step, backend="eager")
    for position in (2, 3):  # the second call compiles with the position symbolic
        compiled(*toy_args(position))
    yield compiled
    torch._dynamo.reset()


def test_direct_call_checks_the_guards_at_both_ends(toy_compiled):
    direct = direct_call(toy_step, toy_args(3), toy_args(5))
    assert direct is not None
    for position in (3, 4, 5):
        assert torch.equal(direct(*toy_args(position)), toy_step(*toy_args(position)))
    # the session's last step would take the other branch: no graph serves it whole
    assert direct_call(toy_step, toy_args(3), toy_args(7)) is None
    # a batch the graphs were not compiled for: no entry passes
    assert direct_call(toy_step, toy_args(3, batch=2), toy_args(5, batch=2)) is None


def test_a_step_with_another_batch_or_other_caches_goes_back_through_dynamo(toy_compiled):
    calls = []

    def counted(*args):
        calls.append(args[-1])
        return toy_compiled(*args)

    caches = [torch.arange(16.0)[None]]
    step = DirectStep(toy_step, counted)
    for position in (2, 3, 4, 5):
        step(toy_args(position, caches=caches), lambda: toy_args(5, caches=caches))
    assert calls == [2, 3]  # dynamo for two steps, direct from then on
    assert step.direct is not None
    got = step(toy_args(4, batch=2, caches=caches), lambda: toy_args(5, batch=2, caches=caches))
    assert calls == [2, 3, 4] and torch.equal(got, toy_step(*toy_args(4, batch=2)))
    other = [torch.arange(16.0)[None]]
    step(toy_args(4, caches=other), lambda: toy_args(5, caches=other))
    assert calls == [2, 3, 4, 4]


@pytest.mark.parametrize("padded", [False, True], ids=["one-prompt", "left-padded"])
def test_a_compiled_session_goes_direct_with_the_same_tokens(decoder_pair, padded, monkeypatch):
    """The model's decode step under dynamo (its eager backend: the dispatch, not inductor,
    is under test): greedy tokens and logits equal with the direct call and without it, and
    the direct call serves every step but the first two."""
    _, _, ours = decoder_pair
    ids, mask, alone = left_padded()
    if not padded:
        ids, mask = alone[0], None
    torch._dynamo.reset()
    counted = []

    def compiled(step, device_type):
        graph = torch.compile(step, backend="eager")

        def call(*args):
            counted.append(args[-1])
            return graph(*args)

        return call

    monkeypatch.setattr(session, "compiled", compiled)
    runs = {}
    for attempts in (0, DirectStep.ATTEMPTS):
        monkeypatch.setattr(DirectStep, "ATTEMPTS", attempts)
        counted.clear()
        runs[attempts] = ours.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=10,
            compile=True,
            return_dict_in_generate=True,
            output_logits=True,
        )
        runs[attempts, "dynamo steps"] = len(counted)
    torch._dynamo.reset()
    dynamo, direct = runs[0], runs[DirectStep.ATTEMPTS]
    assert runs[0, "dynamo steps"] == 9
    assert runs[DirectStep.ATTEMPTS, "dynamo steps"] == 2
    assert direct.sequences.tolist() == dynamo.sequences.tolist()
    for a, b in zip(direct.logits, dynamo.logits):
        assert torch.equal(a, b)


@pytest.mark.parametrize("padded", [False, True], ids=["one-prompt", "left-padded"])
def test_a_compiled_session_compiles_one_graph_with_the_position_symbolic(decoder_pair, padded, monkeypatch):
    """session.compiled makes the position (and the padding mask's length) symbolic from the
    first trace: one graph for the whole session, not one specialized to the first position
    and a second with it symbolic; the tokens are eager's. (Dynamo's eager backend stands in
    for inductor: what is under test is what dynamo traces.)"""
    from flashformer.generate.direct_step import _entries

    _, _, ours = decoder_pair
    ids, mask, alone = left_padded()
    if not padded:
        ids, mask = alone[0], None
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda step, options=None: real_compile(step, backend="eager"))
    torch._dynamo.reset()
    session.compiled.cache_clear()
    try:
        got = ours.generate(ids, attention_mask=mask, max_new_tokens=10, compile=True)
        graphs = len(_entries(session.decode_step))
    finally:
        torch._dynamo.reset()
        session.compiled.cache_clear()
    assert graphs == 1
    assert got.tolist() == ours.generate(ids, attention_mask=mask, max_new_tokens=10).tolist()
