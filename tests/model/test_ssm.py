"""The selective state-space model (Mamba-style): its chunked parallel scan and its gradient
equal a naive position-by-position loop in float64, its block equals the paper's equations
written out one position at a time, decoding through the state equals the whole sequence,
and the state's size does not grow with the tokens seen."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashformer.generate.cache import make_caches
from flashformer.model.models import build
from flashformer.model.presets import preset
from flashformer.model.ssm import selective_scan, selective_step


def scan_reference(u, delta, A, B, C, D, h0):
    """h_t = exp(Δ_t A) h_(t-1) + Δ_t B_t u_t, y_t = C_t · h_t + D u_t, one position at a time."""
    h, ys = h0, []
    for t in range(u.shape[1]):
        h = (
            torch.exp(delta[:, t, :, None] * A) * h
            + delta[:, t, :, None] * B[:, t, None, :] * u[:, t, :, None]
        )
        ys.append((h * C[:, t, None, :]).sum(-1) + D * u[:, t])
    return torch.stack(ys, dim=1), h


def random_inputs(batch=2, length=23, inner=5, n=4, requires_grad=False):
    g = torch.Generator().manual_seed(0)

    def rand(*shape, low=-1.0, high=1.0):
        return (torch.rand(*shape, generator=g, dtype=torch.float64) * (high - low) + low).requires_grad_(
            requires_grad
        )

    return dict(
        u=rand(batch, length, inner),
        delta=rand(batch, length, inner, low=0.01, high=2.0),
        A=rand(inner, n, low=-8.0, high=-0.5),
        B=rand(batch, length, n),
        C=rand(batch, length, n),
        D=rand(inner),
        h0=rand(batch, inner, n),
    )


@pytest.mark.parametrize("length", [1, 2, 7, 16, 23, 64])
def test_the_parallel_scan_equals_the_sequential_recurrence_in_float64(length):
    inputs = random_inputs(length=length)
    y, last = selective_scan(**inputs)
    y_ref, last_ref = scan_reference(**inputs)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(last, last_ref, rtol=1e-12, atol=1e-12)
    y0, _ = selective_scan(**dict(inputs, h0=None))  # no state: zeros
    torch.testing.assert_close(y0, scan_reference(**dict(inputs, h0=torch.zeros_like(inputs["h0"])))[0])


def test_the_scans_backward_equals_autograd_through_the_loop():
    inputs = random_inputs(length=19, requires_grad=True)
    weights = torch.randn(2, 19, 5, dtype=torch.float64)
    y, last = selective_scan(**inputs)
    ours = torch.autograd.grad((y * weights).sum() + last.sum(), list(inputs.values()))
    y_ref, last_ref = scan_reference(**inputs)
    theirs = torch.autograd.grad((y_ref * weights).sum() + last_ref.sum(), list(inputs.values()))
    for name, a, b in zip(inputs, ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_the_step_equals_the_parallel_form_position_by_position():
    inputs = random_inputs(length=9)
    y, _ = selective_scan(**inputs)
    h = inputs["h0"]
    for t in range(9):
        per_t = {k: inputs[k][:, t] for k in ("u", "delta", "B", "C")}
        y_t, h = selective_step(**per_t, A=inputs["A"], D=inputs["D"], h=h)
        torch.testing.assert_close(y_t, y[:, t], rtol=1e-12, atol=1e-12)


def tiny_model(**changes):
    torch.manual_seed(0)
    config = preset("mamba-tiny", **dict(dict(d_model=8, n_layers=2, vocab_size=40, ssm_state=4), **changes))
    model = build(config).double().eval()
    with torch.no_grad():  # larger steps than the initialization's, so that the state matters
        for block in model.layers:
            block.dt_proj.bias.uniform_(-1.0, 1.0)
    return model


def block_reference(block, x):
    """A MambaBlock written out from the paper, one position at a time, float64."""
    u, z = (block.norm(x) @ block.in_proj.weight.T).chunk(2, dim=-1)  # (B, L, d_inner)
    width = block.conv.weight.shape[-1]
    padded = F.pad(u, (0, 0, width - 1, 0))  # zeros before the first position
    A = -torch.exp(block.A_log)
    h = x.new_zeros(x.shape[0], block.inner, block.n_state)
    out = []
    for t in range(x.shape[1]):
        window = padded[:, t : t + width]  # (B, width, d_inner): positions t-width+1 .. t
        conv = (window * block.conv.weight[:, 0].T).sum(1) + block.conv.bias
        ut = F.silu(conv)  # (B, d_inner)
        dt, Bt, Ct = (ut @ block.x_proj.weight.T).split((block.dt_rank, block.n_state, block.n_state), -1)
        delta = F.softplus(dt @ block.dt_proj.weight.T + block.dt_proj.bias)
        h = torch.exp(delta[..., None] * A) * h + (delta * ut)[..., None] * Bt[:, None]
        y = (h * Ct[:, None]).sum(-1) + block.D * ut
        out.append((y * F.silu(z[:, t])) @ block.out_proj.weight.T)
    return x + torch.stack(out, dim=1)


def test_a_block_equals_the_papers_equations_one_position_at_a_time():
    model = tiny_model()
    x = torch.randn(2, 11, 8, dtype=torch.float64)
    for block in model.layers:
        torch.testing.assert_close(block(x, None), block_reference(block, x), rtol=1e-12, atol=1e-12)


def test_stepping_through_the_states_equals_the_whole_sequence():
    model = tiny_model()
    ids = torch.randint(0, 40, (3, 14))
    whole = model(ids).logits
    states = model.new_states(3, "cpu")
    pieces = [model(ids[:, :4], kv_caches=states).logits]  # a prompt, in two chunks, then steps
    pieces.append(model(ids[:, 4:9], kv_caches=states, cache_position=4).logits)
    for t in range(9, 14):
        pieces.append(model(ids[:, t : t + 1], kv_caches=states, cache_position=t).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-12, atol=1e-12)


def test_the_decoding_state_does_not_grow_with_the_tokens_seen():
    model = tiny_model().float()
    sizes = {}
    for n in (3, 50):
        states = make_caches(model, 2, n + 1)
        model(torch.randint(0, 40, (2, n)), kv_caches=states)
        sizes[n] = sum(s.nbytes for s in states)
    inner, n_state, width = 16, 4, 4  # d_inner = 2 * d_model; ssm_conv 4
    assert sizes[3] == sizes[50] == 2 * 2 * inner * (width - 1 + n_state) * 4


def test_generation_through_states_equals_recomputing_the_prefix():
    model = tiny_model().float()
    ids = model.generate(torch.randint(0, 40, (1, 5)), max_new_tokens=6)
    for t in range(5, 11):
        assert ids[0, t] == model(ids[:, :t]).logits[0, -1].argmax()
