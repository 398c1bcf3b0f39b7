"""Checks of a model's inputs (token ids, masks, labels), made before any computation; any
room may use them.

Each raises a ValueError that names the argument, what it received and what was expected.
Checks that read tensor contents (token ids in range) are skipped while torch.compile traces
the model, so that the traced graph has no data-dependent branch; shape and dtype checks
always run.
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100  # label value that the loss skips, as in transformers


def check_int_tensor(name: str, t, what: str, dims: tuple[int, ...] = (2,)) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of {what}; got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer {what}; got dtype {t.dtype}")
    if t.dim() not in dims:
        expected = "(batch, length)" if dims == (2,) else "(length,) or (batch, length)"
        raise ValueError(f"{name} must have shape {expected}; got shape {tuple(t.shape)}")
    if t.shape[-1] == 0:
        raise ValueError(f"{name} must hold at least one token; got shape {tuple(t.shape)}, an empty prompt")


def check_token_ids(name: str, ids, vocab_size: int) -> None:
    check_int_tensor(name, ids, "token ids")
    if not torch.compiler.is_compiling():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"{name} must be in [0, vocab_size={vocab_size}); got a token id {bad}")


def check_token_types(token_type_ids, input_ids: Tensor, type_vocab_size: int) -> None:
    if token_type_ids is None:
        return
    if type_vocab_size == 0:
        raise ValueError("token_type_ids were given, but this model has no token types (type_vocab_size=0)")
    check_int_tensor("token_type_ids", token_type_ids, "token types")
    if token_type_ids.shape != input_ids.shape:
        raise ValueError(
            f"token_type_ids must have the shape of input_ids {tuple(input_ids.shape)}; "
            f"got {tuple(token_type_ids.shape)}"
        )
    if not torch.compiler.is_compiling():
        low, high = int(token_type_ids.min()), int(token_type_ids.max())
        if low < 0 or high >= type_vocab_size:
            raise ValueError(
                f"token_type_ids must be in [0, type_vocab_size={type_vocab_size}); got {low if low < 0 else high}"
            )


def check_labels(labels, shape: tuple[int, int], vocab_size: int, has_head: bool = True) -> None:
    if labels is None:
        return
    if not has_head:
        raise ValueError("labels were given, but this model has no head to score them (mlm_head=False)")
    check_int_tensor("labels", labels, "token ids")
    if tuple(labels.shape) != shape:
        raise ValueError(f"labels must have shape {shape}; got {tuple(labels.shape)}")
    if not torch.compiler.is_compiling():
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab_size))
        if bool(bad.any()):
            raise ValueError(
                f"labels must be in [0, vocab_size={vocab_size}) or {IGNORE_INDEX} (ignored); "
                f"got {int(labels[bad][0])}"
            )


def padding_mask_from(name: str, attention_mask, shape: tuple[int, int]) -> Tensor | None:
    """A (B, L) attention mask (1/True = real token, 0/False = padding) as a bool key padding mask."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor):
        raise ValueError(
            f"{name} must be a torch.Tensor of shape {shape}; got {type(attention_mask).__name__}"
        )
    if tuple(attention_mask.shape) != shape:
        raise ValueError(
            f"{name} must have shape {shape} (batch, keys: cached + new tokens); got {tuple(attention_mask.shape)}"
        )
    return attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0


def check_caches(kv_caches, n_layers: int) -> None:
    if kv_caches is not None and len(kv_caches) != n_layers:
        raise ValueError(f"kv_caches must hold one cache per layer ({n_layers}); got {len(kv_caches)}")


def check_logits_to_keep(logits_to_keep, length: int, labels) -> None:
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be an int >= 0 (0 = all); got {logits_to_keep!r}")
    if labels is not None and logits_to_keep not in (0, length):
        raise ValueError(
            f"labels need the logits of every position; got logits_to_keep={logits_to_keep} for {length} tokens"
        )
