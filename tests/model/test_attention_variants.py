"""The Transformer's attention variants of docs/models.md: linear attention (its decoding
state steps to the same logits as the whole sequence, and does not grow) and sliding window +
global tokens (decoding through the KV cache equals the whole sequence)."""

from __future__ import annotations

import pytest
import torch

from flashformer.generate.cache import make_caches
from flashformer.model.models import build
from flashformer.model.presets import preset


def tiny_decoder(**changes):
    torch.manual_seed(0)
    sizes = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=60, position="rope")
    return build(preset("llama-tiny", **dict(sizes, **changes))).double().eval()


VARIANTS = {
    "linear-elu": dict(attention_kind="linear"),
    "linear-favor": dict(attention_kind="linear", linear_feature_map="favor", linear_features=16),
    "window+global": dict(layer_types=("sliding_attention",) * 2, sliding_window=4, global_tokens=2),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_decoding_step_by_step_equals_the_whole_sequence(name):
    model = tiny_decoder(**VARIANTS[name])
    ids = torch.randint(0, 60, (2, 15))
    whole = model(ids).logits
    caches = make_caches(model, 2, 15)
    pieces = [model(ids[:, :6], kv_caches=caches).logits]  # a prompt, then one token at a time
    for t in range(6, 15):
        pieces.append(model(ids[:, t : t + 1], kv_caches=caches, cache_position=t).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-10, atol=1e-10)


def test_a_linear_attention_state_does_not_grow_with_the_tokens_seen():
    model = tiny_decoder(**VARIANTS["linear-elu"]).float()
    sizes = {}
    for n in (3, 40):
        caches = make_caches(model, 1, n)
        model(torch.randint(0, 60, (1, n)), kv_caches=caches)
        sizes[n] = sum(c.nbytes for c in caches)
    assert sizes[3] == sizes[40] == 2 * (2 * 8 * 8 + 2 * 8) * 4  # layers x (S: Hk F D, z: Hk F) float32


def test_linear_attention_refuses_score_rules_it_cannot_follow():
    with pytest.raises(ValueError, match="attention_kind='linear'"):
        preset("llama-tiny", attention_kind="linear", position="alibi")
    with pytest.raises(ValueError, match="global_tokens=2 widens sliding-window layers"):
        preset("llama-tiny", global_tokens=2)
