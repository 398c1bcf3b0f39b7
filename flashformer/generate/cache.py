"""KV caches for generation: preallocated once, written in place.

Generating token t needs the keys and values of tokens 0..t-1 in every
self-attention layer. Recomputing them makes each step cost the whole prefix;
keeping them in a growing tensor (torch.cat per step) reallocates and copies
the prefix every step and changes shapes under torch.compile. As in gpt-fast,
each layer's cache is allocated once at its final size (B, Hk, max_len, D),
and a step writes its new keys at explicit positions:

    k_all, v_all = cache.update(k, v, cache_position)   # (B, Hk, cache_position + L, D), views

The views cover exactly the tokens so far, so attention runs with causal
alignment at the bottom right: L new queries after cache_position cached keys.

Keys and values each have an element type (kernels/kv_blocks.py, llama.cpp's names): f32, f16,
or the q8_0 / q4_0 blocks that the native decoder writes and reads in place (0.53x and 0.28x
float16's bytes). The model's modules, run eagerly or compiled, cannot read blocks: `update`
then quantizes the new rows and hands attention the float values of the whole prefix, a copy
per step that the native path does not make.

An encoder-decoder's cross-attention reads the encoder's output, which does
not change while the decoder generates: its keys and values are projected on
the first step and kept in `memory_kv` (see stacks.Decoder).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from flashformer.kernels import kv_blocks


class KVCache:
    """One self-attention layer's keys and values for up to max_len tokens.

    k, v: (B, Hk, max_len, D) preallocated, of the float dtype of their type (k_type, v_type:
    f32, f16), or (B, Hk, max_len, row bytes) uint8 rows of q8_0 / q4_0 blocks. dtype: the float
    type's where a type is not given. memory_kv: the cross-attention keys and values (B, Hk, M, D)
    of an encoder-decoder, or None until the first step computes them.
    """

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device,
        k_type: str | None = None,
        v_type: str | None = None,
    ):
        self.k_type = k_type or kv_blocks.type_of_dtype(dtype)
        self.v_type = v_type or kv_blocks.type_of_dtype(dtype)
        self.head_dim = head_dim
        self.k = kv_blocks.empty(self.k_type, (batch, kv_heads, max_len), head_dim, device)
        self.v = kv_blocks.empty(self.v_type, (batch, kv_heads, max_len), head_dim, device)
        self.memory_kv: tuple[Tensor, Tensor] | None = None

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def quantized(self) -> bool:
        return kv_blocks.holds_blocks(self.k_type, self.v_type)

    def update(self, k: Tensor, v: Tensor, cache_position: int) -> tuple[Tensor, Tensor]:
        """Store k, v (B, Hk, L, D) at positions cache_position .. cache_position + L - 1;
        return every key and value so far, (B, Hk, cache_position + L, D) (views of a float
        cache; a block cache's values as float32, computed anew)."""
        end = cache_position + k.shape[2]
        if not torch.compiler.is_compiling() and end > self.max_len:
            raise ValueError(
                f"the KV cache holds {self.max_len} tokens (max_len); writing {k.shape[2]} new tokens "
                f"after cache_position={cache_position} needs {end}"
            )
        if not self.quantized:
            self.k[:, :, cache_position:end] = k  # (rounded to a float16 cache)
            self.v[:, :, cache_position:end] = v
            return self.k[:, :, :end], self.v[:, :, :end]
        self.k[:, :, cache_position:end] = kv_blocks.store(k, self.k_type, keys=True)
        self.v[:, :, cache_position:end] = kv_blocks.store(v, self.v_type, keys=False)
        keys = kv_blocks.load(self.k[:, :, :end], self.k_type, self.head_dim, keys=True).to(k.dtype)
        values = kv_blocks.load(self.v[:, :, :end], self.v_type, self.head_dim, keys=False).to(v.dtype)
        return keys, values

    @property
    def nbytes(self) -> int:
        """The bytes the keys and values take (preallocated: max_len tokens)."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def reorder(self, rows: Tensor, length: int) -> None:
        """Beam search: row r takes the first `length` cached tokens (and the
        cross-attention keys and values) of row rows[r]."""
        self.k[:, :, :length] = self.k[rows, :, :length]
        self.v[:, :, :length] = self.v[rows, :, :length]
        if self.memory_kv is not None:
            self.memory_kv = tuple(t[rows] for t in self.memory_kv)

    def expand(self, times: int) -> None:
        """Repeat every row `times` times (row r becomes rows r*times .. r*times + times - 1):
        one prefill per prompt serves all of its beams."""
        self.k = self.k.repeat_interleave(times, dim=0)
        self.v = self.v.repeat_interleave(times, dim=0)
        if self.memory_kv is not None:
            self.memory_kv = tuple(t.repeat_interleave(times, dim=0) for t in self.memory_kv)


class RecurrentState:
    """One recurrent layer's state for generation, in place of a KV cache: an LSTM's (h, c), a
    GRU's h, an SSM's conv window and state. Its tensors have a fixed size, replaced at every
    step, so decoding memory is O(1) in the tokens seen (`nbytes` does not depend on `length`);
    the price is that it cannot go back: a state holds exactly `length` tokens and the next
    forward must continue at cache_position == length.

    tensors: name -> (B, ...) tensor, batch first (recurrent.py / ssm.py name them).
    """

    memory_kv = None  # no cross-attention (the decoder stack's protocol)

    def __init__(self, **tensors: Tensor):
        self.tensors = tensors
        self.length = 0

    def __getitem__(self, name: str) -> Tensor:
        return self.tensors[name]

    def advance(self, new_tokens: int, **tensors: Tensor) -> None:
        """The state after `new_tokens` more tokens."""
        self.tensors.update(tensors)
        self.length += new_tokens

    def check_position(self, cache_position: int) -> None:
        if cache_position != self.length:
            raise ValueError(
                f"a recurrent state holds the {self.length} tokens it has seen and cannot rewind or skip; "
                f"got cache_position={cache_position}"
            )

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def reorder(self, rows: Tensor, length: int) -> None:
        """Beam search: row r continues from row rows[r]."""
        self.tensors = {name: t[rows] for name, t in self.tensors.items()}

    def expand(self, times: int) -> None:
        """Repeat every row `times` times (one prefill per prompt serves its beams)."""
        self.tensors = {name: t.repeat_interleave(times, dim=0) for name, t in self.tensors.items()}


def cache_room(caches: list) -> int:
    """How many tokens `caches` can hold: the KV caches' max_len (a recurrent state, alone or
    beside them in a hybrid, holds any number; then sys.maxsize)."""
    return min((cache.max_len for cache in caches if isinstance(cache, KVCache)), default=sys.maxsize)


def cache_dtype(model: torch.nn.Module, device: torch.device) -> torch.dtype:
    """The dtype the layers' keys and values will be stored in: the model's
    kv_cache_dtype attribute where set (a quantized model's float16 cache, as
    llama.cpp keeps one: half the bytes a decode step reads; attention widens
    it to float32 exactly), else autocast's where it is on for the device (the
    projections then compute in it), otherwise the parameters'."""
    if getattr(model, "kv_cache_dtype", None) is not None:
        return model.kv_cache_dtype
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return next(model.parameters()).dtype


def kv_types(
    model: torch.nn.Module, device, cache_type_k: str | None = None, cache_type_v: str | None = None
) -> tuple[str, str]:
    """The (keys, values) element types of `model`'s cache: the types asked for (kernels/kv_blocks.py's
    names, checked), else the float type of cache_dtype."""
    default = kv_blocks.type_of_dtype(cache_dtype(model, torch.device(device)))
    k_type = default if cache_type_k is None else kv_blocks.check_type(cache_type_k, "cache_type_k")
    v_type = default if cache_type_v is None else kv_blocks.check_type(cache_type_v, "cache_type_v")
    for name, argument in ((k_type, "cache_type_k"), (v_type, "cache_type_v")):
        if kv_blocks.is_block_type(name) and model.config.head_dim % kv_blocks.BLOCK:
            raise ValueError(
                f"{argument}={name}: blocks of {kv_blocks.BLOCK} values need head_dim a multiple of "
                f"{kv_blocks.BLOCK}; this model's is {model.config.head_dim}"
            )
    return k_type, v_type


def make_caches(
    model: torch.nn.Module,
    batch: int,
    max_len: int,
    device=None,
    cache_type_k: str | None = None,
    cache_type_v: str | None = None,
) -> list[KVCache]:
    """One KVCache per decoder layer of `model` (a DecoderModel or an EncoderDecoderModel), and a
    RecurrentState per conv layer of a hybrid (LFM2: short_conv.py's window), or the states of a
    model that keeps its own (a recurrent model's `new_states`: RecurrentState, max_len unused; a
    linear-attention decoder's). cache_type_k / cache_type_v: the keys' and
    values' types (kv_types), for attention's KV caches only."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    config = model.config
    asked = cache_type_k is not None or cache_type_v is not None
    if asked and (hasattr(model, "new_states") or config.attention_kind == "linear"):
        raise ValueError(
            "cache_type_k / cache_type_v: this model keeps a recurrent state, not a KV cache of softmax attention"
        )
    if hasattr(model, "new_states"):
        return model.new_states(batch, device, cache_dtype(model, device))
    n_layers = config.n_layers if config.arch == "decoder" else config.n_decoder_layers
    dtype = cache_dtype(model, device)
    if config.attention_kind == "linear":  # S = sum phi(k) v^T, z = sum phi(k) (attention/linear.py)
        features = config.head_dim if config.linear_feature_map == "elu" else config.linear_features
        shape = (batch, config.n_kv_heads, features)
        return [
            RecurrentState(
                S=torch.zeros(*shape, config.head_dim, dtype=dtype, device=device),
                z=torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(n_layers)
        ]
    k_type, v_type = kv_types(model, device, cache_type_k, cache_type_v)
    window = config.short_conv_kernel - 1
    return [
        (
            # a conv layer (LFM2) keeps its last short_conv_kernel - 1 inputs, beside the KV caches
            RecurrentState(conv=torch.zeros(batch, config.d_model, window, dtype=dtype, device=device))
            if config.layer_type(index) == "conv"
            else KVCache(
                batch,
                config.n_kv_heads,
                max_len,
                config.layer_head_dim(index),  # Gemma 4's full layers are wider
                dtype=dtype,
                device=device,
                k_type=k_type,
                v_type=v_type,
            )
        )
        for index in range(n_layers)
    ]
