"""Gemma 4's per-layer inputs: beside the residual stream, every layer receives a small vector of
its own for each token, and gates it into its output.

    per_layer = PerLayerInputs(config)(input_ids, embedded)    # (B, L, n_layers, P)
    x = layers.PerLayerGate(config)(x, per_layer[:, :, i])      # in block i, after its feed-forward

The vector mixes what the token is (a second embedding table, n_layers * P wide, so that each
layer has its own P columns) with where the token sits in context (a projection of the scaled
token embedding, RMS-normalized per layer); their sum is scaled by 1/sqrt(2) to keep the
variance of one of them. The table is large (262,144 x 35 x 256 in Gemma-4-E2B: more than the
rest of the model) but only one row is read per token, which is why the E sizes can leave it out
of the memory the hot loop touches.
"""

from __future__ import annotations

from torch import Tensor, nn

from flashformer.kernels.cpu import Linear
from flashformer.model.config import ModelConfig
from flashformer.model.layers import RMSNorm
from flashformer.model.stacks import EmbeddingScale


class PerLayerInputs(nn.Module):
    """input_ids and the scaled token embeddings -> every layer's per-layer input."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_layers, self.width = config.n_layers, config.per_layer_input_dim
        total = self.n_layers * self.width
        self.tokens = nn.Embedding(config.per_layer_vocab_size, total)
        self.token_scale = EmbeddingScale(self.width**0.5)  # rounded to the table's dtype, as Gemma's
        self.projection = Linear(config.d_model, total, bias=False)
        self.projection_scale = config.d_model**-0.5
        self.projection_norm = RMSNorm(self.width, eps=config.norm_eps)

    def forward(self, input_ids: Tensor, embedded: Tensor) -> Tensor:
        """input_ids (B, L), embedded (B, L, d_model) -> (B, L, n_layers, width)."""
        shape = (*input_ids.shape, self.n_layers, self.width)
        identity = self.token_scale(self.tokens(input_ids)).reshape(shape)  # (B, L, n_layers, width)
        context = (self.projection(embedded) * self.projection_scale).reshape(shape)
        return (self.projection_norm(context) + identity) * 2**-0.5
