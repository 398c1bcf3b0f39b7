"""A tokenizer as a GGUF file's tokenizer.* metadata: what llama.cpp (and tokenizer.py here) read.

    metadata = tokenizer_metadata(tokenizer, vocab_size=model_vocab, source="run/")

Byte-level BPE (GPT-2's scheme: `flashformer train`'s tokenizer, GPT-2, Llama 3, Qwen2) is
written as llama.cpp's "gpt2" model: the tokens in id order, spelled in the byte alphabet as
tokenizer.json spells them, the merges, a token type per token (control for special added
tokens, user-defined for the other added ones, unused for the padding rows of a model whose
embedding is larger than the vocabulary), the special ids, whether BOS/EOS are added, and the
chat templates.

A file names its pre-tokenizer (tokenizer.ggml.pre) instead of carrying the regex. Which name
is right is decided by trying: the file is built with each split the reader knows, and the
first whose ids equal the original tokenizer's on a battery of texts is written, so the file
reads back (here and in llama.cpp, which maps the same names to the same splits) as the
tokenizer it came from. A tokenizer none of them reproduces is refused, naming the text.
"""

from __future__ import annotations

import json

from flashformer.checkpoints.gguf.tokenizer import (
    CONTROL,
    NORMAL,
    PRE_TOKENIZERS,
    UNUSED,
    USER_DEFINED,
    tokenizer_from_metadata,
)
from flashformer.text.bpe import EOS

# one name per distinct split of PRE_TOKENIZERS, the most common first, as llama-vocab.cpp spells them
PRE_TOKENIZER_CANDIDATES = ("gpt-2", "llama-bpe", "qwen2", "smollm")  # llama.cpp spells "gpt-2"

# texts whose split tells the pre-tokenizers apart: digit runs, whitespace runs, contractions,
# letters after punctuation, newlines, non-Latin scripts
SPLIT_BATTERY = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def square(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n",
    "spaces:  two   three    four     five, tabs:\t\t\tand newlines\n\n\n\nend \t \n",
    "3.14159265358979 and 1234567890123456789, 007, 1e-9, $12.50, 12,345",
    "I'm sure they'll say it's fine, don't you think? We've seen it. I'M SURE.",
    "café naïve résumé Ångström São Paulo Ελληνικά русский",
    "日本語のテキスト、中文测试，한국어 텍스트",
    "emoji 🎉👍🏽 👨‍👩‍👧 🇫🇷 ok",
    "a\r\nb\rc\n\nd  \n  e...!!!???,,,;;",
)


def tokenizer_metadata(tokenizer, vocab_size: int, source: str) -> dict:
    """The tokenizer.* keys for `tokenizer` (a text.tokenizer.Tokenizer) and a model of
    `vocab_size` embedding rows. Raises ValueError naming `source` for a tokenizer that cannot
    be written (not byte-level BPE, more tokens than the model has rows, no known split)."""
    if getattr(tokenizer, "kind", None) == "byte":
        raise ValueError(
            f"{source}: the run was trained with the byte tokenizer (--train.tokenizer byte); a GGUF file needs "
            f"a BPE vocabulary with merges (llama.cpp refuses a BPE model without them): train with "
            f"--train.tokenizer bpe to export"
        )
    spec = json.loads(tokenizer.backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or not _is_byte_level(spec.get("decoder")):
        raise ValueError(
            f"{source}: only byte-level BPE tokenizers (GPT-2's scheme: GPT-2, Llama 3, Qwen2, flashformer's "
            f"own) are written to GGUF; this one is a {model.get('type')} model with decoder "
            f"{(spec.get('decoder') or {}).get('type')!r}"
        )
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)  # token -> id
    if len(vocab) and max(vocab.values()) >= vocab_size:
        raise ValueError(
            f"{source}: the tokenizer has ids up to {max(vocab.values())}, beyond the model's {vocab_size} "
            f"embedding rows"
        )
    tokens, types = [f"[PAD{i}]" for i in range(vocab_size)], [UNUSED] * vocab_size
    for token, index in vocab.items():
        tokens[index], types[index] = token, NORMAL
    for index, added in tokenizer.backend.get_added_tokens_decoder().items():
        types[index] = CONTROL if added.special else USER_DEFINED

    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])],
    }
    metadata.update(_special_ids(tokenizer, vocab, source))
    metadata.update(_chat_templates(tokenizer.chat_template))
    metadata["tokenizer.ggml.pre"] = _pre_tokenizer(tokenizer, metadata, source)
    return metadata


def _is_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "Sequence":
        return any(_is_byte_level(d) for d in decoder.get("decoders", []))
    return decoder.get("type") == "ByteLevel"


def _special_ids(tokenizer, vocab: dict, source: str) -> dict:
    """bos/eos/unk/pad ids and whether BOS/EOS are added, as the original's post-processor adds them."""
    ids = {
        "bos": tokenizer.bos_token_id,
        "eos": tokenizer.eos_token_id,
        "unknown": tokenizer.unk_token_id,
        "padding": tokenizer.pad_token_id,
    }
    if ids["eos"] is None and EOS in vocab:  # flashformer's runs: documents end with <|endoftext|>
        ids["eos"] = vocab[EOS]
    metadata = {f"tokenizer.ggml.{name}_token_id": index for name, index in ids.items() if index is not None}
    plain = tokenizer.encode("a", add_special_tokens=False)
    framed = tokenizer.encode("a", add_special_tokens=True)
    start = framed.index(plain[0]) if plain and plain[0] in framed else -1
    before, after = framed[:start], framed[start + len(plain) :]
    if start < 0 or before not in ([], [ids["bos"]]) or after not in ([], [ids["eos"]]):
        raise ValueError(
            f"{source}: the tokenizer frames a text as {framed} (the text alone: {plain}); a GGUF file can only "
            f"say that BOS is added before and EOS after"
        )
    metadata["tokenizer.ggml.add_bos_token"] = bool(before)
    metadata["tokenizer.ggml.add_eos_token"] = bool(after)
    return metadata


def _chat_templates(templates: str | dict | None) -> dict:
    if templates is None:
        return {}
    if isinstance(templates, str):
        return {"tokenizer.chat_template": templates}
    return {
        ("tokenizer.chat_template" if name == "default" else f"tokenizer.chat_template.{name}"): text
        for name, text in templates.items()
    }


def _pre_tokenizer(tokenizer, metadata: dict, source: str) -> str:
    """The first pre-tokenizer name under which the file's tokenizer gives the original's ids."""
    expected = [tokenizer.encode(text, add_special_tokens=False) for text in SPLIT_BATTERY]
    mismatches = []
    for name in PRE_TOKENIZER_CANDIDATES:
        assert name in PRE_TOKENIZERS, name
        candidate = tokenizer_from_metadata({**metadata, "tokenizer.ggml.pre": name}, source=source)
        for text, ids in zip(SPLIT_BATTERY, expected):
            if candidate.encode(text, add_special_tokens=False) != ids:
                mismatches.append(f"{name!r} on {text[:40]!r}")
                break
        else:
            return name
    raise ValueError(
        f"{source}: no pre-tokenizer llama.cpp names splits text as this tokenizer does "
        f"(first difference of each: {'; '.join(mismatches)})"
    )
