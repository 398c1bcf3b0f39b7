"""The heads that sit on an encoder's last hidden state: BERT's [CLS] pooler
and its masked-LM head."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from flashformer.config import ModelConfig
from flashformer.kernels.cpu import Linear, linear
from flashformer.layers import ACTIVATIONS, make_norm


class Pooler(nn.Module):
    """tanh(dense(h[:, 0])): BERT's sentence vector from the [CLS] token."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense = Linear(config.d_model, config.d_model)

    def forward(self, hidden: Tensor) -> Tensor:  # (B, L, d_model) -> (B, d_model)
        return torch.tanh(self.dense(hidden[:, 0]))


class MaskedLMHead(nn.Module):
    """BERT's masked-LM head: dense, activation, norm, then the (usually tied)
    output projection plus a per-token bias."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense = Linear(config.d_model, config.d_model)
        self.act = ACTIVATIONS[config.activation]()
        self.norm = make_norm(config)
        self.decoder = (
            None if config.tie_word_embeddings else Linear(config.d_model, config.vocab_size, bias=False)
        )
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden: Tensor, token_embedding: Tensor) -> Tensor:  # (B, L, d) -> (B, L, vocab)
        weight = token_embedding if self.decoder is None else self.decoder.weight
        return linear(self.norm(self.act(self.dense(hidden))), weight, self.bias)
