"""Perplexity of a causal language model on text, by Hugging Face's sliding-window rule.

    result = perplexity(model, tokenizer, texts, context=1024, stride=512)
    result.perplexity, result.bits_per_byte, result.tokens

Each text is tokenized on its own (with the BOS token if the tokenizer adds
one) and read in windows of `context` tokens that start `stride` tokens
apart. Every token is scored exactly once, in the first window that ends at
or after it, with all the tokens of that window before it as context: up to
context - stride of them, more early in a window. The first token of a text
has nothing to be predicted from and is not scored. This is the recipe of
transformers' perplexity guide, so the same model and text give the same
number.

Bits per byte (nats / ln 2 over the UTF-8 bytes of the texts) compares
models with different tokenizers, which perplexity per token cannot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PerplexityResult:
    tokens: int  # tokens scored
    nll: float  # their summed negative log-likelihood, in nats
    bytes: int  # UTF-8 bytes of the texts
    texts: int
    context: int
    stride: int

    @property
    def mean_nll(self) -> float:
        return self.nll / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    @property
    def bits_per_byte(self) -> float:
        return self.nll / math.log(2) / self.bytes

    def to_dict(self) -> dict:
        return dict(
            texts=self.texts,
            tokens=self.tokens,
            bytes=self.bytes,
            context=self.context,
            stride=self.stride,
            nll=self.nll,
            mean_nll=self.mean_nll,
            perplexity=self.perplexity,
            bits_per_byte=self.bits_per_byte,
        )


def windows(length: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position) of each window over `length` tokens."""
    spans, scored_to = [], 1  # position 0 is never scored
    for begin in range(0, length, stride):
        end = min(begin + context, length)
        if end > scored_to:
            spans.append((begin, end, scored_to))
            scored_to = end
        if end == length:
            break
    return spans


@torch.no_grad()
def text_nll(model, ids: list[int], context: int, stride: int) -> tuple[float, int]:
    """(summed NLL in nats, tokens scored) of one tokenized text."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for begin, end, first in windows(len(ids), context, stride):
        window = torch.tensor([ids[begin:end]], device=device)  # (1, L)
        scored = end - first  # the targets ids[first:end], predicted from the positions before each
        logits = model(window, logits_to_keep=scored + 1).logits[0, :-1]  # (scored, vocab)
        targets = window[0, first - begin :]  # (scored,)
        total += F.cross_entropy(logits.float(), targets, reduction="sum").item()
        count += scored
    return total, count


def perplexity(
    model, tokenizer, texts: list[str], context: int | None = None, stride: int | None = None, progress=None
) -> PerplexityResult:
    """The perplexity of `model` on `texts`; see the module docstring.

    context: tokens per window (default: the model's max_seq_len, at most 2048);
    stride: tokens between window starts (default: context, no overlap).
    progress: a callable given each text's scored token count (a progress bar's update).
    """
    if model.config.arch != "decoder":
        raise ValueError(
            f"perplexity needs a causal language model (a decoder); got arch {model.config.arch!r}"
        )
    context = min(model.config.max_seq_len, 2048) if context is None else context
    stride = context if stride is None else stride
    if not (isinstance(context, int) and 2 <= context <= model.config.max_seq_len):
        raise ValueError(
            f"context must be an int in [2, {model.config.max_seq_len}] (max_seq_len); got {context!r}"
        )
    if not (isinstance(stride, int) and 1 <= stride <= context):
        raise ValueError(f"stride must be an int in [1, context={context}]; got {stride!r}")
    if not texts:
        raise ValueError("texts is empty: give at least one text to score")
    nll, tokens, size = 0.0, 0, 0
    for text in texts:
        ids = tokenizer.encode(text)
        text_total, text_tokens = text_nll(model, ids, context, stride)
        nll, tokens, size = nll + text_total, tokens + text_tokens, size + len(text.encode("utf-8"))
        if progress is not None:
            progress(text_tokens)
    if tokens == 0:
        raise ValueError("no token was scored: every text is shorter than 2 tokens")
    return PerplexityResult(tokens, nll, size, len(texts), context, stride)
