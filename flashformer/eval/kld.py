"""KL divergence of a model from a base model's log-probabilities, as llama-perplexity measures it.

    base = save_base(model, tokenizer, text, "base.kld", ctx=512)      # the reference model
    result = kl_divergence(quantized, tokenizer, read_base_logits("base.kld"))
    result.mean_kld, result.same_top, result.rms_p_diff, result.percentiles("kld")
    result = file_divergence(read_base_logits("other.kld"), read_base_logits("base.kld"))

The text is tokenized once and cut into chunks of ctx tokens (all whole chunks, at most `chunks`);
llama-perplexity asks for at least 2 * ctx tokens, and so does this. Each chunk is run on its own,
from an empty cache, with its first token replaced by BOS where the tokenizer adds one, and only
the second half is scored: positions ctx // 2 .. ctx - 2, each predicting the next token, so every
scored prediction has at least ctx // 2 tokens of context. The base file keeps the tokens, so the
model under test reads exactly the base's tokens, whatever its own tokenizer would make of the text.

Per scored position, with P the base distribution (from the file) and Q the model's:
    KLD    = sum over tokens with log P > -16 of P (log P - log Q)   (the rest is below 1e-7 each)
    Δp     = Q(next token) - P(next token)
    same top: the most likely token of Q is that of P
and PPL(Q), PPL(base) from the next tokens' log-probabilities. The statistics (means with their
standard errors, percentiles interpolated between the sorted values) follow llama-perplexity's
output line by line.

The logits of a chunk come from one function, `chunk_logits(model, ids, keep)`; another way of
computing them (a quantized KV cache, another backend) is a callable of the same signature
passed as `logits=`. file_divergence measures another program's log-probabilities, saved as a base
file (`llama-perplexity -m quantized.gguf --kl-divergence-base other.kld`), by the same statistic:
the statistic alone, without a forward of ours.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from flashformer.eval.base_logits import (
    BaseLogits,
    first_scored,
    scored_rows,
    write_base_logits,
)
from flashformer.generate.sampling import settings_from
from flashformer.generate.session import make_session

DEFAULT_CTX = 512  # llama-perplexity's -c default
SKIP_BELOW = (
    -16.0
)  # base log-probabilities at or under this add nothing to the KLD sum (llama-perplexity's cut)
KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1)
P_DIFF_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 25.0, 10.0, 5.0, 1.0, 0.1)

# (model, ids (ctx,) int64, keep) -> (keep, vocab) logits of the last `keep` positions
ChunkLogits = Callable[[torch.nn.Module, torch.Tensor, int], torch.Tensor]


@torch.no_grad()
def chunk_logits(model, ids: torch.Tensor, keep: int) -> torch.Tensor:
    """(keep, vocab) float32 logits of the last `keep` positions of one chunk run from scratch."""
    device = next(model.parameters()).device
    return model(ids.to(device)[None], logits_to_keep=keep).logits[0].float()  # (keep, V)


def cached_chunk_logits(cache_type_k: str | None, cache_type_v: str | None) -> ChunkLogits:
    """A ChunkLogits that runs the chunk through a KV cache of these element types (f32, f16, q8_0,
    q4_0; kernels/kv_blocks.py), as llama-perplexity with -ctk / -ctv does: the chunk's first part as
    a prompt, then its last `keep` tokens in one forward over the cache (the native decoder's, where
    the model has one), so that every scored position attends to keys and values as the cache
    stores them, its own included."""

    @torch.no_grad()
    def run(model, ids: torch.Tensor, keep: int) -> torch.Tensor:
        device = next(model.parameters()).device
        ids = ids.to(device)[None]  # (1, ctx)
        settings = settings_from(
            model, max_new_tokens=keep, cache_type_k=cache_type_k, cache_type_v=cache_type_v
        )
        session = make_session(model, ids[:, :-keep], None, settings)
        session.prefill()
        return session.extend(ids[:, -keep:])[0].float()  # (keep, V)

    return run


def bos_to_add(tokenizer) -> int | None:
    """The BOS id llama-perplexity puts at the start of each chunk: the tokenizer's BOS when it adds
    one to a text (a GGUF file's add_bos_token, or what its encode does), else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    adds = getattr(tokenizer, "add_bos_token", None)
    if adds is None:
        adds = tokenizer.encode("a")[:1] == [bos]
    return bos if adds else None


def text_chunks(ids: list[int], ctx: int, chunks: int | None) -> np.ndarray:
    """(n, ctx) int32: the whole chunks of `ids`, at most `chunks` of them."""
    if len(ids) < 2 * ctx:
        raise ValueError(
            f"the text has {len(ids)} tokens; a context of {ctx} needs at least {2 * ctx} "
            "(llama-perplexity's rule): give more text or a smaller --ctx"
        )
    n = len(ids) // ctx if chunks is None else min(chunks, len(ids) // ctx)
    return np.asarray(ids[: n * ctx], dtype=np.int32).reshape(n, ctx)


def scored_logits(model, tokens: np.ndarray, bos: int | None, logits: ChunkLogits) -> torch.Tensor:
    """(scored_rows(ctx), vocab) logits of one chunk's scored positions (its second half), on the CPU."""
    ids = torch.from_numpy(tokens.astype(np.int64))  # (ctx,)
    if bos is not None:
        ids[0] = bos
    ctx = len(ids)
    out = logits(model, ids, ctx - first_scored(ctx))  # (ctx - first, V): positions first .. ctx - 1
    return out[:-1].cpu()  # the last position predicts a token of the next chunk: not scored


def _check_model(model, ctx: int) -> None:
    if model.config.arch != "decoder":
        raise ValueError(
            f"eval kld needs a causal language model (a decoder); got arch {model.config.arch!r}"
        )
    if not 4 <= ctx <= model.config.max_seq_len:
        raise ValueError(
            f"ctx must be in [4, {model.config.max_seq_len}] (the model's max_seq_len); got {ctx}"
        )


@dataclass
class BaseResult:
    """What --save-base measured on the way: the base model's perplexity on the scored tokens."""

    path: str
    ctx: int
    chunks: int
    vocab: int
    tokens: int  # scored
    nll: float  # summed, nats

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    def to_dict(self) -> dict:
        return dict(
            base=self.path,
            ctx=self.ctx,
            chunks=self.chunks,
            vocab=self.vocab,
            tokens=self.tokens,
            mean_nll=self.nll / self.tokens,
            perplexity=self.perplexity,
        )


def save_base(
    model,
    tokenizer,
    text: str | np.ndarray,
    path: str | Path,
    ctx: int = DEFAULT_CTX,
    chunks: int | None = None,
    logits: ChunkLogits = chunk_logits,
    progress=None,
) -> BaseResult:
    """Run `model` over `text` in llama-perplexity's chunks and write its log-probabilities to `path`.

    text: a text, or the chunks' tokens (n, ctx) themselves (another base file's: two bases of the
    very same tokens; at most `chunks` of them). progress: a callable given each chunk's scored
    token count (a progress bar's update).
    """
    if chunks is not None and chunks < 1:
        raise ValueError(f"chunks must be >= 1 (or None: all); got {chunks}")
    if isinstance(text, np.ndarray):
        ctx, tokens = text.shape[1], text[:chunks]  # (n, ctx)
        _check_model(model, ctx)
    else:
        _check_model(model, ctx)
        tokens = text_chunks(tokenizer.encode(text), ctx, chunks)  # (n, ctx)
    vocab, bos = model.config.vocab_size, bos_to_add(tokenizer)
    nll = 0.0

    def each_chunk():
        nonlocal nll
        for chunk in tokens:
            out = scored_logits(model, chunk, bos, logits)  # (R, V)
            targets = torch.from_numpy(chunk[first_scored(ctx) + 1 :].astype(np.int64))  # (R,)
            nll -= torch.log_softmax(out.double(), -1).gather(-1, targets[:, None]).sum().item()
            if progress is not None:
                progress(len(targets))
            yield out

    write_base_logits(path, ctx, vocab, tokens, each_chunk())
    return BaseResult(str(path), ctx, len(tokens), vocab, len(tokens) * scored_rows(ctx), nll)


def token_statistics(
    logits: torch.Tensor, base_log_probs: torch.Tensor, targets: torch.Tensor, normalized: bool = False
) -> dict:
    """Per scored position (R of them): nll, nll_base, kld, p_diff (float64) and top_agrees (bool).

    logits: (R, V) the model's; base_log_probs: (R, V) the base's log-probabilities; targets: (R,).
    normalized: `logits` are log-probabilities already, read from a file: not normalized again,
    since the file's floor stands for every token below it, whose mass a softmax would count."""
    log_q = logits.double() if normalized else torch.log_softmax(logits.double(), dim=-1)  # (R, V)
    log_p = base_log_probs.double()  # (R, V)
    counted = log_p > SKIP_BELOW
    terms = torch.where(counted, log_p.exp() * (log_p - log_q), torch.zeros_like(log_p))  # (R, V)
    at = targets[:, None]
    nll, nll_base = -log_q.gather(-1, at)[:, 0], -log_p.gather(-1, at)[:, 0]  # (R,)
    return dict(
        nll=nll.numpy(),
        nll_base=nll_base.numpy(),
        kld=terms.sum(-1).numpy(),
        p_diff=((-nll).exp() - (-nll_base).exp()).numpy(),
        top_agrees=(logits.argmax(-1) == base_log_probs.argmax(-1)).numpy(),
    )


def mean_and_error(values: np.ndarray) -> tuple[float, float]:
    """The mean and its standard error (0 for 10 values or fewer), as llama-perplexity reports them."""
    n = len(values)
    mean = float(values.mean())
    variance = float((values * values).mean()) - mean * mean
    return mean, (math.sqrt(variance / (n - 1)) if variance > 0 and n > 10 else 0.0)


@dataclass
class KLDResult:
    """Every scored position's figures, and the statistics llama-perplexity prints of them."""

    base: str
    ctx: int
    chunks: int
    nll: np.ndarray  # (N,) the model's negative log-likelihood of each next token, nats
    nll_base: np.ndarray  # (N,) the base's
    kld: np.ndarray  # (N,) KL(base || model) per position, nats
    p_diff: np.ndarray  # (N,) the model's probability of the next token minus the base's
    top_agrees: np.ndarray  # (N,) bool: the model's most likely token is the base's
    stats: dict = field(init=False)

    def __post_init__(self):
        self.stats = self._statistics()

    @property
    def tokens(self) -> int:
        return len(self.kld)

    @property
    def mean_kld(self) -> float:
        return self.stats["kld"]["mean"]

    @property
    def same_top(self) -> float:
        return self.stats["same_top"]["mean"]

    @property
    def rms_p_diff(self) -> float:
        return self.stats["p_diff"]["rms"]

    def percentiles(self, name: str) -> dict[str, float]:
        return self.stats[name]["percentiles"]

    def _statistics(self) -> dict:
        n = self.tokens
        log_ppl, log_ppl_err = mean_and_error(self.nll)
        log_base, log_base_err = mean_and_error(self.nll_base)
        cov = 0.0
        if n >= 10:
            cov = (float((self.nll * self.nll_base).mean()) - log_ppl * log_base) / (n - 1)
        ratio_err = math.sqrt(max(log_ppl_err**2 + log_base_err**2 - 2 * cov, 0.0))
        ppl, ppl_base = math.exp(log_ppl), math.exp(log_base)
        square, square_err = mean_and_error(self.p_diff**2)
        rms = math.sqrt(square)
        same = float(self.top_agrees.mean())
        return {
            "ppl": {"value": ppl, "error": ppl * log_ppl_err},
            "ppl_base": {"value": ppl_base, "error": ppl_base * log_base_err},
            "correlation": cov / (log_ppl_err * log_base_err) if log_ppl_err and log_base_err else 0.0,
            "ln_ratio": {"value": log_ppl - log_base, "error": ratio_err},
            "ratio": {
                "value": math.exp(log_ppl - log_base),
                "error": math.exp(log_ppl - log_base) * ratio_err,
            },
            "difference": {
                "value": ppl - ppl_base,
                "error": math.sqrt(
                    max(
                        (ppl * log_ppl_err) ** 2 + (ppl_base * log_base_err) ** 2 - 2 * ppl * ppl_base * cov,
                        0.0,
                    )
                ),
            },
            "kld": _distribution(self.kld, KLD_PERCENTILES),
            "p_diff": {
                **_distribution(self.p_diff, P_DIFF_PERCENTILES),
                "rms": rms,
                "rms_error": 0.5 / rms * square_err if rms > 0 else 0.0,
            },
            "same_top": {"mean": same, "error": math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0},
        }

    def to_dict(self) -> dict:
        return dict(base=self.base, ctx=self.ctx, chunks=self.chunks, tokens=self.tokens, **self.stats)


def _distribution(values: np.ndarray, percentiles: tuple[float, ...]) -> dict:
    mean, error = mean_and_error(values)
    points = {"max": float(values.max())}
    points.update({f"{p:g}": float(np.percentile(values, p)) for p in percentiles if p > 50})
    points["median"] = float(np.median(values))
    points.update({f"{p:g}": float(np.percentile(values, p)) for p in percentiles if p < 50})
    points["min"] = float(values.min())
    return {"mean": mean, "error": error, "percentiles": points}


def kl_divergence(
    model,
    tokenizer,
    base: BaseLogits,
    chunks: int | None = None,
    logits: ChunkLogits = chunk_logits,
    progress=None,
) -> KLDResult:
    """KL divergence of `model` from the base file's log-probabilities over its chunks (the first
    `chunks` of them, or all). The tokens are the file's; the tokenizer only says whether a BOS
    begins each chunk. progress: a callable given each chunk's scored token count."""
    _check_model(model, base.ctx)
    if base.vocab != model.config.vocab_size:
        raise ValueError(
            f"{base.path} holds log-probabilities over a vocabulary of {base.vocab} tokens; the model "
            f"has {model.config.vocab_size} (expected the same vocabulary as the base model)"
        )
    if chunks is not None and chunks < 1:
        raise ValueError(f"chunks must be >= 1 (or None: all); got {chunks}")
    n = base.chunks if chunks is None else min(chunks, base.chunks)
    bos, first = bos_to_add(tokenizer), first_scored(base.ctx)
    parts: list[dict] = []
    for c in range(n):
        out = scored_logits(model, base.tokens[c], bos, logits)  # (R, V)
        targets = torch.from_numpy(base.tokens[c, first + 1 :].astype(np.int64))  # (R,)
        parts.append(token_statistics(out, base.log_probs(c), targets))
        if progress is not None:
            progress(len(targets))
    joined = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
    return KLDResult(str(base.path), base.ctx, n, **joined)


def file_divergence(
    other: BaseLogits, base: BaseLogits, chunks: int | None = None, progress=None
) -> KLDResult:
    """KL divergence of `other`'s log-probabilities from `base`'s, both base files of the very same
    tokens: another program's output (llama-perplexity's, of a quantized model) measured by this
    module's statistic. A file keeps 16 bits per log-probability, so the figures differ from the
    program's own by that rounding (tests/eval/test_kld.py bounds it), and it keeps only the 16 nats
    under each row's top: a model whose probability of a likely base token is below that is measured
    as if it were at the floor (a quantized model against its base is nowhere near)."""
    if (other.ctx, other.vocab) != (base.ctx, base.vocab):
        raise ValueError(
            f"{other.path} has chunks of {other.ctx} tokens over a vocabulary of {other.vocab}; the base "
            f"{base.path} has {base.ctx} and {base.vocab} (expected the same)"
        )
    if chunks is not None and chunks < 1:
        raise ValueError(f"chunks must be >= 1 (or None: all); got {chunks}")
    n = min(other.chunks, base.chunks) if chunks is None else min(chunks, other.chunks, base.chunks)
    differ = [c for c in range(n) if not np.array_equal(other.tokens[c], base.tokens[c])]
    if differ:
        raise ValueError(
            f"{other.path} and {base.path} hold different tokens from chunk {differ[0]} on (expected the "
            "same text, tokenized alike: run both programs on the same file with the same -c)"
        )
    first, parts = first_scored(base.ctx), []
    for c in range(n):
        targets = torch.from_numpy(base.tokens[c, first + 1 :].astype(np.int64))  # (R,)
        parts.append(token_statistics(other.log_probs(c), base.log_probs(c), targets, normalized=True))
        if progress is not None:
            progress(len(targets))
    joined = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
    return KLDResult(str(base.path), base.ctx, n, **joined)
