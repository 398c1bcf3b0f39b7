"""The position-wise feed-forward sub-layers of a dense block: down(act(up(x))) (BERT, GPT-2,
T5 v1.0) and the gated forms, SwiGLU and gated-GELU (LLaMA, T5 v1.1), with gate and up apart or
as one projection (Phi-3), and gpt-oss's clamped SwiGLU. A mixture of experts (experts.py) is
made of the gated ones (gated_feed_forward picks which). layers.make_feed_forward picks one at
construction."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from flashformer.kernels.cpu import Linear
from flashformer.model.config import ModelConfig

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,  # exact, with erf (BERT)
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),  # GPT-2's "gelu_new", T5 v1.1's gated-gelu
    "silu": nn.SiLU,  # SwiGLU's gate (LLaMA)
}


class FeedForward(nn.Module):
    """down(act(up(x))): the position-wise MLP of BERT, GPT-2 and T5 v1.0."""

    def __init__(self, d_model: int, d_ff: int, activation: str, bias: bool, dropout: float = 0.0):
        super().__init__()
        self.up = Linear(d_model, d_ff, bias=bias)
        self.act = ACTIVATIONS[activation]()
        self.dropout = nn.Dropout(dropout)
        self.down = Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:  # (B, L, d_model) -> (B, L, d_model)
        return self.down(self.dropout(self.act(self.up(x))))


class GatedFeedForward(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (LLaMA) with silu, gated-gelu (T5 v1.1) with gelu_tanh."""

    def __init__(self, d_model: int, d_ff: int, activation: str, bias: bool, dropout: float = 0.0):
        super().__init__()
        self.gate = Linear(d_model, d_ff, bias=bias)
        self.up = Linear(d_model, d_ff, bias=bias)
        self.act = ACTIVATIONS[activation]()
        self.dropout = nn.Dropout(dropout)
        self.down = Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:  # (B, L, d_model) -> (B, L, d_model)
        return self.down(self.dropout(self.act(self.gate(x)) * self.up(x)))


class ClampedGatedFeedForward(GatedFeedForward):
    """gpt-oss's clamped SwiGLU: down(g * sigmoid(alpha * g) * (u + 1)) with g = min(gate(x),
    limit) and u = clamp(up(x), -limit, limit) (transformers' GptOssExperts, llama.cpp's
    swiglu_oai)."""

    def __init__(self, d_model: int, d_ff: int, bias: bool, limit: float, alpha: float, dropout: float = 0.0):
        super().__init__(d_model, d_ff, "silu", bias, dropout)
        self.limit, self.alpha = limit, alpha

    def forward(self, x: Tensor) -> Tensor:  # (B, L, d_model) -> (B, L, d_model)
        gate = self.gate(x).clamp(max=self.limit)  # (B, L, d_ff)
        up = self.up(x).clamp(-self.limit, self.limit)  # (B, L, d_ff)
        return self.down(self.dropout(gate * torch.sigmoid(gate * self.alpha) * (up + 1)))

    def extra_repr(self) -> str:
        return f"limit={self.limit}, alpha={self.alpha}"


def gated_feed_forward(config: ModelConfig, d_ff: int, bias: bool) -> GatedFeedForward:
    """A gated feed-forward of width d_ff as config says: clamped (config.swiglu_limit) or plain."""
    if config.swiglu_limit is not None:
        return ClampedGatedFeedForward(
            config.d_model, d_ff, bias, config.swiglu_limit, config.swiglu_alpha, config.activation_dropout
        )
    return GatedFeedForward(config.d_model, d_ff, config.activation, bias, config.activation_dropout)


class FusedGatedFeedForward(nn.Module):
    """GatedFeedForward with gate and up as one projection, gate rows first (Phi-3's
    gate_up_proj): one product over x instead of two, and the checkpoint's tensor as it is."""

    def __init__(self, d_model: int, d_ff: int, activation: str, bias: bool, dropout: float = 0.0):
        super().__init__()
        self.gate_up = Linear(d_model, 2 * d_ff, bias=bias)
        self.act = ACTIVATIONS[activation]()
        self.dropout = nn.Dropout(dropout)
        self.down = Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:  # (B, L, d_model) -> (B, L, d_model)
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # each (B, L, d_ff)
        return self.down(self.dropout(self.act(gate) * up))
