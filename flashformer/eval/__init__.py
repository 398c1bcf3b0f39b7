"""Evaluation: perplexity and bits per byte of a causal LM over long texts (perplexity.py);
every token's log-probability and its top alternatives (loglikelihood.py); KL divergence from a
base model's log-probabilities as llama-perplexity measures it (kld.py, its files base_logits.py)."""

from flashformer.eval.perplexity import perplexity

__all__ = ["perplexity"]
