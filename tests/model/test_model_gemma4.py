"""flashformer.model.hf's gemma4_text family and the layers it needs (per_layer.py, shared keys
and values, proportional RoPE, wider full-layer heads): a Hugging Face folder written by
transformers' Gemma4ForCausalLM loads into its logits, generates its greedy tokens with the
cache, and saves back into a folder transformers reads; what flashformer lacks is refused by
name (tests/helpers/gemma4.py: the tiny model)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.gemma4 import tiny_gemma4

import flashformer
from flashformer.attention import attention
from flashformer.model.native import native_unsupported
from flashformer.model.positional import RotaryEmbedding, apply_rotary


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma4")
    reference = tiny_gemma4()
    reference.save_pretrained(path)
    return path, reference


def test_folder_loads_into_transformers_logits_and_saves_back(folder, tmp_path):
    path, reference = folder
    ours = flashformer.from_pretrained(path).eval()
    ids = torch.randint(0, 160, (2, 23), generator=torch.Generator().manual_seed(0))  # past the window
    with torch.no_grad():
        expected = reference(ids).logits
        assert relative(ours(ids).logits, expected) < 1e-4
    ours.save_pretrained(tmp_path)
    back = type(reference).from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        assert relative(back(ids).logits, expected) < 1e-4


def test_greedy_with_the_cache_picks_transformers_tokens(folder):
    path, reference = folder
    ours = flashformer.from_pretrained(path).eval()
    prompt = torch.randint(0, 160, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = reference.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        mine = ours.generate(prompt, max_new_tokens=16, do_sample=False)
    assert mine[0].tolist() == theirs[0].tolist()


def test_config_reads_every_layer_difference(folder):
    config = flashformer.from_pretrained(folder[0]).config
    assert (config.head_dim, config.global_head_dim, config.attention_scale) == (32, 512, 1.0)
    assert (config.rope_theta, config.rotary_fraction, config.rope_proportional) == (1e6, 0.25, True)
    assert (config.rope_local_theta, config.sliding_window, config.final_logit_softcap) == (10000.0, 5, 3.0)
    assert config.kv_shared_layers == 2 and [config.kv_source(i) for i in range(6)] == [None] * 4 + [2, 3]
    assert config.layer_d_ff == (96,) * 4 + (192,) * 2
    assert config.per_layer_input_dim == 8 and config.v_norm and config.layer_scale


def test_native_decoder_refuses_naming_what_it_lacks(folder):
    reason = native_unsupported(flashformer.from_pretrained(folder[0]).eval())
    assert "per-layer inputs" in reason and "shared across layers" in reason and "global_head_dim" in reason


@pytest.mark.parametrize(
    "change, message",
    [
        ({"enable_moe_block": True}, "enable_moe_block=True is not supported"),
        ({"attention_k_eq_v": True}, "attention_k_eq_v=True is not supported"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all' is not supported"),
    ],
)
def test_unsupported_options_are_refused_by_name(folder, tmp_path, change, message):
    hf = json.loads((folder[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, **change}))
    with pytest.raises(ValueError, match=message):
        flashformer.model.hf.config_from_hf({**hf, **change}, tmp_path)


def test_proportional_rope_turns_a_quarter_of_the_pairs_at_the_whole_heads_frequencies():
    """Against the formula: pair i (channels i, i + D/2) turns at theta^(-2i/D) for i < D/8."""
    dim, theta = 16, 100.0
    rope = RotaryEmbedding(dim, 0.25, theta, proportional=True)
    x = torch.randn(1, 1, 3, dim, dtype=torch.float64)
    rotated = apply_rotary(x, *[t.double() for t in rope(torch.arange(3))])
    for p in range(3):
        for i in range(dim // 2):
            angle = p * theta ** (-2 * i / dim) if i < dim // 8 else 0.0
            c, s = torch.tensor(angle).cos(), torch.tensor(angle).sin()
            a, b = x[0, 0, p, i], x[0, 0, p, i + dim // 2]
            assert torch.allclose(rotated[0, 0, p, i], a * c - b * s)
            assert torch.allclose(rotated[0, 0, p, i + dim // 2], b * c + a * s)


@pytest.mark.parametrize("backend", ["flash", "torch", "cpu"])
def test_attention_backends_take_heads_of_512(backend):
    """Gemma 4's full layers: one prefill and one decode-shaped call against the eager scores."""
    generator = torch.Generator().manual_seed(0)
    for q_len in (7, 1):
        q = torch.randn(1, 4, q_len, 512, generator=generator)
        k, v = torch.randn(2, 1, 2, 9, 512, generator=generator)
        args = dict(causal=True, window=(4, None), scale=1.0)
        expected = attention(q, k, v, backend="eager", **args)
        if backend == "cpu" and q_len > 1:
            continue  # the C++ kernel serves decode steps
        torch.testing.assert_close(
            attention(q, k, v, backend=backend, **args), expected, atol=1e-5, rtol=1e-5
        )


def test_the_text_model_of_a_gemma4_for_conditional_generation_folder(folder, tmp_path):
    """The released checkpoints' class: its language model's weights and text_config are read,
    the vision tower left aside; the logits are the text model's."""
    import transformers

    path, reference = folder
    vision = transformers.Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16
    )
    config = transformers.Gemma4Config(
        text_config=reference.config.to_dict(), vision_config=vision.to_dict(), audio_config=None
    )
    multimodal = transformers.Gemma4ForConditionalGeneration(config).eval()
    multimodal.model.language_model.load_state_dict(reference.model.state_dict())
    multimodal.save_pretrained(tmp_path)
    ours = flashformer.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 160, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert relative(ours(ids).logits, multimodal(input_ids=ids).logits) < 1e-4
    assert ours.config.hf_model_type == "gemma4_text"
