"""flashformer.model.hf's lfm2 family: a folder transformers writes from a random Lfm2ForCausalLM
(conv layers beside attention layers, weights nudged from init) loads into its logits within 1e-4
of the largest logit and saves back into a folder transformers reads; generate with the cache
(the attention layers' KV caches, the conv layers' states) picks transformers' greedy tokens,
also with left padding; what has no conv state yet (the native decoder, the paged cache,
speculative decoding) refuses by name and generate runs the eager modules."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import relative_error
from helpers.lfm2 import tiny_lfm2

import flashformer
from flashformer.generate.cache import KVCache, RecurrentState, make_caches
from flashformer.model.native import native_unsupported
from flashformer.model.short_conv import ShortConv

VOCAB = 120
IDS = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' model, ours read from its folder)."""
    folder = tmp_path_factory.mktemp("lfm2")
    reference = tiny_lfm2(vocab=VOCAB)
    reference.save_pretrained(folder)
    return reference, flashformer.from_pretrained(folder)


def test_folder_loads_into_transformers_logits_and_saves_back(pair, tmp_path):
    reference, ours = pair
    assert ours.config.layer_types == ("conv", "full_attention", "conv", "conv", "full_attention")
    assert isinstance(ours.decoder.block(0).attn, ShortConv) and ours.config.qk_norm
    with torch.no_grad():
        expected = reference(IDS).logits
        assert relative_error(ours(IDS).logits, expected) < 1e-4
    ours.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["layer_types"][:2] == ["conv", "full_attention"] and saved["conv_L_cache"] == 3
    back = type(reference).from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert relative_error(back(IDS).logits, expected) < 1e-4


def test_every_conv_part_changes_the_logits(pair):
    """The filter's taps, each gate and the final norm matter: undone, the logits move far."""
    _, ours = pair
    with torch.no_grad():
        expected = ours(IDS).logits
        for name, change in {
            "oldest tap": lambda m: m.decoder.block(2).attn.conv.weight[:, :, 0].zero_(),
            "in_proj": lambda m: m.decoder.block(0).attn.in_proj.weight.mul_(1.5),
            "final norm": lambda m: m.decoder.final_norm.weight.add_(0.5),
        }.items():
            saved = {k: v.clone() for k, v in ours.state_dict().items()}
            change(ours)
            assert relative_error(ours(IDS).logits, expected) > 1e-2, name
            ours.load_state_dict(saved)


@pytest.mark.parametrize(
    "changes",
    [
        dict(full_attn_idxs=[1, 3], layer_types=None, num_hidden_layers=4),
        dict(conv_L_cache=4, conv_bias=True),
    ],
    ids=["full_attn_idxs", "wider-conv-with-biases"],
)
def test_the_config_variants_load_into_transformers_logits(tmp_path, changes):
    reference = tiny_lfm2(vocab=VOCAB, seed=3, **changes)
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if name.endswith("conv.bias") or name.endswith("in_proj.bias"):
                parameter.uniform_(-0.3, 0.3)
    reference.save_pretrained(tmp_path)
    ours = flashformer.from_pretrained(tmp_path)
    with torch.no_grad():
        assert relative_error(ours(IDS).logits, reference(IDS).logits) < 1e-4


def test_the_caches_hold_kv_for_attention_and_a_window_for_conv(pair):
    _, ours = pair
    caches = make_caches(ours, 2, 40)
    assert [type(c) for c in caches] == [RecurrentState, KVCache, RecurrentState, RecurrentState, KVCache]
    assert caches[0]["conv"].shape == (2, 64, 2)  # the last conv_L_cache - 1 inputs per channel


def test_greedy_generation_with_the_cache_equals_transformers(pair):
    reference, ours = pair
    prompt = IDS[:1, :9]
    with torch.no_grad():
        want = reference.generate(prompt, max_new_tokens=12, do_sample=False)
    assert ours.generate(prompt, max_new_tokens=12, do_sample=False).tolist() == want.tolist()
    chunked = ours.generate(prompt, max_new_tokens=12, do_sample=False, prefill_chunk_size=4)
    assert chunked.tolist() == want.tolist()


def test_beam_search_reorders_the_conv_states_as_transformers_does(pair):
    """Each beam continues from its parent's conv window and KV cache (RecurrentState.reorder)."""
    reference, ours = pair
    with torch.no_grad():
        want = reference.generate(IDS[:1, :9], max_new_tokens=8, do_sample=False, num_beams=3)
    assert (
        ours.generate(IDS[:1, :9], max_new_tokens=8, do_sample=False, num_beams=3).tolist() == want.tolist()
    )


def test_left_padded_batches_generate_transformers_tokens(pair):
    reference, ours = pair
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        want = reference.generate(IDS[:, :10], attention_mask=mask, max_new_tokens=8, do_sample=False)
    got = ours.generate(IDS[:, :10], attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert got.tolist() == want.tolist()


def test_what_keeps_no_conv_state_yet_refuses_by_name(pair):
    from flashformer.serve.paged_cache import BlockPool, make_paged_caches

    _, ours = pair
    assert "LFM2's short convolution layers (lfm2" in native_unsupported(ours)
    assert ours.native_decoder() is None  # generate runs the eager modules
    with pytest.raises(ValueError, match=r"conv layers \(LFM2's short convolutions, lfm2"):
        make_paged_caches(ours, BlockPool(8, 4))
    with pytest.raises(ValueError, match="keep a state that cannot rewind yet"):
        ours.generate(IDS[:1, :6], max_new_tokens=4, prompt_lookup_num_tokens=2)
