"""text.detokenizer: the pieces of a stream of tokens, against decoding the whole sequence each
time (the rule written out here, independently of the window the detokenizer decodes)."""

from __future__ import annotations

import random

import pytest
from helpers.gguf import smollm2_tokenizer

from flashformer.text.detokenizer import Detokenizer, stream_text

TEXTS = [
    "The capital of France is Paris.",
    "Emoji 🎉🎉 and 中文字符, then «quotes» — and a tab\tafter.",
    "def f(x):\n    return x ** 2  # é\n\n\nEND",
    "<|im_start|>user\nHi<|im_end|> special tokens are skipped",
]


def full_decode_pieces(tokenizer, ids, stops):
    """What a client must receive, by decoding every prefix whole: the text up to the first stop
    string, streamed without an incomplete character (its bytes decode to U+FFFD) and without a
    tail that may be a stop string's start, then the rest when the sequence ends."""
    sent, pieces = 0, []
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        cut = min([i for i in (text.find(s) for s in stops) if i >= 0], default=None)
        if cut is not None:
            pieces.append(text[sent:cut])
            return [p for p in pieces if p], True
        certain = text.rstrip("\ufffd")  # an incomplete character's bytes decode to U+FFFD
        held = max(
            [k for stop in stops for k in range(1, len(stop)) if certain.endswith(stop[:k])], default=0
        )
        end = max(len(certain) - held, sent)
        pieces.append(text[sent:end])
        sent = end
    pieces.append(tokenizer.decode(ids)[sent:])
    return [p for p in pieces if p], False


def detokenized_pieces(tokenizer, ids, stops):
    detokenizer, pieces = Detokenizer(tokenizer, stop=stops), []
    for token in ids:
        pieces.append(detokenizer.add(token))
        if detokenizer.stopped:
            break
    pieces.append(detokenizer.finish())
    return [p for p in pieces if p], detokenizer.stopped


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_the_whole_decode(text):
    tokenizer = smollm2_tokenizer()
    ids = tokenizer.encode(text)
    pieces = list(stream_text(tokenizer, ids))
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any(piece.endswith("\ufffd") for piece in pieces)


def test_a_character_split_over_tokens_waits_for_its_last_byte():
    tokenizer = smollm2_tokenizer()
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1  # a byte-level vocabulary splits the emoji
    detokenizer = Detokenizer(tokenizer)
    assert [detokenizer.add(t) for t in ids] == [""] * (len(ids) - 1) + ["🎉"]


@pytest.mark.parametrize("stops", [(), (".",), ("Paris",), ("\n\n",), ("and a", "—"), ("END", "🎉")])
@pytest.mark.parametrize("text", TEXTS)
def test_stop_strings_and_held_text_match_decoding_every_prefix(text, stops):
    tokenizer = smollm2_tokenizer()
    ids = tokenizer.encode(text)
    assert detokenized_pieces(tokenizer, ids, stops) == full_decode_pieces(tokenizer, ids, stops)


def test_random_token_streams_match_decoding_every_prefix():
    """Ids drawn at random (byte tokens in the middle of characters, special tokens) decode in
    pieces as the whole does."""
    tokenizer = smollm2_tokenizer()
    rng = random.Random(0)
    for _ in range(40):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        stops = rng.choice([(), ("e",), ("th", "in")])
        assert detokenized_pieces(tokenizer, ids, stops) == full_decode_pieces(tokenizer, ids, stops)


def test_after_a_stop_string_no_token_is_taken():
    tokenizer = smollm2_tokenizer()
    detokenizer = Detokenizer(tokenizer, stop=("Paris",))
    text = ""
    for token in tokenizer.encode("The capital is Paris. And"):
        text += detokenizer.add(token)
        if detokenizer.stopped:
            break
    assert detokenizer.stopped and text + detokenizer.finish() == "The capital is "
    with pytest.raises(ValueError, match="stop string"):
        detokenizer.add(13)
