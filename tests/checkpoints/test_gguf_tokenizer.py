"""A real model's tokenizer (checkpoints.gguf.tokenizer from a GGUF file, text.tokenizer from an HF
folder), against transformers' tokenizer for the same file (AutoTokenizer with gguf_file=, or from the
folder) and, where the two disagree, against llama.cpp's pre-tokenizer split written out with `regex`."""

from __future__ import annotations

import json

import pytest
import regex
from helpers.gguf import (
    smollm2_tokenizer,
    tiny_vocabulary,
    transformers_smollm2_tokenizer,
    write_gguf,
)
from tokenizers import Tokenizer as Backend
from tokenizers import processors
from transformers import AutoTokenizer

import flashformer
from flashformer.checkpoints.checkpoint import CheckpointError
from flashformer.checkpoints.gguf.packaged_models import gemma3_path, smollm2_path
from flashformer.checkpoints.gguf.tokenizer import byte_alphabet, read_tokenizer
from flashformer.text import bpe
from flashformer.text.tokenizer import Tokenizer
from flashformer.train import corpus

BATTERY = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def square(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n",
    "spaces:  two   three    four     five, tabs:\t\t\tand newlines\n\n\n\nend \t \n",
    "3.14159265358979 and 1234567890123456789, 007, 1e-9, $12.50",
    "café naïve résumé Ångström São Paulo Ελληνικά русский",
    "日本語のテキスト、中文测试，한국어 텍스트",
    "emoji 🎉👍🏽 👨‍👩‍👧 🇫🇷 ok",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<repo_name>more<file_sep>",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "",
    " ",
]


@pytest.fixture(scope="module")
def ours():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def theirs():
    return transformers_smollm2_tokenizer()


@pytest.mark.parametrize("text", BATTERY)
def test_smollm2_encodes_and_decodes_as_transformers(ours, theirs, text):
    for add_special_tokens in (True, False):
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == theirs.encode(text, add_special_tokens=add_special_tokens)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    if "<|" not in text:
        assert ours.decode(ids) == text  # byte-level BPE loses nothing


def test_encode_many_is_encode_per_text(ours):
    assert ours.encode_many(BATTERY) == [ours.encode(text) for text in BATTERY]


def test_smollm2_special_tokens(ours, theirs):
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (1, 2, 2, 0)
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.encode("<|im_start|>user") == [1, 4093]  # the special token whole, not cut into pieces
    assert ours.token_id("<|im_end|>") == 2
    with pytest.raises(KeyError, match="not-a-token"):
        ours.token_id("not-a-token")
    assert ours.stop_token_ids == [2, 0]  # <|im_end|>, and <|endoftext|> as llama.cpp also stops there
    assert ours.vocab_size == len(theirs) == 49152 and ours.kind == "bpe"
    assert ours.add_bos_token is False and ours.encode("Hi")[0] != ours.bos_token_id


def llama_cpp_smollm_split(text: str) -> list[str]:
    """llama.cpp's pre-tokenizer for tokenizer.ggml.pre 'smollm' (as for 'starcoder'): each digit
    split off, then GPT-2's pattern; text no pattern matches stays a word of its own."""
    words = [text]
    for pattern in (r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"):
        pieces = []
        for word in words:
            start = 0
            for match in regex.finditer(pattern, word):
                pieces += [word[start : match.start()], match.group()]
                start = match.end()
            pieces.append(word[start:])
        words = [piece for piece in pieces if piece]
    return words


def reference_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    alphabet = byte_alphabet()
    ids = []
    for word in llama_cpp_smollm_split(text):
        ids += [
            token.id
            for token in tokenizer.backend.model.tokenize("".join(alphabet[b] for b in word.encode()))
        ]
    return ids


@pytest.mark.parametrize("text", [t for t in BATTERY if "<|" not in t and "<" not in t])
def test_the_reference_split_agrees_with_transformers_on_the_battery(theirs, ours, text):
    assert reference_ids(ours, text) == theirs.encode(text)


@pytest.mark.parametrize("text", ["x  1", "   12 34", "line\n\n 7.", "a =\t\t42"])
def test_whitespace_before_digits_splits_as_llama_cpp(ours, theirs, text):
    """tokenizer.ggml.pre 'smollm' splits each digit off before GPT-2's pattern (llama.cpp, and
    SmolLM2's own tokenizer.json: Digits then ByteLevel). transformers does not know the name and
    uses GPT-2's pattern alone, which hands the last space of a run to the number; so for a
    whitespace run before a digit the two differ, and we follow llama.cpp."""
    assert ours.encode(text) == reference_ids(ours, text)
    assert ours.decode(ours.encode(text)) == text


def test_save_gives_a_folder_transformers_and_we_read_alike(ours, theirs, tmp_path):
    ours.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    reloaded = Tokenizer.from_folder(tmp_path)
    from_folder = AutoTokenizer.from_pretrained(tmp_path)
    for text in BATTERY:
        ids = ours.encode(text)
        assert reloaded.encode(text) == ids == from_folder.encode(text), text
        assert reloaded.decode(ids) == ours.decode(ids) == from_folder.decode(ids, skip_special_tokens=True)
    assert reloaded.special_tokens == ours.special_tokens and reloaded.chat_template == ours.chat_template
    assert reloaded.stop_token_ids == ours.stop_token_ids
    messages = [{"role": "user", "content": "Hi"}]
    assert reloaded.apply_chat_template(messages, tokenize=False) == from_folder.apply_chat_template(
        messages, tokenize=False
    )


def test_load_tokenizer_reads_the_gguf_file_alone(ours):
    tokenizer = flashformer.load_tokenizer(smollm2_path())
    assert tokenizer.encode(BATTERY[1]) == ours.encode(BATTERY[1])
    with pytest.raises(CheckpointError, match="missing.gguf does not exist"):
        flashformer.load_tokenizer(smollm2_path().parent / "missing.gguf")


# ---- small vocabularies in GGUF files, each read by us and by transformers ----

SMALL_BATTERY = [
    "the and the",
    "  the\n\n\tand 12 123 1234",
    "<think>then</think>",
    "<|im_start|>x<|im_end|>",
    "é中🎉",
    "HTTPServer isOK, don't/x //y 12345 ÉtéÀ",
]


def _gguf_pair(tmp_path, metadata: dict):
    path = write_gguf(tmp_path / "tok.gguf", "llama", {"llama.block_count": 1, **metadata}, {})
    return read_tokenizer(path), AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2", "tekken", "gpt-4o"])
@pytest.mark.parametrize("add_bos", [False, True])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path, pre, add_bos):
    metadata = dict(tiny_vocabulary(), **{"tokenizer.ggml.pre": pre, "tokenizer.ggml.add_bos_token": add_bos})
    ours, theirs = _gguf_pair(tmp_path, metadata)
    for text in SMALL_BATTERY:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), (pre, text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert (ours.encode("x")[0] == ours.bos_token_id) == add_bos
    think = ours.token_id("<think>")
    assert think in ours.encode("<think>") and "<think>" in ours.decode(
        ours.encode("<think>")
    )  # kept in decode


def test_unknown_pre_tokenizer_is_refused(tmp_path):
    metadata = dict(tiny_vocabulary(), **{"tokenizer.ggml.pre": "mystery-bpe"})
    path = write_gguf(tmp_path / "tok.gguf", "llama", {"llama.block_count": 1, **metadata}, {})
    with pytest.raises(ValueError, match=r"tok\.gguf: tokenizer\.ggml\.pre='mystery-bpe'"):
        read_tokenizer(path)


def sentencepiece_vocabulary() -> dict:
    """A SentencePiece-style vocabulary: <unk> <s> </s>, 256 byte tokens, scored pieces, a user token."""
    pieces = ["▁", "t", "h", "e", "a", "n", "d", "i", "s", "x", "1", "2", "▁t", "he", "▁the", "▁a", "an"]
    pieces += ["▁and", "▁▁", "in", "▁is", "is", "▁▁▁▁", "12"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["<|user|>"]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4],
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [0.0],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    ours, theirs = _gguf_pair(tmp_path, sentencepiece_vocabulary())
    texts = [
        "the and is",
        " the  and",
        "this is x12",
        "héllo wörld 日本",
        "a\nb\tc",
        "<s>the</s>",
        "<|user|>hi",
    ]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ids[0] == 1  # SentencePiece files add BOS unless they say otherwise
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    # BOS, the prefix space "▁", then byte fallback for a piece the vocabulary lacks: <0xE6> <0x97> <0xA5>
    assert ours.encode("日") == [1, ours.token_id("▁"), 3 + 0xE6, 3 + 0x97, 3 + 0xA5]


# ---- Hugging Face folders ----


def test_hf_folder_with_config_special_tokens_and_templates(ours, tmp_path):
    """tokenizer.json's post-processor decides BOS (transformers ignores tokenizer_config.json's
    add_bos_token beside a tokenizer.json); special_tokens_map.json fills what the config lacks;
    named templates come as a list; generation_config.json's eos ids join the stop tokens."""
    backend = Backend.from_str(ours.backend.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    (tmp_path / "tokenizer.json").write_text(backend.to_str())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "chat_template": [
            {
                "name": "default",
                "template": "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}",
            },
            {"name": "tool_use", "template": "{{ tools | tojson }}{{ messages[0]['content'] }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    tokenizer, theirs = Tokenizer.from_folder(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for text in BATTERY:
        assert tokenizer.encode(text) == theirs.encode(text), text
        assert tokenizer.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        )
    assert tokenizer.encode("Hi")[0] == tokenizer.bos_token_id == theirs.bos_token_id == 1
    assert tokenizer.stop_token_ids == [2, 5, 0]
    messages = [{"role": "user", "content": "Hi"}]
    tools = [{"type": "function", "function": {"name": "f", "description": "é <b>"}}]
    for kwargs in ({}, {"tools": tools}, {"chat_template": "tool_use", "tools": tools}):
        expected = theirs.apply_chat_template(messages, tokenize=False, **kwargs)
        assert tokenizer.apply_chat_template(messages, tokenize=False, **kwargs) == expected, kwargs


def test_serves_flashformer_data_as_its_tokenizers_do(ours, tmp_path):
    """The data pipeline's interface: a token file written with this tokenizer holds each
    document's ids followed by <|endoftext|>."""
    texts = ["def f():\n    return 1\n", "café 日本 🎉"]
    for i, text in enumerate(texts):
        (tmp_path / f"doc{i}.txt").write_text(text)
    documents = corpus.resolve_corpus([str(tmp_path / "*.txt")])
    tokens = corpus.open_token_file(
        corpus.write_token_file(documents, ours, tmp_path / "tokens.bin", show_progress=False)
    )
    eos = ours.token_id(bpe.EOS)
    assert tokens.tolist() == ours.encode(texts[0]) + [eos] + ours.encode(texts[1]) + [eos]


# ---- Gemma 3's SentencePiece vocabulary (262,144 tokens, byte fallback), from the real file ----

GEMMA_EXTRA = [
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "   leading spaces and trailing   ",
    "a\n\n\n\nb\tc",
    "<bos>x<eos>",
    "\u00a0non-breaking space, ﬁ ligature, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def gemma_pair():
    path = gemma3_path()
    return read_tokenizer(path), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("text", BATTERY + GEMMA_EXTRA)
def test_gemma3_encodes_and_decodes_as_transformers(gemma_pair, text):
    ours, theirs = gemma_pair
    for add_special_tokens in (True, False):
        ids = ours.encode(text, add_special_tokens=add_special_tokens)
        assert ids == theirs.encode(text, add_special_tokens=add_special_tokens)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_gemma3_special_tokens_and_no_template(gemma_pair):
    ours, theirs = gemma_pair
    assert ours.vocab_size == len(theirs) == 262144 and ours.kind == "bpe"
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (2, 1, 0)
    assert ours.encode("Hi")[0] == 2  # the file says add_bos_token
    assert ours.token_id("<end_of_turn>") in ours.stop_token_ids
    assert ours.chat_template is None  # a base model: the file carries no template
