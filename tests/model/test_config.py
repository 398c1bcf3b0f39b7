"""ModelConfig: derived sizes resolved once, presets, changes that keep them consistent, and the
sections its fields are grouped in."""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest

from flashformer.model.config import ModelConfig
from flashformer.model.presets import preset
from flashformer.model.sections import ExpertFields, FeedForwardFields, Section


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


# ---- the sections ----


def test_every_field_belongs_to_exactly_one_section_in_reading_order():
    fields = [f.name for f in dataclasses.fields(ModelConfig) if f.init]
    by_section = [[f.name for f in dataclasses.fields(section)] for section in ModelConfig.sections()]
    assert [name for names in by_section for name in names] == fields  # each once, in section order
    assert all(names for names in by_section)


def test_the_sections_are_the_ones_docs_architecture_names_in_its_order():
    page = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    match = re.search(r"^Config sections: (.+)$", page, re.M)
    assert match, "docs/architecture.md has no 'Config sections:' line"
    assert match.group(1).split(" → ") == [section.__name__ for section in ModelConfig.sections()]


@dataclass
class VisionFields(Section):
    """A part no section holds yet, as a section of its own: a vision tower beside the text
    model. Declared here, not in the package, to show that the section alone is the edit:
    serialization, replace and the checks read it from the dataclass."""

    image_size: int = 0  # 0 = no vision tower
    patch_size: int = 16
    vision_width: int | None = None  # None = d_model

    def _check(self) -> None:
        self._derive("vision_width", self.d_model)
        if self.image_size % self.patch_size:
            raise ValueError(
                f"ModelConfig.image_size must be a multiple of patch_size={self.patch_size}; got {self.image_size!r}"
            )


@dataclass
class ConfigWithVision(VisionFields, ModelConfig):
    pass


def test_a_new_section_is_the_only_edit_for_round_trip_replace_and_checks():
    import json

    assert ConfigWithVision.sections() == (*ModelConfig.sections(), VisionFields)
    config = ConfigWithVision(**preset("llama-tiny").to_dict(), image_size=224)
    assert (config.vision_width, config.head_dim) == (64, 16)  # derived, as the sizes are
    assert ConfigWithVision.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert config.replace(d_model=96).vision_width == 96  # derived again
    old = preset("llama-tiny").to_dict()  # a config.json written before the section: a flat dict
    assert ConfigWithVision.from_dict(old).image_size == 0
    assert typing.get_type_hints(ConfigWithVision)["image_size"] is int  # what --model.FIELD parses with
    with pytest.raises(
        ValueError, match=r"ModelConfig.image_size must be a multiple of patch_size=16; got 100"
    ):
        config.replace(image_size=100)
    with pytest.raises(ValueError, match=r"ModelConfig.d_model must be an int >= 1; got 0"):
        config.replace(d_model=0)  # the other sections still check first


# ---- the mixture of experts (ExpertFields) ----

MOE = dict(n_expert=8, n_expert_used=2, ffn_bias=False)


def test_expert_fields_follow_the_feed_forward_and_round_trip():
    import json

    sections = ModelConfig.sections()
    assert sections[sections.index(FeedForwardFields) + 1] is ExpertFields
    config = preset("llama-tiny", **MOE, expert_weights_norm=True)
    assert config.expert_ffn_hidden == config.d_ff == 96  # derived, as the sizes are
    assert config.replace(d_ff=64).expert_ffn_hidden == 64  # derived again
    assert preset("llama-tiny", **MOE, expert_ffn_hidden=32).replace(d_ff=64).expert_ffn_hidden == 32
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    old = preset("llama-tiny").to_dict()  # a config.json written before the section
    for name in ("n_expert", "n_expert_used", "expert_ffn_hidden", "expert_weights_norm"):
        del old[name]
    assert ModelConfig.from_dict(old).n_expert == 0


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(n_expert_used=9), r"n_expert_used must be in \[1, n_expert=8\]; got 9"),
        (dict(n_expert_used=0), r"n_expert_used must be in \[1, n_expert=8\]; got 0"),
        (dict(n_expert=-1), r"n_expert must be an int >= 0; got -1"),
        (dict(n_expert=0), r"n_expert_used=2 needs experts; n_expert is 0"),
        (dict(expert_ffn_hidden=0), r"expert_ffn_hidden must be an int >= 1; got 0"),
        (dict(gated_ffn=False), r"experts are gated feed-forwards, .* got gated_ffn=False"),
        (dict(fused_gate_up=True), r"got fused_gate_up=True"),
        (dict(expert_gating="sigmoid"), r"expert_gating must be one of \('softmax', 'topk_softmax'\)"),
        (dict(swiglu_limit=0.0), r"swiglu_limit must be None or > 0; got 0.0"),
        (dict(swiglu_alpha=1.7), r"swiglu_alpha=1.7 belongs to the clamped SwiGLU; swiglu_limit is None"),
        (dict(swiglu_limit=7.0, activation="gelu"), r"swiglu_limit=7.0 .* needs .* got .* activation='gelu'"),
    ],
)
def test_expert_fields_are_checked_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        preset("llama-tiny", **dict(MOE, **changes))


def test_gpt_oss_fields_sit_in_the_sections_of_the_parts_they_shape():
    """gpt-oss's experts carry biases (ffn_bias) and a router bias; its clamped SwiGLU is the
    feed-forward's; its sinks are attention's; none is allowed beside linear attention."""
    from flashformer.model.sections import AttentionFields

    owner = {f.name: s for s in ModelConfig.sections() for f in dataclasses.fields(s)}
    assert owner["attention_sinks"] is AttentionFields
    assert owner["swiglu_limit"] is owner["swiglu_alpha"] is FeedForwardFields
    assert owner["expert_gating"] is owner["expert_router_bias"] is ExpertFields
    config = preset(
        "llama-tiny",
        **dict(MOE, ffn_bias=True),
        expert_router_bias=True,
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
    )
    assert config.ffn_bias and config.expert_router_bias
    with pytest.raises(ValueError, match="attention_kind='linear' .* got attention_sinks=True"):
        preset("llama-tiny", attention_kind="linear", attention_sinks=True)
