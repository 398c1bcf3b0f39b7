"""Attention: one function, several backends (see api.py)."""

from flashformer.attention.api import BACKENDS, attention

__all__ = ["BACKENDS", "attention"]
