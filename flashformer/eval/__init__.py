"""Evaluation: perplexity and bits per byte of a causal LM over long texts (perplexity.py)."""

from flashformer.eval.perplexity import perplexity

__all__ = ["perplexity"]
