"""Positional encodings: how a model knows where each token is.

Absolute encodings (sinusoidal, learned) are added to the token embeddings;
RoPE rotates queries and keys; ALiBi and T5's relative bias are added to the
attention scores. Those two are never handed to attention as an (n, n)
tensor: ALiBi goes as per-head slopes, T5's bias as a function of query and
key positions that the tiled backends evaluate one tile at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's per-head slopes (Press et al., 2022), (num_heads,) float32.

    For a power of two n the slopes are the geometric sequence 2^(-8/n),
    2^(-16/n), ...; otherwise the sequence of the nearest lower power of two is
    completed with every other slope of the sequence for twice that power.
    """
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1; got {num_heads}")

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    lower = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(lower)
    if lower < num_heads:
        slopes += geometric(2 * lower)[0::2][: num_heads - lower]
    return torch.tensor(slopes, dtype=torch.float32)


def t5_relative_bucket(
    relative_position: Tensor, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """T5's bucket index of (key position - query position), an int64 tensor.

    Half the buckets (per direction) hold exact small distances; the rest cover
    distances up to max_distance on a log scale, and anything farther shares
    the last bucket. A decoder (bidirectional=False) sees only the past, so
    future keys all land in bucket 0.
    """
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    # log-spaced buckets for max_exact <= distance < max_distance
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    far = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, far)


# ---- absolute positions, added to the token embeddings ----


def sinusoidal_embedding(positions: Tensor, dim: int, base: float = 10000.0) -> Tensor:
    """The fixed encoding of "Attention Is All You Need", (*positions.shape, dim) float32.

    Channel 2i holds sin(p / base^(2i/dim)) and channel 2i+1 holds cos of the
    same angle, so every position is a set of rotations at geometric
    wavelengths and needs no table: any position can be computed.
    """
    if dim % 2 != 0:
        raise ValueError(f"sinusoidal positions need an even dim; got dim={dim}")
    inv_freq = base ** (
        -torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim
    )  # (dim/2,)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (*P, dim/2)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (*P, dim), sin/cos interleaved


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal positions; no parameters, no length limit."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        self.dim, self.base = dim, base

    def forward(self, positions: Tensor) -> Tensor:  # (*P,) int -> (*P, dim)
        return sinusoidal_embedding(positions, self.dim, self.base)


class LearnedPositions(nn.Embedding):
    """One trained vector per position (BERT, GPT-2); positions >= num_embeddings do not exist."""

    def forward(self, positions: Tensor) -> Tensor:  # (*P,) int -> (*P, dim)
        return super().forward(positions)


# ---- T5's relative position bias ----


class RelativePositionBias(nn.Module):
    """T5's learned bias per (bucket of key - query distance, head).

    One instance belongs to a whole stack: T5 keeps the table in the first
    block only and every layer of the stack adds the same bias. The bias is
    handed to attention as a function of (query, key) positions, so the tiled
    backends build it one tile at a time and never hold an (n, n) tensor; the
    table still gets its gradient through that function.
    """

    def __init__(
        self, num_heads: int, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True
    ):
        super().__init__()
        self.table = nn.Embedding(num_buckets, num_heads)  # (buckets, H)
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional

    def bias_function(self, query_offset: int = 0) -> Callable[[Tensor, Tensor], Tensor]:
        """bias(q_pos, k_pos) -> (1, H, len(q_pos), len(k_pos)), for flashformer.attention.

        Attention numbers queries 0..Lq-1; with a cache of `query_offset`
        earlier tokens, query i sits at position i + query_offset.
        """

        def bias(q_pos: Tensor, k_pos: Tensor) -> Tensor:
            relative = k_pos[None, :] - (q_pos[:, None] + query_offset)  # (lq, lk), key - query
            buckets = t5_relative_bucket(relative, self.bidirectional, self.num_buckets, self.max_distance)
            return self.table.weight[buckets].permute(2, 0, 1)[None]  # (1, H, lq, lk)

        return bias

    def attention_args(self, positions: Tensor, cache_position: int) -> dict:
        return {"bias": self.bias_function(query_offset=cache_position)}


# ---- rotary position embedding (RoPE) ----


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's frequencies are stretched for contexts longer than training.

    kind="linear": every frequency divided by `factor` (position interpolation).
    kind="llama3": Llama 3.1's rule. Wavelengths shorter than
    original_max_seq_len / high_freq_factor are kept, those longer than
    original_max_seq_len / low_freq_factor are divided by `factor`, and the
    band in between is interpolated smoothly between the two.
    kind="yarn": YaRN (Peng et al. 2023; gpt-oss), as transformers computes it. Channel pairs
    that turn fewer than beta_slow times over original_max_seq_len are divided by `factor`,
    those that turn more than beta_fast times are kept, with a linear ramp over the pairs in
    between (its ends rounded outwards with `truncate`, as llama.cpp always does; gpt-oss says
    truncate=False). cos and sin are multiplied by attention_factor (None = 0.1 ln(factor) + 1),
    which scales every score by its square.
    kind="longrope": LongRoPE (Phi-3's 128k context, Phi-3.5, Phi-4-mini). Channel pair i turns
    1 / short_factor[i] times as fast while a sequence is at most original_max_seq_len long,
    1 / long_factor[i] times once it is longer (RotaryEmbedding decides per forward pass, as
    transformers does); cos and sin are multiplied by attention_factor (None = sqrt(1 + ln(factor)
    / ln(original_max_seq_len)), factor being context / original context) at every length.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    @property
    def cos_sin_factor(self) -> float:
        """What RoPE's cos and sin are multiplied by: YaRN's or LongRoPE's attention factor, else 1."""
        if self.kind not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.factor <= 1:
            return 1.0
        if self.kind == "longrope":
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_seq_len))
        return 0.1 * math.log(self.factor) + 1.0

    def __post_init__(self):
        if self.kind not in ("linear", "llama3", "yarn", "longrope"):
            raise ValueError(
                f"RopeScaling.kind must be 'linear', 'llama3', 'yarn' or 'longrope'; got {self.kind!r}"
            )
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor must be > 0; got {self.factor}")
        for name in ("short_factor", "long_factor"):  # lists, as read back from config.json
            object.__setattr__(self, name, tuple(float(f) for f in getattr(self, name)))
        if self.kind == "longrope" and not (
            self.short_factor and len(self.short_factor) == len(self.long_factor)
        ):
            raise ValueError(
                f"RopeScaling(kind='longrope') needs short_factor and long_factor of one length > 0; got "
                f"{len(self.short_factor)} and {len(self.long_factor)} factors"
            )
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                f"RopeScaling needs high_freq_factor > low_freq_factor; got {self.high_freq_factor} "
                f"and {self.low_freq_factor}"
            )


def rope_inverse_frequencies(
    rotary_dim: int, theta: float = 10000.0, scaling: RopeScaling | None = None
) -> Tensor:
    """(rotary_dim / 2,) float32: channel pair i turns by position * theta^(-2i/rotary_dim)."""
    if rotary_dim % 2 != 0 or rotary_dim <= 0:
        raise ValueError(f"the rotary dim must be even and > 0; got {rotary_dim}")
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "yarn":
        return _yarn_frequencies(inv_freq, rotary_dim, theta, scaling)
    if scaling.kind == "longrope":  # the short factors: a sequence within the original context
        return longrope_frequencies(rotary_dim, theta, scaling.short_factor)
    wavelength = 2 * math.pi / inv_freq
    long_limit = scaling.original_max_seq_len / scaling.low_freq_factor  # longer waves: divided by factor
    short_limit = scaling.original_max_seq_len / scaling.high_freq_factor  # shorter waves: kept
    # 0 at long_limit, 1 at short_limit: the weight of the unscaled frequency in between
    smooth = (scaling.original_max_seq_len / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelength > long_limit, inv_freq / scaling.factor, inv_freq)
    in_between = (wavelength >= short_limit) & (wavelength <= long_limit)
    return torch.where(in_between, blended, scaled)


def longrope_frequencies(rotary_dim: int, theta: float, factors: tuple[float, ...]) -> Tensor:
    """(rotary_dim / 2,) float32: LongRoPE's frequencies, pair i's divided by factors[i] (in
    transformers' order of operations: 1 / (factor * theta^(2i/rotary_dim)), bit for bit)."""
    if len(factors) != rotary_dim // 2:
        raise ValueError(
            f"LongRoPE needs one factor per rotated channel pair: rotary_dim / 2 = {rotary_dim // 2}; got "
            f"{len(factors)}"
        )
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)


def _yarn_frequencies(inv_freq: Tensor, rotary_dim: int, theta: float, scaling: RopeScaling) -> Tensor:
    """YaRN's blend of the kept (extrapolated) and the divided (interpolated) frequencies."""

    def pair_turning(rotations: float) -> float:  # the channel pair turning `rotations` times
        turns = scaling.original_max_seq_len / (rotations * 2 * math.pi)
        return rotary_dim * math.log(turns) / (2 * math.log(theta))

    low, high = pair_turning(scaling.beta_fast), pair_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # (rotary_dim / 2,): 1 for the fast pairs, 0 for the slow ones
    return inv_freq / scaling.factor * (1 - kept) + inv_freq * kept


class RotaryEmbedding(nn.Module):
    """RoPE in Hugging Face LLaMA's "rotate-half" layout.

    The first `rotary_dim` channels of each head are rotated; channel i is
    paired with channel i + rotary_dim/2 (not with its neighbour, as in the
    paper's interleaved form), and the remaining channels pass unchanged
    (partial rotary, as in GPT-NeoX). Rotating q and k by their absolute
    positions makes q.k depend only on their distance; with a KV cache the new
    tokens' positions simply start at the cache length.

    LongRoPE (scaling.kind "longrope") holds two tables, the short factors' (inv_freq) and the
    long ones' (long_inv_freq), and a forward pass reads the long one when its last position
    passes the original context (positions.max() + 1 > original_max_seq_len), per row for (B, L)
    positions: transformers' rule (it takes the max over the whole batch), so with a cache the keys
    written before the switch keep their short rotation, as they do in transformers. llama.cpp
    decides once from the context size instead (n_ctx > original: long for every position): the two
    agree wherever the context is within the original one.
    proportional (Gemma 4's "proportional" RoPE): the partial rotary keeps the whole head's
    pairing (i with i + head_dim/2) and frequencies (theta^(-2i/head_dim)), and only the first
    fraction * head_dim / 2 pairs turn: the others get frequency 0 (cos 1, sin 0).
    """

    def __init__(
        self,
        head_dim: int,
        fraction: float = 1.0,
        theta: float = 10000.0,
        scaling: RopeScaling | None = None,
        proportional: bool = False,
    ):
        super().__init__()
        self.rotary_dim = head_dim if proportional else int(head_dim * fraction)
        if not 0 < fraction <= 1 or self.rotary_dim % 2 != 0 or self.rotary_dim == 0:
            raise ValueError(
                f"the rotary part of a head (head_dim * fraction = {head_dim} * {fraction}) must be an even "
                f"number of channels > 0"
            )
        if proportional and scaling is not None and scaling.kind != "linear":
            raise ValueError(f"proportional RoPE takes a linear scaling only; got {scaling.kind!r}")
        # the channel pairs that turn (proportional: the first ones; all others are kept as they are)
        self.turning_pairs = int(fraction * head_dim // 2) if proportional else self.rotary_dim // 2
        self.theta, self.scaling = theta, scaling
        self.cos_sin_factor = 1.0 if scaling is None else scaling.cos_sin_factor
        self.reset_buffers()

    def reset_buffers(self, device=None) -> None:
        """(Re)compute the frequencies; they are not saved with the weights."""
        with torch.device("cpu"):  # computed on the CPU, then moved: on the meta device (a model
            # built to receive its weights) these ops run torch's Python kernels, seconds to import
            inv_freq = rope_inverse_frequencies(self.rotary_dim, self.theta, self.scaling)
            inv_freq[self.turning_pairs :] = 0.0  # proportional: the pairs past these stand still
        device = torch.get_default_device() if device is None else device
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)  # (rotary_dim/2,)
        long = None  # LongRoPE's frequencies past the original context (rotary_dim/2,), else None
        if self.scaling is not None and self.scaling.kind == "longrope":
            with torch.device("cpu"):
                long = longrope_frequencies(self.rotary_dim, self.theta, self.scaling.long_factor).to(device)
        self.register_buffer("long_inv_freq", long, persistent=False)

    def _apply(self, fn, recurse=True):
        """model.to(device) moves the frequencies; model.to(bfloat16) must not round them."""
        super()._apply(fn, recurse)
        self.reset_buffers(self.inv_freq.device)
        return self

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin for positions (L,) -> (L, rotary_dim), or (B, L) -> (B, 1, L, rotary_dim)."""
        angles = positions.to(torch.float32)[..., None] * self.frequencies(positions)  # (*P, rot/2)
        angles = torch.cat((angles, angles), dim=-1)  # (*P, rot): pair i and i + rot/2 share an angle
        if positions.dim() == 2:
            angles = angles[:, None]  # (B, 1, L, rot): broadcast over heads
        if self.cos_sin_factor != 1.0:  # YaRN's or LongRoPE's attention factor
            return angles.cos() * self.cos_sin_factor, angles.sin() * self.cos_sin_factor
        return angles.cos(), angles.sin()

    def frequencies(self, positions: Tensor) -> Tensor:
        """The table positions (L,) or (B, L) turn by: (rot/2,), or (B, 1, rot/2) where LongRoPE's
        rows choose apart (see the class docstring)."""
        inv_freq = self.inv_freq.to(positions.device)
        if self.long_inv_freq is None or positions.numel() == 0:
            return inv_freq
        long = positions.amax(dim=-1, keepdim=True) + 1 > self.scaling.original_max_seq_len  # (*B, 1)
        return torch.where(long[..., None], self.long_inv_freq.to(positions.device), inv_freq)

    def attention_args(self, positions: Tensor, cache_position: int) -> dict:
        return {"rotary": self(positions)}


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first cos.shape[-1] channels of x (B, H, L, D); the rest pass through.

    The rotation is computed in cos's dtype (float32) and returned in x's.
    """
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return (x * cos + rotate_half(x) * sin).to(x.dtype)
    rotated, passed = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat(((rotated * cos + rotate_half(rotated) * sin).to(x.dtype), passed), dim=-1)


# ---- the rest of what a stack can hand its attention layers ----
#
# A stack owns one positional module and asks it, once per forward pass, for
# the keyword arguments its self-attention layers take (see
# layers.MultiHeadAttention): RotaryEmbedding gives `rotary`,
# RelativePositionBias `bias`, AlibiPositions `alibi_slopes`.


class AlibiPositions(nn.Module):
    """ALiBi: a per-head linear penalty on distance, given to attention as slopes."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.reset_buffers()

    def reset_buffers(self, device=None) -> None:
        """(Re)compute the slopes; they are not saved with the weights."""
        self.register_buffer("slopes", alibi_slopes(self.num_heads).to(device), persistent=False)  # (H,)

    def _apply(self, fn, recurse=True):
        """model.to(device) moves the slopes; model.to(bfloat16) must not round them."""
        super()._apply(fn, recurse)
        self.reset_buffers(self.slopes.device)
        return self

    def attention_args(self, positions: Tensor, cache_position: int) -> dict:
        return {"alibi_slopes": self.slopes}


class NoAttentionPositions(nn.Module):
    """For absolute positions (already in the embeddings) or none at all."""

    def attention_args(self, positions: Tensor, cache_position: int) -> dict:
        return {}
