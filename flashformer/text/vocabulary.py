"""What each token id stands for, in bytes: the description a grammar engine needs to decide
which tokens may come next (generate.constraints).

    vocab = vocabulary_of(tokenizer)       # a text.tokenizer.Tokenizer or text.bpe.ByteTokenizer
    vocab.tokens[i]                        # the bytes token i adds to the text (b"" if special)
    vocab.special, vocab.eos               # control tokens; the tokens that end a sequence

A `tokenizers` vocabulary is spelled in its model's alphabet, not in bytes: byte-level BPE
(GPT-2, SmolLM2, Llama 3) writes each byte as one printable character ("Ġ" is the space), and
SentencePiece-style BPE (Llama 2, Gemma) writes the space as "▁" and bytes outside the pieces
as <0xNN> tokens. The tokenizer's decoder says which alphabet it is, so it is read here and
the pieces are turned back into bytes the same way the decoder would, one token at a time
(decoding a single token through the backend would drop a leading space and replace partial
UTF-8 with U+FFFD).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class Vocabulary:
    """tokens[i]: the bytes token i writes (b"" for a special token); special: the ids of
    control tokens (never text: a grammar never allows them); eos: the ids that end a
    sequence, in the tokenizer's order (the first is the main one)."""

    tokens: tuple[bytes, ...]
    special: frozenset[int]
    eos: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.tokens)


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as one printable character. The printable Latin-1
    bytes stand for themselves; the other 68 (controls, space, ...) take the code points from 256
    up, in byte order. Byte-level vocabularies are spelled in it ("Ġ" is the space)."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    alphabet, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            alphabet[byte] = chr(byte)
        else:
            alphabet[byte] = chr(256 + extra)
            extra += 1
    return alphabet


def vocabulary_of(tokenizer) -> Vocabulary:
    """The bytes of every token of a text.tokenizer.Tokenizer (byte-level or SentencePiece-style
    BPE) or a text.bpe.ByteTokenizer; ValueError for a decoder whose pieces are not bytes this
    way (WordPiece's "##", for one)."""
    if getattr(tokenizer, "kind", None) == "byte":  # bpe.ByteTokenizer: ids 0..255 are the bytes
        special = frozenset(range(256, tokenizer.vocab_size))
        tokens = tuple(bytes([i]) for i in range(256)) + (b"",) * len(special)
        return Vocabulary(tokens, special, (tokenizer.token_id("<|endoftext|>"),))
    backend = tokenizer.backend
    spell = _speller(backend)
    added = backend.get_added_tokens_decoder()
    special = frozenset(i for i, token in added.items() if token.special)
    tokens = []
    for index in range(tokenizer.vocab_size):
        piece = backend.id_to_token(index)
        if index in special or piece is None:
            tokens.append(b"")
        elif index in added:  # a user-defined token is matched as written
            tokens.append(added[index].content.encode("utf-8"))
        else:
            tokens.append(spell(piece))
    eos = tuple(dict.fromkeys(tokenizer.stop_token_ids))
    return Vocabulary(tuple(tokens), special, eos)


def _speller(backend):
    """piece -> bytes for the backend's alphabet, read from its decoder."""
    decoder = backend.decoder
    description = json.loads(decoder.__getstate__()) if decoder is not None else {}
    steps = description.get("decoders", [description])
    kinds = {step.get("type") for step in steps}
    if "ByteLevel" in kinds:
        to_byte = {char: byte for byte, char in byte_alphabet().items()}

        def spell_bytes(piece: str) -> bytes:
            return bytes(to_byte[char] for char in piece)

        return spell_bytes
    if "ByteFallback" in kinds or "Metaspace" in kinds:

        def spell_sentencepiece(piece: str) -> bytes:
            byte = BYTE_PIECE.fullmatch(piece)
            if byte:
                return bytes([int(byte.group(1), 16)])
            return piece.replace("▁", " ").encode("utf-8")

        return spell_sentencepiece
    raise ValueError(
        f"the tokenizer's decoder {sorted(k for k in kinds if k)} does not spell tokens as bytes "
        "(byte-level BPE or SentencePiece with byte fallback are understood)"
    )
