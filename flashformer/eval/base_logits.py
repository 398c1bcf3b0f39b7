"""The base model's log-probabilities on disk, in llama-perplexity's `--kl-divergence-base` format.

A base file holds, little-endian:

    b"_logits_"                      8 bytes
    ctx, vocab, chunks               int32 each
    tokens                           int32 (chunks, ctx): the text's tokens, chunk after chunk
    rows                             uint16 (chunks, ctx - 1 - ctx // 2, width): one per scored position

Only the second half of each chunk is scored (positions ctx // 2 .. ctx - 2, each predicting the
next token), so a chunk has ctx - 1 - ctx // 2 rows. A row is a position's log-probabilities in
16 bits: its first 4 uint16 are two float32, `scale` and `floor`, then one uint16 q per token and
one of padding when the vocabulary is odd (width = 2 * ceil(vocab / 2) + 4). A token's
log-probability is scale * q + floor. The 65536 levels span the 16 nats below the largest logit
(the whole range if it is narrower); a logit below that floor is stored as q = 0, so every
log-probability under floor - 16 or so reads back as the floor itself.

Files written here are read by `llama-perplexity --kl-divergence-base FILE --kl-divergence`, and
its files are read here: the same chunks, tokens and rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flashformer.files import atomic_writer

MAGIC = b"_logits_"
HEADER_BYTES = len(MAGIC) + 3 * 4
SPAN_NATS = 16.0  # the levels cover this many nats below the largest logit
LEVELS = 65535


def first_scored(ctx: int) -> int:
    """The first position of a chunk whose prediction is scored: the second half of the chunk."""
    return ctx // 2


def scored_rows(ctx: int) -> int:
    """Rows per chunk: positions ctx // 2 .. ctx - 2 (the last position predicts nothing in the chunk)."""
    return ctx - 1 - first_scored(ctx)


def row_width(vocab: int) -> int:
    """uint16 per row: scale and floor (two float32), one per token, padded to an even count."""
    return 2 * ((vocab + 1) // 2) + 4


def encode_rows(logits: torch.Tensor) -> np.ndarray:
    """(R, vocab) logits -> (R, row_width(vocab)) uint16 rows of the file."""
    rows, vocab = logits.shape
    x = logits.detach().to(torch.float64)  # (R, V)
    top = x.amax(dim=-1, keepdim=True)  # (R, 1)
    low = torch.maximum(x.amin(dim=-1, keepdim=True), top - SPAN_NATS)  # (R, 1)
    log_sum = torch.logsumexp(x - top, dim=-1, keepdim=True)  # (R, 1)
    scale = ((top - low) / LEVELS).to(torch.float32)  # (R, 1), as stored
    floor = (low - top - log_sum).to(torch.float32)  # (R, 1): the log-probability of q = 0
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.float64)
    levels = torch.round((x - low) / safe_scale).clamp_(
        0, LEVELS
    )  # round half to even, as the C rounding mode
    levels = torch.where((x > low) & (scale > 0), levels, torch.zeros_like(levels))
    out = np.zeros((rows, row_width(vocab)), dtype="<u2")
    head = torch.cat([scale, floor], dim=-1).numpy().astype("<f4")  # (R, 2)
    out[:, :4] = head.view("<u2")
    out[:, 4 : 4 + vocab] = levels.numpy().astype("<u2")
    return out


def decode_rows(rows: np.ndarray, vocab: int) -> torch.Tensor:
    """(R, row_width(vocab)) uint16 rows -> (R, vocab) float64 log-probabilities (scale * q + floor)."""
    rows = np.ascontiguousarray(rows, dtype="<u2")
    head = rows[:, :4].copy().view("<f4").astype(np.float64)  # (R, 2): scale, floor
    levels = torch.from_numpy(rows[:, 4 : 4 + vocab].astype(np.float64))  # (R, V)
    scale, floor = torch.from_numpy(head[:, :1]), torch.from_numpy(head[:, 1:])
    # float32 products, as the file's readers compute them
    return (scale.float() * levels.float() + floor.float()).double()


@dataclass
class BaseLogits:
    """A base file opened for reading; the rows stay on disk (memory-mapped) until asked for."""

    path: Path
    ctx: int
    vocab: int
    tokens: np.ndarray  # (chunks, ctx) int32
    rows: np.ndarray  # (chunks, scored_rows(ctx), row_width(vocab)) uint16, memory-mapped

    @property
    def chunks(self) -> int:
        return self.tokens.shape[0]

    def log_probs(self, chunk: int) -> torch.Tensor:
        """(scored_rows(ctx), vocab) float64: the base model's log-probabilities of one chunk."""
        return decode_rows(self.rows[chunk], self.vocab)


def write_base_logits(
    path: str | Path, ctx: int, vocab: int, tokens: np.ndarray, chunk_logits: Iterable[torch.Tensor]
) -> Path:
    """Write a base file whole or not at all.

    tokens: (chunks, ctx) token ids as the text gave them (a BOS put in front of a chunk for the
    model is not written). chunk_logits: per chunk, its (scored_rows(ctx), vocab) logits of the
    scored positions, produced while the file is being written.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] != ctx:
        raise ValueError(f"tokens must have shape (chunks, ctx={ctx}); got {tokens.shape}")
    chunks, rows = tokens.shape[0], scored_rows(ctx)
    written = 0
    with atomic_writer(path, "wb") as f:
        f.write(MAGIC)
        f.write(np.array([ctx, vocab, chunks], dtype="<i4").tobytes())
        f.write(tokens.astype("<i4").tobytes())
        for logits in chunk_logits:
            if tuple(logits.shape) != (rows, vocab):
                raise ValueError(
                    f"chunk {written}: logits of shape (rows={rows}, vocab={vocab}) expected; got {tuple(logits.shape)}"
                )
            f.write(encode_rows(logits).tobytes())
            written += 1
        if written != chunks:
            raise ValueError(f"{written} chunks of logits given for {chunks} chunks of tokens")
    return Path(path)


def is_base_logits(path: str | Path) -> bool:
    """Whether `path` is a file that begins as a base file does (a model's path does not)."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def read_base_logits(path: str | Path) -> BaseLogits:
    """Open a base file (ours or llama-perplexity's), checking its header and its size."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"base logits file {path} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        header = f.read(HEADER_BYTES)
    if len(header) < HEADER_BYTES or header[: len(MAGIC)] != MAGIC:
        raise ValueError(
            f"{path} is not a base logits file: it should begin with {MAGIC!r} and a header of "
            f"{HEADER_BYTES} bytes (llama-perplexity --kl-divergence-base, or eval kld --save-base)"
        )
    ctx, vocab, chunks = (int(v) for v in np.frombuffer(header[len(MAGIC) :], dtype="<i4"))
    if ctx < 4 or vocab < 1 or chunks < 1:
        raise ValueError(
            f"{path}: header gives ctx={ctx}, vocab={vocab}, chunks={chunks}; expected ctx >= 4, vocab >= 1, chunks >= 1"
        )
    rows, width = scored_rows(ctx), row_width(vocab)
    expected = HEADER_BYTES + 4 * chunks * ctx + 2 * chunks * rows * width
    if size != expected:
        raise ValueError(
            f"{path} has {size} bytes; a file of {chunks} chunks of {ctx} tokens over a vocabulary of "
            f"{vocab} has {expected} (truncated, or not written by llama-perplexity / eval kld)"
        )
    tokens = np.fromfile(path, dtype="<i4", count=chunks * ctx, offset=HEADER_BYTES).reshape(chunks, ctx)
    if tokens.min() < 0 or tokens.max() >= vocab:
        raise ValueError(
            f"{path}: token ids in [{tokens.min()}, {tokens.max()}] fall outside the vocabulary [0, {vocab})"
        )
    body = np.memmap(
        path, dtype="<u2", mode="r", offset=HEADER_BYTES + 4 * chunks * ctx, shape=(chunks, rows, width)
    )
    return BaseLogits(path, ctx, vocab, tokens, body)
