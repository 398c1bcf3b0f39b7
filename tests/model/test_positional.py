"""Positional encodings against transformers and against float64 formulas written here."""

from __future__ import annotations

import math

import pytest
import torch

from flashformer.model.positional import (
    RelativePositionBias,
    RopeScaling,
    RotaryEmbedding,
    alibi_slopes,
    apply_rotary,
    rope_inverse_frequencies,
    sinusoidal_embedding,
    t5_relative_bucket,
)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (16, 40), (8, 20), (64, 256)])
def test_t5_relative_bucket_equals_transformers(bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    relative = (
        torch.arange(-600, 601)[None, :] + torch.arange(0, 3)[:, None]
    )  # (3, 1201), far past max_distance
    ours = t5_relative_bucket(relative, bidirectional, num_buckets, max_distance)
    theirs = T5Attention._relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    assert torch.equal(ours, theirs)
    assert int(ours.min()) >= 0 and int(ours.max()) < num_buckets


def test_sinusoidal_matches_the_formula_in_float64():
    dim, positions = 16, torch.arange(0, 300, 7)
    ours = sinusoidal_embedding(positions, dim)
    expected = torch.zeros(len(positions), dim, dtype=torch.float64)
    for row, p in enumerate(positions.tolist()):
        for i in range(dim // 2):
            angle = p / 10000 ** (2 * i / dim)
            expected[row, 2 * i], expected[row, 2 * i + 1] = math.sin(angle), math.cos(angle)
    assert (ours.double() - expected).abs().max() < 1e-4  # float32 angles up to 300 rad


def test_alibi_slopes_for_powers_of_two_and_others():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # 12 heads: the 8 slopes of n=8, then every other slope of n=16 (2^-0.5, 2^-1.5, ...)
    expected = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(0.5 + i) for i in range(4)]
    assert torch.allclose(alibi_slopes(12), torch.tensor(expected))
    assert alibi_slopes(1).tolist() == [2.0**-8]


# ---- RoPE ----


def _hf_llama_rotary(head_dim, theta, rope_parameters, positions):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=head_dim * 2,
        num_attention_heads=2,
        max_position_embeddings=64,
        rope_parameters=dict(rope_parameters, rope_theta=theta),
    )
    rotary = LlamaRotaryEmbedding(config)
    return rotary(torch.zeros(1, dtype=torch.float32), positions[None])  # cos, sin: (1, L, head_dim)


@pytest.mark.parametrize(
    "theta, rope_parameters, scaling",
    [
        (10000.0, {"rope_type": "default"}, None),
        (500000.0, {"rope_type": "linear", "factor": 4.0}, RopeScaling("linear", 4.0)),
        (
            500000.0,
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            RopeScaling("llama3", 8.0, 1.0, 4.0, 64),
        ),
        (  # gpt-oss's YaRN: transformers' ramp unrounded, cos and sin x (0.1 ln 32 + 1)
            150000.0,
            {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 4096,
            },
            RopeScaling("yarn", 32.0, original_max_seq_len=4096, truncate=False),
        ),
        (  # the ramp's ends rounded (transformers' default, llama.cpp's only way), a given factor
            10000.0,
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "attention_factor": 1.2,
            },
            RopeScaling("yarn", 4.0, original_max_seq_len=64, attention_factor=1.2),
        ),
    ],
)
def test_rope_cos_sin_and_rotation_equal_transformers_llama(theta, rope_parameters, scaling):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    head_dim, positions = 32, torch.arange(5, 205, 3)
    hf_cos, hf_sin = _hf_llama_rotary(head_dim, theta, rope_parameters, positions)
    cos, sin = RotaryEmbedding(head_dim, theta=theta, scaling=scaling)(positions)
    assert (cos - hf_cos[0]).abs().max() < 1e-6 and (sin - hf_sin[0]).abs().max() < 1e-6

    q, k = torch.randn(2, 3, len(positions), head_dim), torch.randn(2, 1, len(positions), head_dim)
    hf_q, hf_k = apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    assert (apply_rotary(q, cos, sin) - hf_q).abs().max() < 1e-5
    assert (apply_rotary(k, cos, sin) - hf_k).abs().max() < 1e-5


def test_llama3_frequencies_equal_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    config = LlamaConfig(hidden_size=2048, num_attention_heads=16, rope_parameters=parameters)
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = rope_inverse_frequencies(128, 500000.0, RopeScaling("llama3", 32.0, 1.0, 4.0, 8192))
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    unscaled = rope_inverse_frequencies(128, 500000.0)
    assert torch.equal(ours[:4], unscaled[:4])  # the highest frequencies are kept
    assert torch.allclose(ours[-4:], unscaled[-4:] / 32.0)  # the lowest are divided by the factor


def _rotate_complex(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """Reference RoPE in float64: channel pair (i, i + rotary_dim/2) is a complex
    number multiplied by exp(1j * position * theta^(-2i/rotary_dim))."""
    x = x.double()
    half = rotary_dim // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    turn = torch.polar(
        torch.ones(len(positions), half, dtype=torch.float64), positions.double()[:, None] * freqs
    )
    pairs = torch.complex(x[..., :half], x[..., half:rotary_dim]) * turn
    return torch.cat((pairs.real, pairs.imag, x[..., rotary_dim:]), dim=-1)


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
def test_partial_rotary_against_complex_rotation(fraction):
    head_dim, positions = 32, torch.arange(0, 40)
    rotary = RotaryEmbedding(head_dim, fraction=fraction, theta=10000.0)
    x = torch.randn(2, 3, len(positions), head_dim)
    ours = apply_rotary(x, *rotary(positions))
    expected = _rotate_complex(x, positions, int(head_dim * fraction), 10000.0)
    assert (ours.double() - expected).abs().max() < 1e-5
    assert torch.equal(ours[..., int(head_dim * fraction) :], x[..., int(head_dim * fraction) :])


def test_rope_scores_depend_only_on_distance_and_batched_positions_offset():
    """q.k after RoPE depends on the distance only: shifting every position
    (a cache offset) leaves the scores unchanged; (B, L) positions work per row."""
    rotary = RotaryEmbedding(16)
    q, k = torch.randn(1, 1, 6, 16, dtype=torch.float64), torch.randn(1, 1, 6, 16, dtype=torch.float64)

    def scores(offset):
        cos, sin = rotary(torch.arange(offset, offset + 6))
        return apply_rotary(q, cos.double(), sin.double()) @ apply_rotary(
            k, cos.double(), sin.double()
        ).transpose(-1, -2)

    assert (scores(0) - scores(37)).abs().max() < 1e-4
    batched_cos, batched_sin = rotary(torch.stack((torch.arange(6), torch.arange(37, 43))))  # (2, 1, 6, 16)
    assert batched_cos.shape == (2, 1, 6, 16)
    assert torch.equal(batched_cos[1, 0], rotary(torch.arange(37, 43))[0])


def test_rope_refuses_an_odd_rotary_part():
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(10, fraction=0.5)


# ---- T5's relative bias ----


def test_relative_bias_function_equals_transformers_compute_bias():
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    for is_decoder in (False, True):
        config = T5Config(d_model=16, d_kv=4, num_heads=4, is_decoder=is_decoder)
        theirs = T5Attention(config, has_relative_attention_bias=True, layer_idx=0)
        ours = RelativePositionBias(4, 32, 128, bidirectional=not is_decoder)
        with torch.no_grad():
            theirs.relative_attention_bias.weight.normal_()
            ours.table.weight.copy_(theirs.relative_attention_bias.weight)
        # a decoder step: 5 new queries after 150 cached tokens, 155 keys
        expected = theirs.compute_bias(5, 155, past_seen_tokens=150)  # (1, H, 5, 155)
        got = ours.bias_function(query_offset=150)(torch.arange(5), torch.arange(155))
        assert torch.equal(got, expected)
