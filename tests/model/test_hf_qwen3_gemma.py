"""flashformer.model.hf's qwen3 and gemma families (gemma, gemma2, gemma3_text): Hugging Face
folders written by transformers from random-weight models load into the same logits, and our
save_pretrained writes folders transformers loads back into them.

The tiny models (tests/helpers/gguf.py) have head_dim apart from d_model / heads, norms away
from their resting value, sequences longer than the sliding window, gemma2's softcaps small
enough to matter and a query_pre_attn_scalar that is not head_dim."""

from __future__ import annotations

import pytest
import torch
from helpers.gguf import tiny_new_decoder

import flashformer

ARCHS = ["qwen3", "gemma", "gemma2", "gemma3"]


@pytest.mark.parametrize("arch", [*ARCHS, "gemma3-linear-rope"])
def test_folder_loads_into_transformers_logits_and_saves_back(tmp_path, arch):
    """gemma3-linear-rope: its full layers' RoPE scaled (linear, 4x), the sliding ones not."""
    scaling = {"rope_type": "linear", "factor": 4.0} if arch.endswith("linear-rope") else None
    reference = tiny_new_decoder(arch.removesuffix("-linear-rope"), rope_scaling=scaling)
    reference.save_pretrained(tmp_path / "theirs")
    ours = flashformer.from_pretrained(tmp_path / "theirs")
    ids = torch.randint(0, reference.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
        torch.testing.assert_close(ours(ids).logits, expected, atol=1e-5, rtol=0)

    ours.save_pretrained(tmp_path / "ours")
    back = type(reference).from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, expected, atol=1e-5, rtol=0)


def test_gemma3_config_reads_every_layer_difference(tmp_path):
    tiny_new_decoder("gemma3").save_pretrained(tmp_path)
    config = flashformer.from_pretrained(tmp_path).config
    assert config.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert (config.sliding_window, config.rope_theta, config.rope_local_theta) == (5, 1e6, 10000.0)
    assert config.qk_norm and config.sandwich_norm and config.scale_embeddings
    assert config.attention_softcap is None and config.final_logit_softcap is None
    assert config.attention_scale == pytest.approx(24**-0.5)


def test_layer_variants_a_family_cannot_hold_are_refused_on_save(tmp_path):
    model = flashformer.build("llama-tiny", qk_norm=True)
    with pytest.raises(ValueError, match="qk_norm=True cannot be saved as a Hugging Face llama"):
        model.save_pretrained(tmp_path)
