"""Text to an encoder's inputs: token ids cut to a length with the special tokens kept, words
mapped to their sub-tokens, padded batches, and batches of similar lengths.

    ids = encode_texts(tokenizer, ["a text", ...], max_length=128)    # [CLS] ... [SEP] as the tokenizer adds them
    words = encode_words(tokenizer, [["def", "f", "("], ...], 128)   # ids + the first sub-token of each word
    batch = pad_batch(ids, pad_id)                                   # input_ids, attention_mask (B, L)
    for indices in batches_by_length(lengths, 32): ...

The tokenizer is flashformer.text.tokenizer.Tokenizer (a tokenizer.json: WordPiece, BPE, ...), whose
post-processor decides the special tokens (BERT's [CLS] and [SEP]; none for the BPE that
`flashformer train` makes). Truncation happens before the special tokens are added, as
transformers' `truncation=True, max_length=...` does, so [CLS] ... [SEP] survive a long text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from flashformer.checks import IGNORE_INDEX


def _backend(tokenizer):
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        raise TypeError(
            f"an encoder's inputs need a tokenizer with a tokenizer.json (flashformer.text.tokenizer.Tokenizer); "
            f"got {type(tokenizer).__name__} (the byte tokenizer has no sub-token offsets: train with "
            "--train.tokenizer bpe)"
        )
    return backend


def _check_length(max_length: int, backend) -> int:
    specials = backend.num_special_tokens_to_add(False)
    if not isinstance(max_length, int) or max_length <= specials:
        raise ValueError(
            f"max_length must be an int above the {specials} special tokens the tokenizer adds; got {max_length!r}"
        )
    return specials


def encode_texts(tokenizer, texts: list[str], max_length: int) -> list[list[int]]:
    """Each text's ids, at most max_length of them, special tokens included."""
    backend = _backend(tokenizer)
    specials = _check_length(max_length, backend)
    encodings = backend.encode_batch(list(texts), add_special_tokens=False)
    ids = []
    for encoding in encodings:
        encoding.truncate(max_length - specials)
        ids.append(backend.post_process(encoding).ids)
    return ids


@dataclass
class EncodedWords:
    """One word sequence as sub-tokens: ids (special tokens included) and, per word, the position
    of its first sub-token, or -1 when it has none (cut off by max_length, or a word the
    tokenizer's normalizer erases)."""

    ids: list[int]
    first_token: list[int]

    def labels(self, tag_ids: list[int]) -> list[int]:
        """Per sub-token: the word's tag id on its first sub-token, -100 (not scored) elsewhere, as
        transformers' token-classification examples align word-level tags."""
        labels = [IGNORE_INDEX] * len(self.ids)
        for position, tag in zip(self.first_token, tag_ids):
            if position >= 0:
                labels[position] = tag
        return labels


def encode_words(tokenizer, sentences: list[list[str]], max_length: int) -> list[EncodedWords]:
    """Word sequences (tokens of a tagging task) as sub-tokens, at most max_length with specials.

    The words are joined by single spaces and encoded as one text, and each sub-token belongs to
    the word holding its last character: words may contain spaces and newlines (a Python string
    token), and a byte-level BPE sees space-prefixed words as in running text. A sub-token that
    lies only on a separating space belongs to no word."""
    backend = _backend(tokenizer)
    specials = _check_length(max_length, backend)
    texts, owners = [], []
    for words in sentences:
        owner = []  # per character of the joined text: its word, or -1 for a separating space
        for index, word in enumerate(words):
            if index:
                owner.append(-1)
            owner += [index] * len(word)
        texts.append(" ".join(words))
        owners.append(owner)
    encoded = []
    for words, owner, encoding in zip(
        sentences, owners, backend.encode_batch(texts, add_special_tokens=False)
    ):
        encoding.truncate(max_length - specials)
        encoding = backend.post_process(encoding)
        first = [-1] * len(words)
        for position, ((start, end), special) in enumerate(
            zip(encoding.offsets, encoding.special_tokens_mask)
        ):
            if special or end <= start:
                continue
            word = owner[end - 1]
            if word >= 0 and first[word] < 0:
                first[word] = position
        encoded.append(EncodedWords(encoding.ids, first))
    return encoded


def pad_batch(
    sequences: list[list[int]], pad_id: int, labels: list[list[int]] | None = None
) -> dict[str, Tensor]:
    """{"input_ids", "attention_mask"} (B, L) padded on the right to the longest, and "labels"
    (B, L) padded with -100 when per-token labels are given."""
    if not sequences or min(len(s) for s in sequences) == 0:
        raise ValueError("pad_batch needs at least one sequence and no empty one")
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if labels is not None:
        batch["labels"] = torch.full((len(sequences), length), IGNORE_INDEX, dtype=torch.long)
        for row, row_labels in enumerate(labels):
            batch["labels"][row, : len(row_labels)] = torch.tensor(row_labels)
    return batch


def batches_by_length(lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices in batches of batch_size, longest first, each batch of similar lengths (little
    padding); the order within equal lengths is the input order."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    order = np.argsort(-np.asarray(lengths), kind="stable").tolist()
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


def pad_id_of(tokenizer) -> int:
    """The id padding takes: the tokenizer's pad token, else flashformer's <pad>, else 0 (the
    attention mask hides it either way)."""
    if getattr(tokenizer, "pad_token_id", None) is not None:
        return tokenizer.pad_token_id
    index = _backend(tokenizer).token_to_id("<pad>")
    return 0 if index is None else index
