"""LFM2's short convolution (model/short_conv.py): the causal depthwise convolution over a whole
prompt and one token at a time, each against a plain float64 loop over the definition, and the
layer's cache (its last K - 1 inputs) continuing a sequence exactly."""

from __future__ import annotations

import pytest
import torch

from flashformer.generate.cache import RecurrentState
from flashformer.model.config import ModelConfig
from flashformer.model.short_conv import ShortConv, causal_conv1d


def reference_conv(u: torch.Tensor, weight: torch.Tensor, before: torch.Tensor | None) -> torch.Tensor:
    """y_t = sum_j w[K-1-j] u_(t-j) in float64, u before the sequence = `before` (or zeros)."""
    u, weight = u.double(), weight.double()
    batch, channels, length = u.shape
    width = weight.shape[-1]
    history = (
        torch.zeros(batch, channels, width - 1, dtype=torch.float64) if before is None else before.double()
    )
    full = torch.cat((history, u), dim=2)
    y = torch.zeros(batch, channels, length, dtype=torch.float64)
    for t in range(length):
        for j in range(width):  # tap j reads the input j tokens back
            y[:, :, t] += weight[:, 0, width - 1 - j] * full[:, :, t + width - 1 - j]
    return y


@pytest.mark.parametrize("width", [2, 3, 4])
def test_the_prompt_form_and_the_step_form_equal_the_float64_loop(width):
    torch.manual_seed(0)
    u, weight = torch.randn(2, 5, 9), torch.randn(5, 1, width)
    want = reference_conv(u, weight, None)
    whole, state = causal_conv1d(u, weight, None, None)
    assert torch.allclose(whole.double(), want, atol=1e-5)
    assert torch.equal(state, u[:, :, -(width - 1) :])  # the last K - 1 inputs
    state, steps = None, []
    for t in range(u.shape[2]):  # decoding: one token at a time, the state carried
        y, state = causal_conv1d(u[:, :, t : t + 1], weight, None, state)
        steps.append(y)
    assert torch.allclose(torch.cat(steps, dim=2).double(), want, atol=1e-5)
    before = torch.randn(2, 5, width - 1)  # a prompt after earlier tokens (a later chunk)
    continued, _ = causal_conv1d(u, weight, None, before)
    assert torch.allclose(continued.double(), reference_conv(u, weight, before), atol=1e-5)


def config(**changes) -> ModelConfig:
    values = dict(
        vocab_size=50, d_model=16, n_layers=2, n_heads=2, d_ff=32, layer_types=("conv", "full_attention")
    )
    return ModelConfig(**{**values, **changes})


def test_the_layer_with_its_state_equals_the_layer_over_the_whole_sequence():
    torch.manual_seed(1)
    layer = ShortConv(config(short_conv_kernel=4)).eval()
    x = torch.randn(2, 11, 16)
    with torch.no_grad():
        want = layer(x)
        state = RecurrentState(conv=torch.zeros(2, 16, 3))
        parts = [layer(x[:, :6], kv_cache=state, cache_position=0)]  # the prompt at once
        for t in range(6, 11):  # then decoding
            parts.append(layer(x[:, t : t + 1], kv_cache=state, cache_position=t))
    assert state.length == 11
    assert torch.allclose(torch.cat(parts, dim=1), want, atol=1e-6)


def test_a_padded_position_adds_nothing_to_the_state():
    """Left padding: the real tokens' outputs equal those of the unpadded row."""
    torch.manual_seed(2)
    layer = ShortConv(config()).eval()
    x = torch.randn(1, 5, 16)
    padded = torch.cat((torch.randn(1, 3, 16), x), dim=1)
    mask = torch.tensor([[False] * 3 + [True] * 5])
    with torch.no_grad():
        assert torch.allclose(layer(padded, key_padding_mask=mask)[:, 3:], layer(x), atol=1e-6)


def test_a_state_that_cannot_continue_is_refused():
    layer = ShortConv(config())
    with pytest.raises(ValueError, match="keeps its last 2 inputs in a RecurrentState"):
        layer(torch.randn(1, 2, 16), kv_cache=object())
    state = RecurrentState(conv=torch.zeros(1, 16, 2))
    with pytest.raises(ValueError, match="cannot rewind or skip; got cache_position=3"):
        layer(torch.randn(1, 2, 16), kv_cache=state, cache_position=3)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(short_conv_kernel=1), r"short_conv_kernel must be an int >= 2; got 1"),
        (dict(layer_types=("conv", "mamba")), r"layer_types must give one of"),
        (dict(attention_kind="linear"), r"layer_types=\('conv', 'full_attention'\)"),
    ],
)
def test_bad_conv_settings_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        config(**changes)
