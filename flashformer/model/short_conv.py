"""LFM2's double-gated short convolution: the token mixer of a "conv" layer (layer_types), in
place of attention, beside the attention layers of the same stack.

For the layer's input x_t (d_model channels), with in_proj giving three d_model-wide vectors:

    b_t, c_t, h_t = in_proj(x_t)                      the input gate, the output gate, the value
    u_t = b_t * h_t                                   gated before the convolution
    y_t = sum_{j=0}^{K-1} w_j * u_{t-j}               causal, depthwise (one filter per channel)
    out_t = out_proj(c_t * y_t)                       gated after it

K is short (short_conv_kernel; LFM2: 3), so a token sees the K - 1 tokens before it through
this layer, and farther ones only through the attention layers. There is no recurrence: the
whole decoding state of the layer is its last K - 1 inputs u (B, d_model, K - 1), whatever the
number of tokens seen (a RecurrentState named "conv", as Mamba's conv window in ssm.py).

Two forms of the same convolution (causal_conv1d): over a whole prompt at once (F.conv1d on the
state followed by the prompt's u), and one token at a time in decoding (the same call with L = 1);
each returns the state after its last token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashformer.generate.cache import RecurrentState
from flashformer.kernels.cpu import Linear
from flashformer.model.config import ModelConfig


def causal_conv1d(
    u: Tensor, weight: Tensor, bias: Tensor | None, state: Tensor | None
) -> tuple[Tensor, Tensor]:
    """A causal depthwise convolution continued from `state`.

    u (B, C, L); weight (C, 1, K) (nn.Conv1d's, groups=C); state (B, C, K - 1), the K - 1 inputs
    before u, or None (zeros: the sequence starts here). Returns y (B, C, L), y_t = sum_j
    weight[:, 0, K - 1 - j] u_(t - j) (+ bias), and the state after u, (B, C, K - 1).
    """
    batch, channels, _ = u.shape
    width = weight.shape[-1]
    before = u.new_zeros(batch, channels, width - 1) if state is None else state.to(u.dtype)
    window = torch.cat((before, u), dim=2)  # (B, C, K - 1 + L)
    y = F.conv1d(window, weight.to(u.dtype), None if bias is None else bias.to(u.dtype), groups=channels)
    return y, window[:, :, window.shape[2] - (width - 1) :]


class ShortConv(nn.Module):
    """out_proj(c * conv(b * h)), (b, c, h) = in_proj(x): see the module docstring. Called as an
    attention sub-layer is (DecoderBlock), it takes the padding mask and a cache, and no
    positions (the order is in the convolution)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d, bias = config.d_model, config.short_conv_bias
        self.d_model, self.width = d, config.short_conv_kernel
        self.in_proj = Linear(d, 3 * d, bias=bias)
        self.conv = nn.Conv1d(d, d, self.width, groups=d, bias=bias)  # depthwise; padded by the state
        self.out_proj = Linear(d, d, bias=bias)

    def forward(
        self,
        x: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        kv_cache: RecurrentState | None = None,
        cache_position: int = 0,
        **no_positions,  # rotary, bias, alibi_slopes: the convolution's order needs none
    ) -> Tensor:
        """x (B, L, d_model) -> (B, L, d_model). key_padding_mask (B, cache_position + L) bool,
        True = a real token: a padded position's input is zero (it adds nothing to the state, as
        transformers zeroes it). kv_cache: this layer's RecurrentState, read and advanced."""
        length = x.shape[1]
        if key_padding_mask is not None:
            x = x * key_padding_mask[:, -length:, None].to(x.dtype)
        state = None
        if kv_cache is not None:
            if not isinstance(kv_cache, RecurrentState):
                raise ValueError(
                    f"a conv layer keeps its last {self.width - 1} inputs in a RecurrentState "
                    f"(generate.cache.make_caches gives one), not a {type(kv_cache).__name__}"
                )
            kv_cache.check_position(cache_position)
            state = kv_cache["conv"]
        b, c, h = self.in_proj(x).transpose(1, 2).chunk(3, dim=1)  # (B, d_model, L) each
        y, after = causal_conv1d(b * h, self.conv.weight, self.conv.bias, state)  # (B, d_model, L)
        if kv_cache is not None:
            kv_cache.advance(length, conv=after)
        return self.out_proj((c * y).transpose(1, 2))  # (B, L, d_model)
