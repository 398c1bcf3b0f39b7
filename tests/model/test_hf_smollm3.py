"""flashformer.model.hf's smollm3 family: SmolLM3 folders written by transformers load into its
logits (a NoPE layer among RoPE ones), our folders load back into transformers, and the NoPE
layers are the ones transformers' config names (no_rope_layers, or every interval-th layer)."""

from __future__ import annotations

import pytest
import torch
from helpers.dense_2026 import tiny_smollm3

import flashformer


def _ids(model, length: int = 40) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))


def test_folder_loads_into_transformers_logits_and_saves_back(tmp_path):
    reference = tiny_smollm3()
    reference.save_pretrained(tmp_path / "theirs")
    ours = flashformer.from_pretrained(tmp_path / "theirs")
    assert ours.config.nope_layers == (3,) and ours.config.rope_theta == 2e6
    ids = _ids(reference)
    with torch.no_grad():
        expected = reference(ids).logits
        assert (ours(ids).logits - expected).abs().max() / expected.abs().max() < 1e-5
        # the NoPE layer matters: rotating it too gives other logits
        roped = flashformer.build(ours.config.replace(nope_layers=()))
        roped.load_state_dict(ours.state_dict())
        assert (roped(ids).logits - expected).abs().max() / expected.abs().max() > 1e-3

    ours.save_pretrained(tmp_path / "ours")
    back = type(reference).from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert back.config.no_rope_layers == [1, 1, 1, 0, 1]
    with torch.no_grad():
        assert (back(ids).logits - expected).abs().max() / expected.abs().max() < 1e-5


def test_greedy_with_the_cache_picks_transformers_tokens(tmp_path):
    reference = tiny_smollm3()
    reference.save_pretrained(tmp_path)
    ours = flashformer.from_pretrained(tmp_path)
    prompt = _ids(reference, 12)[:1]
    expected = reference.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)
    got = ours.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "given, nope",
    [
        ({"no_rope_layers": [0, 1, 0, 1, 1]}, (0, 2)),
        ({"no_rope_layer_interval": 2}, (1, 3)),
    ],
)
def test_nope_layers_follow_transformers_config(tmp_path, given, nope):
    reference = tiny_smollm3(**given)
    reference.save_pretrained(tmp_path)
    ours = flashformer.from_pretrained(tmp_path)
    assert ours.config.nope_layers == nope
    ids = _ids(reference, 20)
    with torch.no_grad():
        expected = reference(ids).logits
        assert (ours(ids).logits - expected).abs().max() / expected.abs().max() < 1e-5


def test_a_sliding_window_is_refused_by_name(tmp_path):
    tiny_smollm3(use_sliding_window=True, sliding_window=8).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="use_sliding_window=True is not supported for smollm3"):
        flashformer.from_pretrained(tmp_path)


def test_nope_layers_out_of_range_are_refused():
    with pytest.raises(ValueError, match=r"nope_layers must name layers in \[0, n_layers=2\)"):
        flashformer.build("llama-tiny", n_layers=2, nope_layers=(2,))


def test_the_native_decoder_rotates_nothing_in_the_nope_layers(tmp_path):
    """Prompt and decode steps through the native decoder (C++): transformers' logits."""
    from test_model_native import native_logits

    reference = tiny_smollm3()
    reference.save_pretrained(tmp_path)
    ours = flashformer.from_pretrained(tmp_path).eval()
    ids = _ids(reference, 20)[0]
    got = native_logits(ours, [ids.tolist()], [[13] + [1] * 7])[0]
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    assert (got - expected).abs().max() / expected.abs().max() < 1e-4
