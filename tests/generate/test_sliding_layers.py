"""Generation with the KV cache for a model whose layers differ (Gemma 3's shape: two
sliding-window layers with their own RoPE base, then a full one; q/k norms, sandwich norms,
softcaps): every cached step must give the logits of a forward pass over the whole sequence
without a cache, the reference being the full forward's own masks (window and causal over
all keys), and greedy tokens must equal an argmax loop over such full forwards, well past
the window."""

from __future__ import annotations

import torch
from helpers.sliding import sliding_model

import flashformer


def test_greedy_with_the_cache_equals_full_recompute():
    model = sliding_model()
    prompt = torch.randint(0, 300, (2, 7), generator=torch.Generator().manual_seed(1))
    out = model.generate(
        prompt,
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    sequence = prompt
    with torch.no_grad():
        for step in range(12):
            logits = model(sequence).logits[:, -1]  # (B, vocab), no cache
            torch.testing.assert_close(out.logits[step], logits, atol=1e-5, rtol=0)
            sequence = torch.cat([sequence, logits.argmax(-1, keepdim=True)], dim=1)
    assert out.sequences.tolist() == sequence.tolist()


def test_the_window_and_the_local_rope_change_the_result():
    """The same weights with every layer full, or one RoPE base for all, give other logits:
    the tests above see the window and the local base, not a model that ignores them."""
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(2))
    model = sliding_model()
    with torch.no_grad():
        logits = model(ids).logits
        for changes in ({"layer_types": None}, {"rope_local_theta": None}):
            other = flashformer.build(model.config.replace(**changes)).eval()
            other.load_state_dict(model.state_dict())
            assert (other(ids).logits - logits).abs().max() > 1e-3, changes
