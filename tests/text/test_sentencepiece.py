"""text.sentencepiece: SentencePiece-style BPE that asks the vocabulary for merges as they arise,
against the same tokenizer on `tokenizers`' BPE with every merge derived up front (the form
transformers builds for a GGUF file and checkpoints.gguf keeps as the reference)."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from flashformer.checkpoints.gguf.packaged_models import gemma3_path
from flashformer.checkpoints.gguf.reader import read_file
from flashformer.checkpoints.gguf.tokenizer import read_tokenizer, sentencepiece_bpe, tokenizer_from_metadata
from flashformer.text.sentencepiece import SentencePieceBPE
from flashformer.text.tokenizer import Tokenizer

BYTES = [f"<0x{b:02X}>" for b in range(256)]


def random_vocabulary(seed: int, with_bytes: bool = True) -> tuple[list[str], list[float]]:
    """Pieces that overlap in many ways (every prefix of a kept piece is a piece, several splits
    join into one piece) and scores with ties, so the merge order is exercised."""
    rng = random.Random(seed)
    letters = list("abcde▁") + ["é", "日"]
    pieces = set(letters)
    while len(pieces) < 120:
        pieces.add("".join(rng.choice(letters) for _ in range(rng.randint(2, 5))))
    pieces = sorted(pieces)
    tokens = ["<unk>", "<s>", "</s>", *(BYTES if with_bytes else []), *pieces, "<ctl>", "<user>"]
    scores = (
        [0.0] * (len(tokens) - len(pieces) - 2) + [float(-rng.randint(0, 30)) for _ in pieces] + [0.0, 0.0]
    )
    return tokens, scores


def pair(tokens, scores, prefix: bool, merges=None):
    """(ours, reference) with the same added tokens and BOS."""
    ours = SentencePieceBPE(
        tokens,
        scores=None if merges else scores,
        merges=merges,
        add_space_prefix=prefix,
        bos=1,
        reference=lambda: sentencepiece_bpe(tokens, scores, merges, prefix),
    )
    reference = Backend.from_str(ours.to_str())  # no added tokens yet: the plain reference
    added = [
        AddedToken("<ctl>", special=True, normalized=False),
        AddedToken("<s>", special=True, normalized=False),
    ]
    user = [AddedToken("<user>", special=False, normalized=False)]
    for backend in (ours, reference):
        backend.add_special_tokens(added)
        backend.add_tokens(user)
    return ours, reference


def random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    parts = list("abcde  \n\té日") + ["<ctl>", "<s>", "<user>", "x", "ß", "🎉", "<ct", "abc", "▁"]
    return ["".join(rng.choice(parts) for _ in range(rng.randint(0, 40))) for _ in range(count)]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("prefix", [True, False])
def test_random_vocabularies_encode_and_decode_as_tokenizers_bpe(seed, prefix):
    tokens, scores = random_vocabulary(seed)
    ours, reference = pair(tokens, scores, prefix)
    for text in random_texts(seed, 400):
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert ours.encode(text).ids == [1, *ids]  # the BOS given
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            )


def test_merges_from_the_file_rank_as_given():
    """A file with tokenizer.ggml.merges: those pairs and ranks, not the scores' order."""
    tokens, scores = random_vocabulary(3)
    vocab = set(tokens)
    splits = [(t[:i], t[i:]) for t in tokens if "<" not in t for i in range(1, len(t))]
    merges = [f"{a} {b}" for a, b in splits if a in vocab and b in vocab]
    random.Random(3).shuffle(merges)
    ours, reference = pair(tokens, scores, True, merges=merges)
    for text in random_texts(3, 300):
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text, add_special_tokens=False).ids, text


def test_the_vocabulary_interface():
    tokens, scores = random_vocabulary(0)
    ours, reference = pair(tokens, scores, True)
    assert ours.get_vocab_size() == reference.get_vocab_size(with_added_tokens=True) == len(tokens)
    assert ours.get_vocab() == reference.get_vocab(with_added_tokens=True)
    assert ours.token_to_id("<ctl>") == reference.token_to_id("<ctl>") and ours.token_to_id("zz") is None
    assert ours.id_to_token(5) == reference.id_to_token(5) and ours.id_to_token(len(tokens)) is None
    theirs = {i: (t.content, t.special) for i, t in reference.get_added_tokens_decoder().items()}
    assert {i: (t.content, t.special) for i, t in ours.get_added_tokens_decoder().items()} == theirs
    # a text beyond the vocabulary gets the next id, as `tokenizers` gives it
    assert ours.add_tokens([AddedToken("<new>")]) == reference.add_tokens([AddedToken("<new>")]) == 1
    assert ours.token_to_id("<new>") == reference.token_to_id("<new>") == len(tokens)
    assert ours.encode("a<new>b", False).ids == reference.encode("a<new>b", add_special_tokens=False).ids
    assert ours.num_special_tokens_to_add() == 1
    assert json.loads(ours.to_str())["model"]["type"] == "BPE"


def test_a_character_without_byte_tokens_is_named():
    tokens, scores = random_vocabulary(0, with_bytes=False)
    ours = SentencePieceBPE(tokens, scores=scores)
    with pytest.raises(ValueError, match=r"'ß' is not in the vocabulary and it has no <0xNN> byte tokens"):
        ours.encode("aß")
    with pytest.raises(ValueError, match="needs scores"):
        SentencePieceBPE(tokens)
    with pytest.raises(ValueError, match=r"scores has 2 entries for \d+ tokens"):
        SentencePieceBPE(tokens, scores=[0.0, 1.0])


def test_gemma3_random_texts_as_the_derived_merges_give():
    """The real 262,144-token vocabulary, random mixes of its pieces and of scripts, against
    `tokenizers` with the 514,847 derived merges."""
    path = gemma3_path()
    ours = read_tokenizer(path)
    assert isinstance(ours.backend, SentencePieceBPE)
    reference = Tokenizer(Backend.from_str(ours.backend.to_str()), dict(ours.special_tokens))
    rng = random.Random(0)
    pieces = [ours.backend.id_to_token(rng.randrange(ours.vocab_size)) for _ in range(300)]
    parts = pieces + list(" \n\tabcé日本🎉1234.,") + ["<start_of_turn>", "<eos>", "  "]
    for _ in range(300):
        text = "".join(rng.choice(parts) for _ in range(rng.randint(0, 30)))
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == reference.encode(text, add_special_tokens=False), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                ids, skip_special_tokens=skip
            )


def test_gemma3_tokenizer_holds_no_merge_table():
    """What the file gives is what is kept: the pieces, one float a score, one dict from piece to id."""
    metadata = read_file(gemma3_path()).metadata
    backend = tokenizer_from_metadata(metadata).backend
    assert backend._ranks is None and len(backend._scores) == len(backend._vocab) == 262144
    assert backend._tokens is metadata["tokenizer.ggml.tokens"]  # not copied
