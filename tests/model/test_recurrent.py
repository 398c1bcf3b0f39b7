"""The LSTM and GRU language models: their layers equal the textbook equations in float64,
decoding token by token through the states equals the whole sequence in one call, and the
state's size does not grow with the tokens seen."""

from __future__ import annotations

import pytest
import torch

from flashformer.generate.cache import RecurrentState, make_caches
from flashformer.model.models import build
from flashformer.model.presets import preset


def lstm_reference(x, weight_ih, weight_hh, bias_ih, bias_hh):
    """x (B, L, d) float64 -> h (B, L, H): i, f, g, o gates, c = f c + i g, h = o tanh(c)."""
    batch, length, _ = x.shape
    hidden = weight_hh.shape[1]
    h = x.new_zeros(batch, hidden)
    c = x.new_zeros(batch, hidden)
    out = []
    for t in range(length):
        gates = x[:, t] @ weight_ih.T + bias_ih + h @ weight_hh.T + bias_hh
        i, f, g, o = gates.chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        out.append(h)
    return torch.stack(out, dim=1)


def gru_reference(x, weight_ih, weight_hh, bias_ih, bias_hh):
    """x (B, L, d) float64 -> h (B, L, H): r, z, n; h = (1 - z) n + z h."""
    batch, length, _ = x.shape
    h = x.new_zeros(batch, weight_hh.shape[1])
    out = []
    for t in range(length):
        xr, xz, xn = (x[:, t] @ weight_ih.T + bias_ih).chunk(3, dim=-1)
        hr, hz, hn = (h @ weight_hh.T + bias_hh).chunk(3, dim=-1)
        r, z = torch.sigmoid(xr + hr), torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        h = (1 - z) * n + z * h
        out.append(h)
    return torch.stack(out, dim=1)


REFERENCES = {"lstm": lstm_reference, "gru": gru_reference}


def tiny(arch: str, **changes):
    torch.manual_seed(0)
    config = preset(f"{arch}-tiny", **dict(dict(d_model=16, n_layers=2, vocab_size=50), **changes))
    return build(config).double().eval()


@pytest.mark.parametrize("arch", ["lstm", "gru"])
def test_layers_equal_the_textbook_equations_in_float64(arch):
    model = tiny(arch)
    ids = torch.randint(0, 50, (2, 9))
    x = model.tokens(ids)
    for layer in model.layers:
        rnn = layer.rnn
        expected = REFERENCES[arch](x, rnn.weight_ih_l0, rnn.weight_hh_l0, rnn.bias_ih_l0, rnn.bias_hh_l0)
        x = layer(x, None)
        torch.testing.assert_close(x, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model(ids).logits, x @ model.tokens.weight.T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("arch", ["lstm", "gru"])
def test_stepping_through_the_states_equals_the_whole_sequence(arch):
    model = tiny(arch)
    ids = torch.randint(0, 50, (3, 12))
    whole = model(ids).logits  # (B, L, V)
    states = model.new_states(3, "cpu")
    steps = [model(ids[:, :5], kv_caches=states).logits]  # a prompt of 5, then one token at a time
    for t in range(5, 12):
        steps.append(model(ids[:, t : t + 1], kv_caches=states, cache_position=t).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-12, atol=1e-12)
    assert all(s.length == 12 for s in states)


@pytest.mark.parametrize("arch", ["lstm", "gru"])
def test_the_decoding_state_does_not_grow_with_the_tokens_seen(arch):
    model = tiny(arch).float()
    sizes = {}
    for n in (4, 64):
        states = make_caches(model, 2, n + 1)  # what generate() makes
        model(torch.randint(0, 50, (2, n)), kv_caches=states)
        sizes[n] = sum(s.nbytes for s in states)
    per_layer = 2 * 16 * 4 * (2 if arch == "lstm" else 1)  # B d float32, h (and c)
    assert sizes[4] == sizes[64] == 2 * per_layer


@pytest.mark.parametrize("arch", ["lstm", "gru"])
def test_generation_through_states_equals_recomputing_the_prefix(arch):
    model = tiny(arch).float()
    prompt = torch.randint(0, 50, (1, 6))
    ids = model.generate(prompt, max_new_tokens=8)
    for t in range(6, 14):  # greedy: each new token is the argmax after the whole prefix, no state
        assert ids[0, t] == model(ids[:, :t]).logits[0, -1].argmax()


def test_states_refuse_a_position_they_do_not_hold_and_padding():
    model = tiny("lstm")
    states = model.new_states(1, "cpu")
    model(torch.tensor([[1, 2, 3]]), kv_caches=states)
    with pytest.raises(ValueError, match="cannot rewind"):
        model(torch.tensor([[4]]), kv_caches=states, cache_position=2)
    with pytest.raises(ValueError, match="takes no padding"):
        model(torch.tensor([[1, 2]]), attention_mask=torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="one RecurrentState per layer"):
        model(torch.tensor([[1]]), kv_caches=[RecurrentState()])


def test_a_transformer_preset_turned_recurrent_trains_without_a_hugging_face_family():
    config = preset("gpt-mini", arch="lstm")  # `flashformer train --model.arch lstm`
    assert config.hf_model_type is None and build(config).num_parameters() > 0
    with pytest.raises(ValueError, match="no Hugging Face family"):
        tiny("gru").save_pretrained("unused")
