"""A mixture of experts in place of a block's feed-forward (config.n_expert > 0: Qwen3 MoE,
gpt-oss).

Each token's row is scored by a router (one linear layer; gpt-oss's has a bias), and the token
runs only the n_expert_used best-scored experts, its output their outputs weighted. The weights
follow config.expert_gating: "softmax" (Qwen3 MoE) takes a softmax over all experts in float32,
then the top k probabilities (divided by their sum with config.expert_weights_norm);
"topk_softmax" (gpt-oss, in transformers' order) takes the top k logits, then a softmax over
those k. Each expert is a gated feed-forward of its own with expert_ffn_hidden channels
(feed_forward.gated_feed_forward: SwiGLU, or gpt-oss's clamped SwiGLU; biases with ffn_bias).

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
from flashformer.model.feed_forward import gated_feed_forward


class MixtureOfExperts(nn.Module):
    """router -> top-k experts (softmax then top k, or top k then softmax) -> their gated
    feed-forwards' outputs, weighted and summed.

    router: Linear(d_model, n_expert, bias=expert_router_bias); experts: n_expert gated
    feed-forwards of width expert_ffn_hidden (their projections gate, up, down, with ffn_bias).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_expert, self.n_expert_used = config.n_expert, config.n_expert_used
        self.weights_norm, self.gating = config.expert_weights_norm, config.expert_gating
        self.router = Linear(config.d_model, config.n_expert, bias=config.expert_router_bias)
        self.experts = nn.ModuleList(
            gated_feed_forward(config, config.expert_ffn_hidden, config.ffn_bias)
            for _ in range(config.n_expert)
        )

    def route(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """rows (N, d_model) -> (weights (N, k) in rows' dtype, experts (N, k) int64): each row's
        chosen experts, most probable first, and the weights of their outputs."""
        logits = self.router(rows).float()  # (N, n_expert), float32
        if self.gating == "topk_softmax":  # gpt-oss: the k best logits, a softmax over them
            top, experts = logits.topk(self.n_expert_used, dim=-1)  # (N, k) each
            return torch.softmax(top, dim=-1).to(rows.dtype), experts
        weights, experts = torch.softmax(logits, dim=-1).topk(self.n_expert_used, dim=-1)  # (N, k) each
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
            f"n_expert={self.n_expert}, n_expert_used={self.n_expert_used}, gating={self.gating!r}, "
            f"weights_norm={self.weights_norm}"
        )
