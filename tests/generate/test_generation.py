"""Generation against transformers and against full recomputation.

transformers models of each family (GPT-2, LLaMA with GQA, T5) are built
from small configs with every parameter perturbed, saved and loaded by
flashformer. Greedy, beam search and seeded sampling must give the tokens
transformers' generate gives with the same settings; the logits of every
cached step must equal a forward pass over the whole sequence without a
cache; a left-padded batch must give each row what its prompt gives alone.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import (
    EOS,
    PAD,
    VOCAB,
    decoder_prompt_len,
    generation_model,
    hf_generate,
    left_padded,
    perturbed,
    prompts,
)
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

import flashformer
from flashformer.generate.sampling import filter_top_k, filter_top_p

transformers.logging.set_verbosity_error()
CACHED_TOLERANCE = 1e-5  # cached step vs full recompute, float32


# ---- exactness against transformers ----


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"repetition_penalty": 1.3},
        {"min_new_tokens": 6},
        {"eos_token_id": [5, 11, 23]},
    ],
    ids=["greedy", "repetition_penalty", "min_new_tokens", "eos_list"],
)
def test_greedy_equals_transformers(pair, settings):
    family, theirs, ours = pair
    ids = prompts()
    expected = hf_generate(theirs, ids, max_new_tokens=12, **settings)
    got = ours.generate(ids, max_new_tokens=12, **settings)
    assert got.tolist() == expected.tolist()


def test_greedy_on_a_left_padded_batch_equals_transformers(pair):
    family, theirs, ours = pair
    ids, mask, _ = left_padded()
    expected = hf_generate(theirs, ids, mask, max_new_tokens=10)
    got = ours.generate(ids, attention_mask=mask, max_new_tokens=10)
    assert got.tolist() == expected.tolist()


def test_sampling_equals_transformers_under_the_same_seed(pair):
    """Both draw with torch.multinomial from the global generator: the same
    processed distribution gives the same draws."""
    family, theirs, ours = pair
    ids = prompts()
    settings = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.1)
    torch.manual_seed(123)
    expected = hf_generate(theirs, ids, max_new_tokens=12, **settings)
    torch.manual_seed(123)
    got = ours.generate(ids, max_new_tokens=12, **settings)
    assert got.tolist() == expected.tolist()


# ---- the cache against full recomputation ----


def full_recompute_logits(model, family, ids, mask, sequences, step):
    """Logits for the token after step `step`, from one forward pass without a cache."""
    if family == "t5":
        return model(ids, attention_mask=mask, decoder_input_ids=sequences[:, : 1 + step]).logits[:, -1]
    prompt_len = ids.shape[1]
    full = sequences[:, : prompt_len + step]
    full_mask = torch.cat((mask, torch.ones(mask.shape[0], step, dtype=mask.dtype)), dim=1)
    positions = (full_mask.cumsum(dim=1) - 1).clamp(min=0)
    return model(full, attention_mask=full_mask, position_ids=positions).logits[:, -1]


def test_every_cached_step_equals_a_full_recompute(pair):
    family, _, ours = pair
    ids, mask, _ = left_padded()
    out = ours.generate(
        ids, attention_mask=mask, max_new_tokens=14, return_dict_in_generate=True, output_logits=True
    )
    assert len(out.logits) == 14
    with torch.no_grad():
        for step, cached in enumerate(out.logits):
            full = full_recompute_logits(ours, family, ids, mask, out.sequences, step)
            error = (cached - full).abs().max().item()
            assert error <= CACHED_TOLERANCE, f"step {step}: cached logits differ by {error:.2e}"


def _starts(ids):
    return torch.zeros(ids.shape[0], 1, dtype=torch.long)


def test_a_left_padded_batch_gives_each_row_what_it_gives_alone(pair):
    family, _, ours = pair
    ids, mask, alone = left_padded()
    for settings in ({}, {"num_beams": 3, "eos_token_id": []}):
        batched = ours.generate(ids, attention_mask=mask, max_new_tokens=10, **settings)
        for row, prompt in enumerate(alone):
            single = ours.generate(prompt, max_new_tokens=10, **settings)
            new_batched = batched[row, -10:] if family != "t5" else batched[row]
            new_single = single[0, -10:] if family != "t5" else single[0]
            assert new_batched.tolist() == new_single.tolist(), f"{settings}: row {row}"


def test_chunked_prefill_generates_what_one_prefill_does(decoder_pair):
    """(An encoder-decoder's decoder prompt is one start token: nothing to chunk.)"""
    family, _, ours = decoder_pair
    ids, mask, _ = left_padded()
    whole = ours.generate(
        ids, attention_mask=mask, max_new_tokens=8, return_dict_in_generate=True, output_logits=True
    )
    for chunk in (1, 3, 5):
        chunked = ours.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=8,
            prefill_chunk_size=chunk,
            return_dict_in_generate=True,
            output_logits=True,
        )
        assert chunked.sequences.tolist() == whole.sequences.tolist()
        for a, b in zip(chunked.logits, whole.logits):
            assert (a - b).abs().max().item() <= CACHED_TOLERANCE


def test_stream_yields_the_tokens_generate_returns(pair):
    family, _, ours = pair
    ids = prompts()
    generated = ours.generate(ids, max_new_tokens=9, eos_token_id=[])
    streamed = torch.stack(list(ours.stream(ids, max_new_tokens=9, eos_token_id=[])), dim=1)
    assert streamed.tolist() == generated[:, -9:].tolist()


def test_cross_attention_keys_are_projected_once_per_prompt(t5_pair, monkeypatch):
    family, _, ours = t5_pair
    calls = []
    for block in ours.decoder.blocks:
        original = block.cross_attn.project_memory
        monkeypatch.setattr(block.cross_attn, "project_memory", lambda m, f=original: calls.append(1) or f(m))
    ours.generate(prompts(), max_new_tokens=10, eos_token_id=[])
    assert len(calls) == len(ours.decoder.blocks)
    calls.clear()
    ours.generate(prompts(), max_new_tokens=6, num_beams=3, eos_token_id=[])
    assert len(calls) == len(ours.decoder.blocks)


# ---- sampling ----


def test_seeded_sampling_is_reproducible(pair):
    family, _, ours = pair
    ids = prompts()
    settings = dict(max_new_tokens=15, do_sample=True, temperature=1.0, eos_token_id=[])
    first = ours.generate(ids, seed=7, **settings)
    again = ours.generate(ids, seed=7, **settings)
    with_generator = ours.generate(ids, generator=torch.Generator().manual_seed(7), **settings)
    other = ours.generate(ids, seed=8, **settings)
    assert first.tolist() == again.tolist() == with_generator.tolist()
    assert first.tolist() != other.tolist()


def test_top_k_of_one_and_a_tiny_top_p_sample_the_greedy_tokens(pair):
    family, _, ours = pair
    ids = prompts()
    greedy = ours.generate(ids, max_new_tokens=10)
    assert ours.generate(ids, max_new_tokens=10, do_sample=True, top_k=1, seed=0).tolist() == greedy.tolist()
    assert (
        ours.generate(ids, max_new_tokens=10, do_sample=True, top_p=1e-6, seed=0).tolist() == greedy.tolist()
    )


@pytest.mark.parametrize("top_k", [1, 5, 50, 200])
def test_top_k_filter_equals_transformers(top_k):
    torch.manual_seed(0)
    scores = torch.randn(4, VOCAB)
    scores[0, :10] = 1.5  # ties at the cut
    assert torch.equal(filter_top_k(scores, top_k), TopKLogitsWarper(top_k)(None, scores))


@pytest.mark.parametrize("top_p", [1e-3, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("min_keep", [1, 3])
def test_top_p_filter_equals_transformers(top_p, min_keep):
    torch.manual_seed(0)
    scores = torch.randn(4, VOCAB) * 3
    expected = TopPLogitsWarper(top_p, min_tokens_to_keep=min_keep)(None, scores)
    assert torch.equal(filter_top_p(scores, top_p, min_keep), expected)


# ---- stopping ----


def test_generation_stops_when_every_row_has_ended(pair):
    family, _, ours = pair
    ids = prompts()
    free = ours.generate(ids, max_new_tokens=12, eos_token_id=[])
    prompt_len = decoder_prompt_len(family, ids)
    # make each row's third new token an eos: rows end at different steps, the batch after the last
    third = free[:, prompt_len + 2].tolist()
    out = ours.generate(ids, max_new_tokens=12, eos_token_id=third)
    assert out.shape[1] < free.shape[1]
    for row in range(out.shape[0]):
        new = out[row, prompt_len:].tolist()
        end = next(i for i, t in enumerate(new) if t in third) + 1
        assert new[:end] == free[row, prompt_len : prompt_len + end].tolist()
        assert all(t == ours.config.pad_token_id or t == PAD for t in new[end:])


def test_max_new_tokens_zero_returns_the_prompt(pair):
    family, _, ours = pair
    ids = prompts()
    out = ours.generate(ids, max_new_tokens=0)
    expected = ids if family != "t5" else _starts(ids)
    assert out.tolist() == expected.tolist()


# ---- bad input: a clear error naming the argument, before any compute ----

BAD_INPUTS = [
    (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), "empty prompt"),
    (dict(attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1, 1], [0] * 7, [1] * 7])), "attention_mask"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(top_p=0.0, do_sample=True), "top_p"),
    (dict(top_p=1.5, do_sample=True), "top_p"),
    (dict(temperature=0.0, do_sample=True), "temperature"),
    (dict(temperature=-1.0, do_sample=True), "temperature"),
    (dict(num_beams=0), "num_beams"),
    (dict(top_k=-2), "top_k"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(eos_token_id=VOCAB), "eos_token_id"),
    (dict(early_stopping="sometimes"), "early_stopping"),
    (dict(seed=1, generator=torch.Generator()), "generator or seed"),
    (dict(input_ids=torch.full((1, 3), VOCAB)), "input_ids"),
    (dict(input_ids=torch.ones(1, 3)), "input_ids"),
]


@pytest.mark.parametrize("changes,named", BAD_INPUTS, ids=[named for _, named in BAD_INPUTS])
def test_bad_input_is_refused_before_any_compute(pair, changes, named, monkeypatch):
    family, _, ours = pair
    _forbid_compute(ours, monkeypatch)
    kwargs = dict(input_ids=prompts(), max_new_tokens=5)
    kwargs.update(changes)
    with pytest.raises(ValueError, match=named):
        ours.generate(**kwargs)


def test_a_prompt_longer_than_the_positions_is_refused_before_any_compute(monkeypatch):
    torch.manual_seed(0)
    ours = flashformer.build("gpt2-tiny", vocab_size=VOCAB, max_seq_len=16, eos_token_id=EOS).eval()
    _forbid_compute(ours, monkeypatch)
    with pytest.raises(ValueError, match=r"max_new_tokens=10 is 20 tokens, beyond the model's 16 learned"):
        ours.generate(prompts(batch=1, length=10), max_new_tokens=10)


def test_right_padding_is_refused_for_a_decoder(decoder_pair, monkeypatch):
    """(An encoder reads padding anywhere; a decoder's new tokens follow the last column.)"""
    family, _, ours = decoder_pair
    _forbid_compute(ours, monkeypatch)
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0
    with pytest.raises(ValueError, match="left-padded"):
        ours.generate(prompts(), attention_mask=mask, max_new_tokens=3)


def test_stream_refuses_beam_search(pair):
    family, _, ours = pair
    with pytest.raises(ValueError, match="num_beams=2"):
        ours.stream(prompts(), num_beams=2)


def _forbid_compute(model, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model computed before the arguments were checked")

    monkeypatch.setattr(model, "forward", refuse)
    if hasattr(model, "encode"):
        monkeypatch.setattr(model, "encode", refuse)


# ---- torch.compile of the decode step ----


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "t5"])
def test_compiled_decode_step_generates_the_same_tokens(family, tmp_path):
    torch.manual_seed(0)
    theirs = perturbed(generation_model(family))
    theirs.save_pretrained(tmp_path)
    ours = flashformer.from_pretrained(tmp_path)
    ids, mask, _ = left_padded()
    eager = ours.generate(
        ids, attention_mask=mask, max_new_tokens=12, return_dict_in_generate=True, output_logits=True
    )
    compiled = ours.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=12,
        compile=True,
        return_dict_in_generate=True,
        output_logits=True,
    )
    assert compiled.sequences.tolist() == eager.sequences.tolist()
    for a, b in zip(compiled.logits, eager.logits):
        assert (a - b).abs().max().item() <= CACHED_TOLERANCE
    beams = ours.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3, compile=True)
    assert beams.tolist() == ours.generate(ids, attention_mask=mask, max_new_tokens=8, num_beams=3).tolist()


def test_the_decode_step_traces_as_one_graph(pair):
    """compile=True pays off only if torch.compile sees a decode step whole: a
    graph break per layer would bring the per-layer Python cost back. Dynamo's
    tracing alone (backend="eager") with fullgraph=True fails on any break."""
    from flashformer.generate.sampling import GenerationSettings
    from flashformer.generate.session import make_session

    _, _, ours = pair
    ids, mask, _ = left_padded()

    def first_step(traced: bool) -> torch.Tensor:
        session = make_session(
            ours, ids, mask, GenerationSettings(max_new_tokens=4, decoder_start_token_id=0, native=False)
        )
        if traced:
            session.decode = torch.compile(session.decode, backend="eager", fullgraph=True)
        return session.step(session.prefill().argmax(dim=-1))

    torch._dynamo.reset()
    assert torch.equal(first_step(traced=True), first_step(traced=False))


def test_stream_tokens_runs_without_autograd_whoever_calls_it(pair):
    """A chat session calls stream_tokens directly, outside generate()'s no_grad: its steps must
    not record autograd (a compiled step would trace a backward graph, which quantized layers
    refuse), and the caller's grad mode is left as it was between tokens."""
    from flashformer.generate.mixin import stream_tokens
    from flashformer.generate.sampling import GenerationSettings
    from flashformer.generate.session import make_session

    _, _, ours = pair
    ids, mask, _ = left_padded()
    settings = GenerationSettings(max_new_tokens=3, decoder_start_token_id=0)
    logits = []
    assert torch.is_grad_enabled()
    for _ in stream_tokens(make_session(ours, ids, mask, settings), settings, None, None, logits):
        assert torch.is_grad_enabled()
    assert len(logits) == 3 and not any(t.requires_grad for t in logits)
