"""LongRoPE in flashformer.model.hf's phi3 family (Phi-4-mini, Phi-3.5-mini, Phi-3-128k): short and
long factors chosen by the sequence's length as transformers chooses them, the attention factor on
cos and sin, a partial rotary of 0.75; folders of transformers' own Phi3ForCausalLM load into its
logits and greedy tokens, before and past the original context, and save back."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.dense_2026 import ORIGINAL_CONTEXT, tiny_phi4_mini

import flashformer
from flashformer.model.positional import RopeScaling, RotaryEmbedding


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 275, (2, length), generator=torch.Generator().manual_seed(seed))


def _relative(got, expected) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("phi4_mini")
    reference = tiny_phi4_mini()
    reference.save_pretrained(path)
    return path, reference


@pytest.mark.parametrize("length", [ORIGINAL_CONTEXT, ORIGINAL_CONTEXT + 1, 3 * ORIGINAL_CONTEXT])
def test_logits_equal_transformers_within_and_past_the_original_context(folder, length):
    path, reference = folder
    ours = flashformer.from_pretrained(path)
    scaling = ours.config.rope_scaling
    assert (scaling.kind, scaling.original_max_seq_len, ours.config.rotary_fraction) == ("longrope", 32, 0.75)
    with torch.no_grad():
        assert _relative(ours(_ids(length)).logits, reference(_ids(length)).logits) < 1e-5


def test_the_long_factors_take_over_past_the_original_context(folder):
    """The two sets give other logits past the original context, and the same ones within it."""
    path, _ = folder
    ours = flashformer.from_pretrained(path)
    scaling = ours.config.rope_scaling
    short_only = flashformer.build(
        ours.config.replace(
            rope_scaling=RopeScaling(**{**vars(scaling), "long_factor": scaling.short_factor})
        )
    )
    short_only.load_state_dict(ours.state_dict())
    with torch.no_grad():
        within, past = _ids(ORIGINAL_CONTEXT), _ids(ORIGINAL_CONTEXT + 1)
        assert torch.equal(short_only(within).logits, ours(within).logits)
        assert _relative(short_only(past).logits, ours(past).logits) > 1e-3


def test_greedy_with_the_cache_picks_transformers_tokens_past_the_original_context(folder):
    """A prompt of 20, 24 new tokens: the cache's keys of the first 32 positions keep their short
    rotation when the steps past 32 turn to the long factors, in transformers and here."""
    path, reference = folder
    ours = flashformer.from_pretrained(path)
    prompt = _ids(20, seed=3)[:1]
    expected = reference.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None)
    for native in (False, True):
        got = ours.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, native=native)
        assert torch.equal(got, expected), native


def test_saved_folder_loads_back_into_transformers(folder, tmp_path):
    path, reference = folder
    flashformer.from_pretrained(path).save_pretrained(tmp_path)
    back = type(reference).from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert back.config.rope_parameters["rope_type"] == "longrope"
    assert back.config.original_max_position_embeddings == ORIGINAL_CONTEXT
    with torch.no_grad():
        ids = _ids(3 * ORIGINAL_CONTEXT)
        assert _relative(back(ids).logits, reference(ids).logits) < 1e-5


def test_rows_of_a_batch_choose_their_factors_apart():
    """(B, L) positions: a row past the original context turns by the long factors, a row within
    it by the short ones (a sequence gets what it gets alone)."""
    scaling = RopeScaling(
        "longrope", 4.0, original_max_seq_len=8, short_factor=(1.0, 2.0), long_factor=(3.0, 9.0)
    )
    rope = RotaryEmbedding(4, 1.0, 10000.0, scaling)
    positions = torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]])  # row 1's length 9 > 8
    cos, _ = rope(positions)  # (B, 1, L, 4)
    assert torch.equal(cos[0, 0], rope(positions[0])[0])
    assert torch.equal(cos[1, 0], rope(positions[1])[0])
    assert torch.equal(rope.frequencies(positions[0]), rope.inv_freq[None])
    assert torch.equal(rope.frequencies(positions[1]), rope.long_inv_freq[None])
    assert torch.equal(rope.long_inv_freq, 1 / (torch.tensor([3.0, 9.0]) * torch.tensor([1.0, 100.0])))


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"short_factor": [1.0] * 5, "long_factor": [2.0] * 5},
            "one factor per rotated channel pair: rotary_dim / 2 = 6; got 5",
        ),
        ({"rope_type": "yarn"}, "rope type 'yarn' is not supported for phi3 models"),
        ({"long_factor": None}, "LongRoPE needs rope_parameters.long_factor, a list; got None"),
    ],
)
def test_what_longrope_cannot_be_is_refused_by_name(folder, tmp_path, change, message):
    path, _ = folder
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        flashformer.from_pretrained(tmp_path)


def test_the_older_name_su_reads_as_longrope(folder, tmp_path):
    path, reference = folder
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"]["rope_type"] = "su"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        ids = _ids(3 * ORIGINAL_CONTEXT)
        assert _relative(flashformer.from_pretrained(tmp_path)(ids).logits, reference(ids).logits) < 1e-5


def test_the_native_decoder_gives_transformers_cached_logits_across_the_switch(folder):
    """A prompt of 20, then one token a call to 40 (the switch at 32) through the native decoder
    (C++): transformers' logits of the same calls with its cache, the keys before the switch
    keeping their short rotation."""
    from test_model_native import native_logits

    from flashformer.model.native import native_unsupported

    path, reference = folder
    ours = flashformer.from_pretrained(path).eval()
    assert native_unsupported(ours) is None
    ids = _ids(40, seed=4)[:1]
    got = native_logits(ours, [ids[0].tolist()], [[20] + [1] * 20])[0]
    with torch.no_grad():
        out = reference(ids[:, :20], use_cache=True)
        expected, cache = [out.logits[0]], out.past_key_values
        for t in range(20, 40):
            out = reference(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            expected.append(out.logits[0])
            cache = out.past_key_values
    assert _relative(got, torch.cat(expected)) < 1e-4
