"""Corpora, and token files that are read without loading them.

The default corpus is on every machine without a download: the source files
of Python's own standard library (so the default model learns to complete
Python code). Text is tokenized once into a flat binary token file, read back
as a numpy memmap, so a corpus larger than RAM costs only disk; fixed windows
are cut from it and handed out in a resumable order.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flashformer.files import atomic_writer, write_json
from flashformer.text.bpe import EOS

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".toml", ".cfg", ".c", ".h", ".js", ".html", ".csv"}


# ---- corpora ----


@dataclass(frozen=True)
class Document:
    path: Path
    name: str  # stable across machines: the path relative to the corpus root


def stdlib_corpus() -> list[Document]:
    """Python's standard library sources, without site-packages and tests."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
    documents = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if skip.isdisjoint(relative.parts[:-1]):
            documents.append(Document(path, relative.as_posix()))
    return documents


def resolve_corpus(patterns: list[str] | None) -> list[Document]:
    """Files, folders (searched recursively for text files) or glob patterns.

    None or [] means the default corpus, Python's standard library.
    """
    if not patterns:
        return stdlib_corpus()
    documents: dict[Path, Document] = {}
    for pattern in patterns:
        matches = [Path(p) for p in sorted(glob.glob(os.path.expanduser(pattern), recursive=True))]
        if not matches:
            raise FileNotFoundError(f"data path {pattern!r} matches no file or folder")
        for match in matches:
            if match.is_dir():
                for path in sorted(match.rglob("*")):
                    if path.is_file() and path.suffix in TEXT_SUFFIXES:
                        documents[path] = Document(path, path.relative_to(match).as_posix())
            elif match.is_file():
                documents[match] = Document(match, match.name)
    if not documents:
        raise FileNotFoundError(
            f"data paths {patterns} hold no text files (looked for {sorted(TEXT_SUFFIXES)})"
        )
    return list(documents.values())


def split_documents(documents: list[Document], val_fraction: float, seed: int = 0):
    """A deterministic train/validation split by document.

    A document goes to validation when the hash of its stable name falls under
    val_fraction: the same on every machine, and unchanged for the others
    when a document is added or removed. At least one document goes to each
    side when there are two or more.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1); got {val_fraction}")

    def score(doc: Document) -> float:
        digest = hashlib.sha256(f"{seed}:{doc.name}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64

    train = [d for d in documents if score(d) >= val_fraction]
    val = [d for d in documents if score(d) < val_fraction]
    if val_fraction > 0 and not val and len(train) > 1:
        val.append(train.pop(min(range(len(train)), key=lambda i: score(train[i]))))
    return train, val


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


# ---- token files ----


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def document_separator(tokenizer) -> int:
    """The token written after each document: our tokenizers' <|endoftext|>, or a base model's own
    end-of-sequence token (a LoRA run's tokenizer is its base's: Llama's </s>)."""
    try:
        return tokenizer.token_id(EOS)
    except KeyError:
        if getattr(tokenizer, "eos_token_id", None) is None:
            raise ValueError(
                f"the tokenizer has neither {EOS!r} nor an end-of-sequence token to end a document"
            ) from None
        return tokenizer.eos_token_id


def write_token_file(documents: list[Document], tokenizer, path: Path, show_progress: bool = True) -> Path:
    """Tokenize documents into a flat binary file, EOS after each document.

    Streams document by document, so memory stays flat however large the
    corpus; written to a temporary file and renamed, so an interrupted run
    never leaves a truncated token file that a later run would trust.
    """
    from tqdm import tqdm

    path = Path(path)
    dtype = token_dtype(tokenizer.vocab_size)
    eos = document_separator(tokenizer)
    count = 0
    chunk = 32  # documents tokenized together
    with (
        atomic_writer(path, "wb") as f,
        tqdm(
            total=len(documents), desc=f"tokenizing {path.name}", unit="file", disable=not show_progress
        ) as progress,
    ):
        for start in range(0, len(documents), chunk):
            group = documents[start : start + chunk]
            for ids in tokenizer.encode_many([read_text(doc.path) for doc in group]):
                array = np.asarray(ids + [eos], dtype=dtype)
                f.write(array.tobytes())
                count += len(array)
            progress.update(len(group))
    write_json(path.with_suffix(".json"), {"dtype": np.dtype(dtype).name, "tokens": count}, indent=None)
    return path


def open_token_file(path: Path) -> np.memmap:
    meta = json.loads(Path(path).with_suffix(".json").read_text())
    tokens = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")
    if len(tokens) != meta["tokens"]:
        raise ValueError(f"token file {path} holds {len(tokens)} tokens; its metadata says {meta['tokens']}")
    return tokens


class PackedSequences:
    """Fixed-length windows of seq_len + 1 tokens cut from a token file.

    Documents are packed back to back (separated by EOS), so no token is
    wasted on padding; window i covers tokens [i*seq_len, (i+1)*seq_len].
    """

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1; got {seq_len}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"a corpus of {len(tokens)} tokens is too short for windows of {seq_len + 1}")

    def __len__(self) -> int:
        return self.num_windows

    def windows(self, indices) -> torch.Tensor:
        """(len(indices), seq_len + 1) int64."""
        rows = [np.asarray(self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1]) for i in indices]
        return torch.from_numpy(np.stack(rows).astype(np.int64))


class ShardedSampler:
    """A resumable order over windows: a fresh permutation per epoch, each
    rank reading its own shard, and a state of two integers.

    Rank r of w takes every w-th window of the epoch's permutation starting
    at r, so the ranks together see each window once per epoch.
    """

    def __init__(self, num_windows: int, seed: int = 0, rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}); got {rank}")
        if num_windows < world_size:
            raise ValueError(f"{num_windows} windows cannot be shared among {world_size} ranks")
        self.num_windows, self.seed, self.rank, self.world_size = num_windows, seed, rank, world_size
        self.epoch, self.position = 0, 0
        self._order = self._shard(0)

    def _shard(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        order = torch.randperm(self.num_windows, generator=generator)
        per_rank = self.num_windows // self.world_size  # equal shards keep ranks in step
        return order[self.rank :: self.world_size][:per_rank]

    def next_indices(self, count: int) -> list[int]:
        indices = []
        while len(indices) < count:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._shard(self.epoch)
            take = min(count - len(indices), len(self._order) - self.position)
            indices += self._order[self.position : self.position + take].tolist()
            self.position += take
        return indices

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._shard(self.epoch)
