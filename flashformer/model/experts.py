"""A mixture of experts in place of a block's feed-forward (config.n_expert > 0: Qwen3 MoE).

Each token's row is scored by a router (one linear layer, no bias), the scores become
probabilities by a softmax over all experts in float32, and the token runs only the
n_expert_used most probable experts, its output their outputs weighted by those probabilities
(divided by their sum first with config.expert_weights_norm). Each expert is a gated
feed-forward (SwiGLU) of its own, `GatedFeedForward` with expert_ffn_hidden channels.

The experts are per-expert modules, so that each of their projections is a layer as any other:
an nn.Linear in float, a QuantizedLinear where a GGUF file's blocks or model.quantize put one
(the 3-D expert tensors of a GGUF file are sliced per expert, never dequantized).

Only the chosen experts run: the rows are grouped by expert (each expert gathers its rows,
runs once over them and adds its weighted output back to them), so a decode step of one token
reads n_expert_used experts' weights, and a prompt of many rows runs each expert at most once.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flashformer.kernels.cpu import Linear
from flashformer.model.config import ModelConfig
from flashformer.model.feed_forward import GatedFeedForward


class MixtureOfExperts(nn.Module):
    """router -> softmax (float32) -> top-k experts -> their SwiGLU outputs, weighted and summed.

    router: Linear(d_model, n_expert, bias=False); experts: n_expert GatedFeedForward modules of
    width expert_ffn_hidden, without biases (their projections gate, up, down).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_expert, self.n_expert_used = config.n_expert, config.n_expert_used
        self.weights_norm = config.expert_weights_norm
        self.router = Linear(config.d_model, config.n_expert, bias=False)
        self.experts = nn.ModuleList(
            GatedFeedForward(
                config.d_model, config.expert_ffn_hidden, config.activation, False, config.activation_dropout
            )
            for _ in range(config.n_expert)
        )

    def route(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """rows (N, d_model) -> (weights (N, k) in rows' dtype, experts (N, k) int64): each row's
        chosen experts, most probable first, and the weights of their outputs."""
        probs = torch.softmax(self.router(rows).float(), dim=-1)  # (N, n_expert), float32
        weights, experts = probs.topk(self.n_expert_used, dim=-1)  # (N, k) each
        if self.weights_norm:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(rows.dtype), experts

    def forward(self, x: Tensor) -> Tensor:  # (B, L, d_model) -> (B, L, d_model)
        rows = x.reshape(-1, x.shape[-1])  # (N, d_model), N = B * L
        weights, experts = self.route(rows)  # (N, k) each
        # the (row, slot) pairs grouped by expert: a stable sort of the flat choices
        choices = experts.reshape(-1)  # (N * k,)
        order = choices.argsort(stable=True)  # (N * k,) pair indices, expert by expert
        counts = torch.bincount(choices, minlength=self.n_expert).tolist()  # pairs per expert
        row_of = order // self.n_expert_used  # (N * k,) the row of each sorted pair
        weight_of = weights.reshape(-1)[order].unsqueeze(-1)  # (N * k, 1)
        out = torch.zeros_like(rows)  # (N, d_model)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:  # not chosen by any row: not run
                continue
            chosen = row_of[start : start + count]  # (count,) rows that chose this expert
            y = self.experts[expert](rows.index_select(0, chosen))  # (count, d_model)
            y = (y * weight_of[start : start + count]).to(out.dtype)  # under autocast y is bf16
            out.index_add_(0, chosen, y)
            start += count
        return out.view_as(x)

    def extra_repr(self) -> str:
        return (
            f"n_expert={self.n_expert}, n_expert_used={self.n_expert_used}, weights_norm={self.weights_norm}"
        )
