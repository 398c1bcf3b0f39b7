"""The tokenizers of flashformer's own runs: UTF-8 bytes, or a byte-level BPE trained on the
corpus (GPT-2's scheme), both with the special tokens the pretraining objectives use.

    tokenizer = train_bpe(texts, vocab_size=2048)       # a text.tokenizer.Tokenizer
    tokenizer = read_saved_tokenizer(run_folder)             # whichever a run saved beside its checkpoints
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from flashformer.files import write_atomic
from flashformer.text.tokenizer import Tokenizer

EOS = "<|endoftext|>"
MASK = "<mask>"
PAD = "<pad>"
NUM_SENTINELS = 100  # T5's <extra_id_0> ... <extra_id_99>
SPECIAL_TOKENS = [EOS, PAD, MASK] + [f"<extra_id_{i}>" for i in range(NUM_SENTINELS)]


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, special tokens after them."""

    kind = "byte"

    def __init__(self):
        self.specials = {token: 256 + i for i, token in enumerate(SPECIAL_TOKENS)}

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.specials)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def token_id(self, token: str) -> int:
        return self.specials[token]

    def save(self, folder: Path) -> None:
        write_atomic(
            Path(folder) / "tokenizer.json", json.dumps({"flashformer_byte_tokenizer": SPECIAL_TOKENS})
        )


def train_bpe(
    texts: Iterable[str], vocab_size: int, show_progress: bool = True, length: int | None = None
) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2's scheme) trained on the texts, with SPECIAL_TOKENS.
    length: how many texts there are, for the progress bar."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (256 bytes + special tokens); got {vocab_size}"
        )
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    backend.train_from_iterator(texts, trainer, length=length)
    return Tokenizer(backend)


def read_saved_tokenizer(folder: str | Path) -> ByteTokenizer | Tokenizer:
    """The tokenizer saved beside a checkpoint or in a Hugging Face folder (tokenizer.json)."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {folder}")
    if "flashformer_byte_tokenizer" in json.loads(path.read_text()):
        return ByteTokenizer()
    return Tokenizer.from_folder(folder)
