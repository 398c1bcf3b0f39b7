"""ModelConfig: derived sizes resolved once, presets, and changes that keep them consistent."""

from __future__ import annotations

import pytest

from flashformer.model.config import ModelConfig
from flashformer.model.presets import preset


def test_derived_sizes_are_resolved_at_construction():
    config = ModelConfig(d_model=96, n_heads=6, n_layers=3)
    assert (config.n_kv_heads, config.head_dim, config.n_decoder_layers) == (6, 16, 3)
    given = ModelConfig(d_model=96, n_heads=6, n_kv_heads=2, head_dim=24, n_layers=3, n_decoder_layers=5)
    assert (given.n_kv_heads, given.head_dim, given.n_decoder_layers) == (2, 24, 5)


def test_replace_derives_again_what_was_derived_and_keeps_what_was_given():
    gpt2 = preset("gpt2")
    wider_heads = gpt2.replace(n_heads=6)
    assert (wider_heads.head_dim, wider_heads.n_kv_heads) == (128, 6)
    assert wider_heads == ModelConfig(**dict(gpt2.to_dict(), n_heads=6, head_dim=None, n_kv_heads=None))
    t5 = preset("t5-small")  # head_dim is given (T5's d_kv), so it stays when d_model changes
    assert t5.replace(d_model=1024).head_dim == 64
    assert t5.replace(n_layers=4).n_decoder_layers == 4  # derived: follows n_layers
    llama = preset("llama-small")
    assert llama.replace(n_heads=24).n_kv_heads == 4  # given by the preset: kept
    assert gpt2.replace(n_kv_heads=4).n_kv_heads == 4


def test_attention_out_bias_follows_attention_bias_unless_given():
    assert ModelConfig(attention_bias=False).attention_out_bias is False
    qwen2 = preset("llama-tiny", attention_bias=True, attention_out_bias=False)
    assert (qwen2.attention_out_bias, qwen2.replace(n_layers=1).attention_out_bias) == (False, False)
    llama = preset("llama-tiny")
    assert llama.replace(attention_bias=True).attention_out_bias is True  # derived: derived again


def test_presets_take_overrides_before_deriving():
    assert preset("gpt2", n_heads=6).head_dim == 128
    with pytest.raises(ValueError, match=r"unknown ModelConfig fields: \['n_head'\]"):
        preset("gpt2", n_head=6)


def test_to_dict_round_trips_and_old_files_with_none_still_load():
    config = preset("llama-tiny")
    values = config.to_dict()
    assert "_derived" not in values and values["head_dim"] == 16
    assert ModelConfig.from_dict(values) == config
    old = dict(values, n_kv_heads=2, head_dim=None, n_decoder_layers=None)  # written before sizes were stored
    assert ModelConfig.from_dict(old) == config


def test_layer_types_are_checked_and_round_trip_through_json():
    import json

    sliding = ("sliding_attention", "full_attention")
    config = preset("llama-tiny", layer_types=list(sliding), sliding_window=8, rope_local_theta=1e4)
    assert config.layer_types == sliding and config.layer_type(0) == "sliding_attention"
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(
        ValueError, match=r"layer_types must give one of .* for each of the n_layers=2 layers"
    ):
        preset("llama-tiny", layer_types=("full_attention",))
    with pytest.raises(ValueError, match="sliding_attention layers need ModelConfig.sliding_window"):
        preset("llama-tiny", layer_types=sliding)
    with pytest.raises(ValueError, match="final_logit_softcap must be None or > 0; got 0.0"):
        preset("llama-tiny", final_logit_softcap=0.0)
