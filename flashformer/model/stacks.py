"""What the three models are built from below their heads: the embeddings
(tokens, absolute positions, token types) and the stacks of blocks with the
positional module they share (RoPE, T5's relative bias, ALiBi).

    x = embeddings(input_ids, positions, token_type_ids)    # (B, L, d_model)
    x = encoder(x, padding_mask, positions)                 # or decoder(..., kv_caches=...)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from flashformer.model.config import ModelConfig
from flashformer.model.layers import DecoderBlock, EncoderBlock, make_norm
from flashformer.model.positional import (
    AlibiPositions,
    LearnedPositions,
    NoAttentionPositions,
    RelativePositionBias,
    RotaryEmbedding,
    SinusoidalPositions,
)

# ---- embeddings ----


class Embeddings(nn.Module):
    """Token embeddings (times sqrt(d_model) with scale_embeddings, Gemma), plus absolute
    positions and token types where the config has them, then (BERT) a norm, then dropout."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.token_scale = EmbeddingScale(config.d_model**0.5) if config.scale_embeddings else nn.Identity()
        self.positions = _absolute_positions(config)
        self.token_types = (
            nn.Embedding(config.type_vocab_size, config.d_model) if config.type_vocab_size else None
        )
        self.norm = make_norm(config) if config.embedding_norm else nn.Identity()
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """input_ids (B, L), positions (L,) or (B, L) -> (B, L, d_model)."""
        x = self.token_scale(self.tokens(input_ids))  # (B, L, d_model)
        if self.positions is not None:
            x = x + self.positions(positions)
        if self.token_types is not None:
            # no token types given means every token is of type 0, as in BERT
            x = x + (
                self.token_types.weight[0] if token_type_ids is None else self.token_types(token_type_ids)
            )
        return self.dropout(self.norm(x))


class EmbeddingScale(nn.Module):
    """x * scale with the scale first rounded to x's dtype, as Gemma multiplies its embeddings
    by sqrt(d_model) (in bfloat16 sqrt(640) = 25.30 becomes 25.25: the trained model saw that)."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.tensor(self.scale, dtype=x.dtype, device=x.device)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


def _absolute_positions(config: ModelConfig) -> nn.Module | None:
    if config.position == "learned":
        return LearnedPositions(config.max_seq_len, config.d_model)
    if config.position == "sinusoidal":
        return SinusoidalPositions(config.d_model)
    return None


def _attention_positions(config: ModelConfig, bidirectional: bool) -> nn.Module:
    """The positional module a stack shares among its layers' self-attention."""
    if config.position == "rope":  # the full layers' (all of them but for a sliding RoPE below)
        return RotaryEmbedding(
            config.global_head_dim or config.head_dim,
            config.rotary_fraction,
            config.rope_theta,
            config.rope_scaling,
            config.rope_proportional,
        )
    if config.position == "relative":
        return RelativePositionBias(
            config.n_heads, config.relative_buckets, config.relative_max_distance, bidirectional=bidirectional
        )
    if config.position == "alibi":
        return AlibiPositions(config.n_heads)
    return NoAttentionPositions()


def _sliding_positions(config: ModelConfig) -> nn.Module | None:
    """The sliding-window layers' own RoPE (Gemma 3 and 4: base rope_local_theta, whole heads, no
    scaling; Gemma 4's heads narrower than the full layers'), or None where they share the
    stack's positional module."""
    if config.position != "rope" or (
        config.rope_local_theta is None and config.global_head_dim in (None, config.head_dim)
    ):
        return None
    if config.rope_local_theta is None:  # only the head width differs
        return RotaryEmbedding(
            config.head_dim, config.rotary_fraction, config.rope_theta, config.rope_scaling
        )
    return RotaryEmbedding(config.head_dim, 1.0, config.rope_local_theta, None)


# ---- stacks ----


class Stack(nn.Module):
    """n_layers blocks, what they share, and the closing norm.

    With share_layers (ALBERT) one block's weights serve every layer. The
    positional module (RoPE frequencies, T5's bias table, ALiBi slopes) is
    the stack's, as T5 keeps its relative bias in the first block only and
    every layer reuses it. Sliding-window layers may have RoPE of their own
    (sliding_positions, Gemma 3); each layer reads the arguments of its type, and the NoPE
    layers (nope_layers, SmolLM3) none.
    make_block(index) builds layer `index`.
    """

    def __init__(self, config: ModelConfig, n_layers: int, make_block, bidirectional: bool):
        super().__init__()
        self.n_layers = n_layers
        self.blocks = nn.ModuleList(make_block(i) for i in range(1 if config.share_layers else n_layers))
        self.positions = _attention_positions(config, bidirectional)
        self.sliding_positions = _sliding_positions(config)
        self.layer_types = [config.layer_type(i) for i in range(n_layers)]
        self.nope_layers = frozenset(config.nope_layers)  # no RoPE there (SmolLM3)
        self.shares_kv = bool(config.kv_shared_layers)
        self.final_norm = make_norm(config) if config.prenorm else nn.Identity()
        self.final_dropout = nn.Dropout(config.dropout if config.dropout_after_final_norm else 0.0)
        self.activation_checkpointing = config.activation_checkpointing

    def block(self, index: int) -> nn.Module:
        return self.blocks[index % len(self.blocks)]

    def run_block(self, index: int, x: Tensor, **kwargs) -> Tensor:
        """One block; in training with activation checkpointing its activations
        are recomputed in the backward pass instead of kept."""
        if self.activation_checkpointing and self.training:
            return checkpoint(self.block(index), x, use_reentrant=False, **kwargs)
        return self.block(index)(x, **kwargs)

    def layer_position_args(self, positions: Tensor, cache_position: int) -> list[dict]:
        """The positional keyword arguments of each layer, computed once per type."""
        full = self.positions.attention_args(positions, cache_position)
        sliding = (
            full
            if self.sliding_positions is None
            else self.sliding_positions.attention_args(positions, cache_position)
        )
        by_type = {"full_attention": full, "sliding_attention": sliding, "conv": {}}  # a conv needs none
        return [{} if i in self.nope_layers else by_type[kind] for i, kind in enumerate(self.layer_types)]

    def finish(self, x: Tensor) -> Tensor:
        return self.final_dropout(self.final_norm(x))


class Encoder(Stack):
    """A stack of EncoderBlocks: every token sees every (real) token."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, config.n_layers, lambda i: EncoderBlock(config, i), bidirectional=True)

    def forward(self, x: Tensor, padding_mask: Tensor | None, positions: Tensor) -> Tensor:
        """x (B, L, d_model), padding_mask (B, L) bool or None, positions (L,) -> (B, L, d_model)."""
        position_args = self.layer_position_args(positions, 0)
        for index in range(self.n_layers):
            x = self.run_block(index, x, padding_mask=padding_mask, **position_args[index])
        return self.finish(x)


class Decoder(Stack):
    """A stack of DecoderBlocks: causal self-attention, and cross-attention
    to an encoder's output when built with cross_attention=True."""

    def __init__(self, config: ModelConfig, n_layers: int, cross_attention: bool = False):
        super().__init__(
            config, n_layers, lambda i: DecoderBlock(config, cross_attention, i), bidirectional=False
        )

    def forward(
        self,
        x: Tensor,
        padding_mask: Tensor | None,
        positions: Tensor,
        *,
        memory: Tensor | None = None,
        memory_padding_mask: Tensor | None = None,
        kv_caches: list | None = None,
        cache_position: int = 0,
        per_layer_inputs: Tensor | None = None,
    ) -> Tensor:
        """x (B, L, d_model) -> (B, L, d_model).

        padding_mask: (B, cache_position + L) bool or None, over all keys so far.
        kv_caches: one cache per layer (flashformer.generate.cache.KVCache, or any object
            with its update() and memory_kv), or None.
        per_layer_inputs: (B, L, n_layers, per_layer_input_dim), Gemma 4's (per_layer.py), or None.
        """
        position_args = self.layer_position_args(positions, cache_position)
        layer_args = [{} for _ in range(self.n_layers)]
        if self.shares_kv:  # one dict for the pass: layer type -> the keys and values to read
            shared_kv: dict = {}
            layer_args = [{"shared_kv": shared_kv} for _ in range(self.n_layers)]
        if per_layer_inputs is not None:
            for index, args in enumerate(layer_args):
                args["per_layer_input"] = per_layer_inputs[:, :, index]  # (B, L, per_layer_input_dim)
        for index in range(self.n_layers):
            cache = None if kv_caches is None else kv_caches[index]
            x = self.run_block(
                index,
                x,
                padding_mask=padding_mask,
                memory=memory,
                memory_padding_mask=memory_padding_mask,
                memory_kv=self._memory_kv(index, cache, memory),
                kv_cache=cache,
                cache_position=cache_position,
                **position_args[index],
                **layer_args[index],
            )
        return self.finish(x)

    def _memory_kv(self, index: int, cache, memory: Tensor | None) -> tuple[Tensor, Tensor] | None:
        """The cross-attention keys and values of the encoder's output, (B, Hk, M, D) each.

        With a cache they are projected on the first call and kept in it: the
        encoder's output does not change while the decoder generates, so every
        later step skips two (M x d_model) projections per layer.
        """
        if cache is None or memory is None:
            return None
        if cache.memory_kv is None:
            cache.memory_kv = self.block(index).cross_attn.project_memory(memory)
        return cache.memory_kv
