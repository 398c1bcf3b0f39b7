"""The position-wise feed-forward sub-layers of a dense block: down(act(up(x))) (BERT, GPT-2,
T5 v1.0) and the gated forms, SwiGLU and gated-GELU (LLaMA, T5 v1.1), with gate and up apart or
as one projection (Phi-3). A mixture of experts (experts.py) is made of the gated one.
layers.make_feed_forward picks one at construction."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from flashformer.kernels.cpu import Linear

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
