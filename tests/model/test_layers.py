"""Layers against float64 references written here from the definitions."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import TestCache, perturbed

from flashformer.model.config import ModelConfig
from flashformer.model.feed_forward import FeedForward, FusedGatedFeedForward, GatedFeedForward
from flashformer.model.layers import (
    CrossAttention,
    DecoderBlock,
    EncoderBlock,
    MultiHeadAttention,
    RMSNorm,
)
from flashformer.model.positional import RelativePositionBias, RotaryEmbedding, alibi_slopes, apply_rotary


def config(**changes) -> ModelConfig:
    base = dict(
        d_model=24, n_heads=4, d_ff=40, vocab_size=50, max_seq_len=64, dropout=0.0, attention_dropout=0.0
    )
    return ModelConfig(**dict(base, **changes))


# ---- norms and feed-forward ----


def test_rms_norm_against_float64():
    norm = perturbed(RMSNorm(24, eps=1e-6))
    x = torch.randn(3, 5, 24) * 4
    x64 = x.double()
    expected = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    assert (norm(x).double() - expected).abs().max() < 1e-5
    low = norm.bfloat16()(x.bfloat16())  # a bf16 model: the statistic in float32, the result in bf16
    assert low.dtype == torch.bfloat16
    assert ((low.double() - expected).abs() <= expected.abs() * 2**-6 + 1e-2).all()


def _gelu_exact(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def _gelu_tanh(x):  # GPT-2's formula
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize(
    "activation, reference", [("relu", torch.relu), ("gelu", _gelu_exact), ("gelu_tanh", _gelu_tanh)]
)
def test_feed_forward_against_float64(activation, reference):
    ffn = perturbed(FeedForward(24, 40, activation, bias=True))
    x = torch.randn(2, 7, 24)
    x64 = x.double()
    hidden = reference(x64 @ ffn.up.weight.double().T + ffn.up.bias.double())
    expected = hidden @ ffn.down.weight.double().T + ffn.down.bias.double()
    assert (ffn(x).double() - expected).abs().max() < 1e-4


@pytest.mark.parametrize("activation, reference", [("silu", F.silu), ("gelu_tanh", _gelu_tanh)])
def test_gated_feed_forward_against_float64(activation, reference):
    ffn = perturbed(GatedFeedForward(24, 40, activation, bias=False))
    x64 = torch.randn(2, 7, 24, dtype=torch.float64)
    gate, up, down = (m.weight.double() for m in (ffn.gate, ffn.up, ffn.down))
    expected = (reference(x64 @ gate.T) * (x64 @ up.T)) @ down.T
    assert (ffn(x64.float()).double() - expected).abs().max() < 1e-4


def test_fused_gated_feed_forward_reads_gate_rows_first():
    """Phi-3's gate_up_proj: rows [0, d_ff) are the gate, [d_ff, 2 d_ff) the up projection."""
    ffn = perturbed(FusedGatedFeedForward(24, 40, "silu", bias=True))
    x64 = torch.randn(2, 7, 24, dtype=torch.float64)
    fused = x64 @ ffn.gate_up.weight.double().T + ffn.gate_up.bias.double()
    gate, up = fused[..., :40], fused[..., 40:]
    expected = (F.silu(gate) * up) @ ffn.down.weight.double().T + ffn.down.bias.double()
    assert (ffn(x64.float()).double() - expected).abs().max() < 1e-4


def test_attention_out_bias_apart_from_the_qkv_bias():
    """Qwen2: biases on q, k and v, none on the output projection."""
    attn = MultiHeadAttention(config(attention_bias=True, attention_out_bias=False), causal=True)
    assert attn.qkv.bias is not None and attn.out.bias is None


# ---- attention against a float64 reference ----


def reference_attention(q, k, v, *, causal=False, key_padding_mask=None, scale, bias=None, alibi=None):
    """softmax(scale q k^T + bias) v in float64, GQA by repeating heads, bottom-right causal."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = scale * q @ k.transpose(-1, -2)  # (B, H, Lq, Lk)
    lq, lk = scores.shape[-2:]
    i, j = torch.arange(lq)[:, None] + (lk - lq), torch.arange(lk)[None, :]
    if bias is not None:
        scores = scores + bias.double()
    if alibi is not None:
        scores = scores - alibi.double()[:, None, None] * (i - j).abs()
    if causal:
        scores = scores.masked_fill(j > i, float("-inf"))
    if key_padding_mask is not None:
        scores = scores.masked_fill(~key_padding_mask[:, None, None, :], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def split_heads(attn: MultiHeadAttention, x):
    q, k, v = (x @ attn.qkv.weight.T + attn.qkv.bias).split(attn.split_sizes, dim=-1)
    batch, length = x.shape[:2]

    def heads(t, n):
        return t.view(batch, length, n, attn.head_dim).transpose(1, 2)

    return heads(q, attn.n_heads), heads(k, attn.n_kv_heads), heads(v, attn.n_kv_heads)


def merge_heads(attn, out):
    batch, _, length, _ = out.shape
    return (
        out.transpose(1, 2).reshape(batch, length, -1) @ attn.out.weight.double().T + attn.out.bias.double()
    )


@pytest.mark.parametrize("backend", ["auto", "eager", "flash"])
@pytest.mark.parametrize("n_kv_heads, causal", [(None, False), (2, True), (1, True)])
def test_self_attention_against_float64(backend, n_kv_heads, causal):
    attn = perturbed(
        MultiHeadAttention(config(n_kv_heads=n_kv_heads, attention_backend=backend), causal=causal)
    )
    x = torch.randn(3, 9, 24)
    padding = torch.ones(3, 9, dtype=torch.bool)
    padding[1, 6:] = False
    padding[2, 3:] = False
    with torch.no_grad():
        got = attn(x, key_padding_mask=padding)
        q, k, v = split_heads(attn, x)
        expected = merge_heads(
            attn, reference_attention(q, k, v, causal=causal, key_padding_mask=padding, scale=6**-0.5)
        )
    assert (got.double() - expected).abs().max() < 1e-4


def test_self_attention_with_rope_alibi_and_relative_bias():
    x = torch.randn(2, 10, 24)
    with torch.no_grad():
        attn = perturbed(MultiHeadAttention(config(n_kv_heads=2), causal=True))
        cos, sin = RotaryEmbedding(6)(torch.arange(10))
        q, k, v = split_heads(attn, x)
        expected = reference_attention(
            apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, causal=True, scale=6**-0.5
        )
        assert (attn(x, rotary=(cos, sin)).double() - merge_heads(attn, expected)).abs().max() < 1e-4

        slopes = alibi_slopes(4)
        expected = reference_attention(q, k, v, causal=True, scale=6**-0.5, alibi=slopes)
        assert (attn(x, alibi_slopes=slopes).double() - merge_heads(attn, expected)).abs().max() < 1e-4

        attn.scale = 1.0  # as T5
        relative = perturbed(RelativePositionBias(4, 8, 16, bidirectional=False))
        bias = relative.bias_function()(torch.arange(10), torch.arange(10))  # (1, H, 10, 10)
        expected = reference_attention(q, k, v, causal=True, scale=1.0, bias=bias)
        assert (
            attn(x, bias=relative.bias_function()).double() - merge_heads(attn, expected)
        ).abs().max() < 1e-4


def test_relative_bias_table_gets_its_gradient_through_attention():
    attn = perturbed(MultiHeadAttention(config(attention_backend="flash", attention_scale=1.0), causal=False))
    relative = perturbed(RelativePositionBias(4, 8, 16))
    x = torch.randn(2, 10, 24)
    attn(x, bias=relative.bias_function()).square().sum().backward()
    flash_grad = relative.table.weight.grad.clone()
    relative.table.weight.grad = None
    attn.backend = "eager"
    attn(x, bias=relative.bias_function()).square().sum().backward()
    assert flash_grad.abs().sum() > 0
    assert (flash_grad - relative.table.weight.grad).abs().max() < 1e-3


def test_cross_attention_against_float64_and_precomputed_memory():
    cross = perturbed(CrossAttention(config(n_kv_heads=2)))
    x, memory = torch.randn(2, 5, 24), torch.randn(2, 8, 24)
    memory_padding = torch.tensor([[True] * 8, [True] * 4 + [False] * 4])
    with torch.no_grad():
        got = cross(x, memory, memory_padding_mask=memory_padding)
        q = (x @ cross.q.weight.T + cross.q.bias).view(2, 5, 4, 6).transpose(1, 2)
        k, v = (memory @ cross.kv.weight.T + cross.kv.bias).view(2, 8, 2, 2, 6).unbind(2)
        out = reference_attention(
            q, k.transpose(1, 2), v.transpose(1, 2), key_padding_mask=memory_padding, scale=6**-0.5
        )
        expected = (
            out.transpose(1, 2).reshape(2, 5, 24) @ cross.out.weight.double().T + cross.out.bias.double()
        )
        assert (got.double() - expected).abs().max() < 1e-4
        again = cross(x, memory_padding_mask=memory_padding, memory_kv=cross.project_memory(memory))
        assert torch.equal(got, again)


@pytest.mark.parametrize("rope", [False, True])
def test_kv_cache_hook_decodes_like_the_full_sequence(rope):
    """Prefill 6 tokens, then 1, then 3: the same outputs as all 10 at once."""
    attn = perturbed(MultiHeadAttention(config(n_kv_heads=2), causal=True))
    rotary = RotaryEmbedding(6)
    x = torch.randn(2, 10, 24)

    def args(start, end):
        return {"rotary": rotary(torch.arange(start, end))} if rope else {}

    with torch.no_grad():
        full = attn(x, **args(0, 10))
        cache, pieces = TestCache(), []
        for start, end in ((0, 6), (6, 7), (7, 10)):
            pieces.append(attn(x[:, start:end], kv_cache=cache, cache_position=start, **args(start, end)))
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-5


# ---- blocks ----


@pytest.mark.parametrize("prenorm", [True, False])
def test_encoder_block_is_the_residual_composition(prenorm):
    block = perturbed(EncoderBlock(config(prenorm=prenorm)))
    x = torch.randn(2, 7, 24)
    with torch.no_grad():
        if prenorm:
            h = x + block.attn(block.attn_norm(x))
            expected = h + block.ffn(block.ffn_norm(h))
        else:
            h = block.attn_norm(x + block.attn(x))
            expected = block.ffn_norm(h + block.ffn(h))
        assert torch.allclose(block(x), expected, atol=1e-6)


def test_decoder_block_with_cross_attention_is_the_residual_composition():
    block = perturbed(DecoderBlock(config(norm="rmsnorm"), cross_attention=True))
    x, memory = torch.randn(2, 7, 24), torch.randn(2, 4, 24)
    with torch.no_grad():
        h = x + block.attn(block.attn_norm(x))
        h = h + block.cross_attn(block.cross_norm(h), memory)
        expected = h + block.ffn(block.ffn_norm(h))
        assert torch.allclose(block(x, memory=memory), expected, atol=1e-6)


# ---- low precision ----


@pytest.mark.parametrize("backend", ["auto", "flash", "torch"])
def test_attention_layer_under_bf16_autocast(backend):
    """Autocast must not reach inside the attention backends (their matmuls
    would run in bf16, or fail); the layer returns what autocast would."""
    attn = perturbed(MultiHeadAttention(config(attention_backend=backend), causal=True))
    x = torch.randn(2, 9, 24, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(x)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    with torch.no_grad():
        reference = attn(x)
    assert (out.float() - reference).abs().max() < 0.05 * reference.abs().max()
