"""A GGUF file's tokenizer, from its metadata: the same text.tokenizer.Tokenizer an HF folder gives.

    tokenizer = read_tokenizer("model.gguf")             # the metadata only; no tensor is read
    tokenizer = tokenizer_from_metadata(checkpoint.metadata, source=str(path))

A GGUF file has no tokenizer.json: it lists the tokens, their types and the merges, and names
the pre-tokenizer (`tokenizer.ggml.pre`, the regex that cuts text into words before the merges
run) that llama.cpp's converter recognised. That name decides how digits and whitespace split,
so it is mapped here to the same split llama.cpp applies, and an unknown name is refused rather
than guessed. Byte-level BPE (`tokenizer.ggml.model` "gpt2") and SentencePiece-style BPE with
byte fallback ("llama") are built.
"""

from __future__ import annotations

from array import array
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from flashformer.checkpoints.gguf.reader import read_file
from flashformer.text.sentencepiece import SentencePieceBPE
from flashformer.text.tokenizer import END_OF_TURN_TEXTS, Tokenizer, unique_ids
from flashformer.text.vocabulary import byte_alphabet

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# ---- pre-tokenizers named by tokenizer.ggml.pre ----

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
# Mistral's tekken and OpenAI's o200k (gpt-4o, Llama 4): words split at a case change (an
# upper-case run may lead a lower-case one), digits one by one (tekken) or in threes (gpt-4o,
# which also keeps English contractions on the word), and "/" kept with a punctuation run
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_TAIL = r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}|{_TAIL}"
)
GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}|\p{{N}}{{1,3}}|{_TAIL}"
)


def _gpt2():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2():  # each digit its own word, then GPT-2's split (StarCoder, SmolLM)
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _regex(pattern: str):
    def build():
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )

    return build


# name -> (pre-tokenizer, whether a word found whole in the vocabulary skips the merges),
# grouped as llama.cpp groups the names (llama-vocab.cpp)
PRE_TOKENIZERS = {
    **dict.fromkeys(("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais"), (_gpt2, False)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        (_digits_then_gpt2, False),
    ),
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "smaug-bpe",
            "dbrx",
        ),
        (_regex(LLAMA3_SPLIT), True),
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "stablelm2", "megrez"), (_regex(QWEN2_SPLIT), False)
    ),
    "tekken": (_regex(TEKKEN_SPLIT), True),
    **dict.fromkeys(("gpt-4o", "llama4"), (_regex(GPT4O_SPLIT), False)),
}


def read_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a GGUF file, from its metadata (its tensors are not read)."""
    return tokenizer_from_metadata(read_file(path).metadata, source=str(path))


def tokenizer_from_metadata(metadata: dict, source: str = "the GGUF metadata") -> Tokenizer:
    """From the tokenizer.* keys of a GGUF file (read_gguf(...).metadata)."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{source}: no tokenizer.ggml.tokens; the file carries no tokenizer")
    types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(
            f"{source}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    if kind == "gpt2":
        backend = _byte_level_bpe(metadata, tokens, source)
    elif kind in ("llama", "gemma4"):  # gemma4: SentencePiece-style BPE with merges, no space prefix
        backend = _compact_sentencepiece_bpe(metadata, tokens, source)
    else:
        raise ValueError(
            f"{source}: tokenizer.ggml.model={kind!r} is not supported (supported: 'gpt2', 'llama', 'gemma4')"
        )

    # Control tokens are matched whole in text and skipped in decode; user-defined ones (<think>)
    # are matched whole but decoded. Only where the vocabulary holds the text as it is written:
    # a byte-level vocabulary respelled it otherwise, and adding it would create a new id.
    marked = [i for i, token_type in enumerate(types) if token_type == CONTROL or token_type == USER_DEFINED]
    added = [
        AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
        for i in marked
        if backend.token_to_id(tokens[i]) is not None
    ]
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])

    def token_at(key: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{key}")
        if index is None:
            return None
        if not 0 <= index < len(tokens):
            raise ValueError(f"{source}: tokenizer.ggml.{key}={index} is outside the {len(tokens)} tokens")
        return tokens[index]

    special = {
        "bos_token": token_at("bos_token_id"),
        "eos_token": token_at("eos_token_id"),
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
    }
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    template = _bos_eos_template(backend, special, add_bos, add_eos, source)
    if isinstance(backend, SentencePieceBPE):
        backend.bos, backend.eos = (None if part is None else part[1] for part in template)
    else:
        backend.post_processor = _template_processing(*template)

    stops = [metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    stops += [i for i in marked if types[i] == CONTROL and tokens[i] in END_OF_TURN_TEXTS]
    return Tokenizer(backend, special, add_bos, add_eos, _gguf_chat_templates(metadata), unique_ids(stops))


# ---- builders from GGUF metadata ----


def _byte_level_bpe(metadata: dict, tokens: list[str], source: str) -> Backend:
    """Byte-level BPE: the vocabulary spelled in GPT-2's byte alphabet, merges from the file."""
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError(
            f"{source}: a byte-level BPE tokenizer (tokenizer.ggml.model 'gpt2') needs tokenizer.ggml.merges"
        )
    pre = metadata.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{source}: tokenizer.ggml.pre={pre!r} names a pre-tokenizer flashformer does not know; "
            f"known: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    pre_tokenizer, ignore_merges = PRE_TOKENIZERS[pre]
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    # a token spelled with characters outside the alphabet is written as plain text: respell it
    # (one look at all the tokens first: a converted file spells them all in the alphabet)
    spelled = tokens
    if not set("".join(tokens)) <= letters:
        spelled = [
            t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens
        ]
    pairs = [tuple(merge.split(" ")) for merge in merges]
    if any(len(pair) != 2 for pair in pairs):
        rank = next(rank for rank, pair in enumerate(pairs) if len(pair) != 2)
        raise ValueError(
            f"{source}: tokenizer.ggml.merges[{rank}]={merges[rank]!r} is not two tokens joined by a space"
        )
    vocab = dict(zip(spelled, range(len(spelled))))
    backend = Backend(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    return backend


def _compact_sentencepiece_bpe(metadata: dict, tokens: list[str], source: str) -> SentencePieceBPE:
    """SentencePiece-style BPE ("▁" for the space, byte fallback to <0xNN> tokens) on
    text.sentencepiece: the merges asked of the vocabulary as they arise instead of derived up
    front (Gemma 3: about 44 MB and 0.2 s against `tokenizers`' 80 MB and 3 s). The
    `tokenizers` form, sentencepiece_bpe below, is its reference and its tokenizer.json."""
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError(f"{source}: a SentencePiece tokenizer needs tokenizer.ggml.scores, one per token")
    scores = array("d", scores)  # 8 bytes a token, not a Python float's 32
    merges = metadata.get("tokenizer.ggml.merges")
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    return SentencePieceBPE(
        tokens,
        scores=scores if merges is None else None,
        merges=merges,
        add_space_prefix=prefix,
        reference=lambda: sentencepiece_bpe(tokens, scores, merges, prefix),
    )


def sentencepiece_bpe(tokens: list[str], scores, merges: list[str] | None, add_space_prefix: bool) -> Backend:
    """The same tokenizer on `tokenizers`' BPE. The file gives a score per token instead of
    merges; the merges are the pairs of tokens that join into a token, best score first, as
    transformers derives them (or the file's tokenizer.ggml.merges where it has them)."""
    vocab = {token: index for index, token in enumerate(tokens)}
    if merges is not None:
        pairs = [tuple(merge.split(" ")) for merge in merges]
    else:
        pairs = _merges_from_scores(tokens, scores, vocab)
    backend = Backend(models.BPE(vocab, pairs, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(
    tokens: list[str], scores: list[float], vocab: dict[str, int]
) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, ordered by the joined token's score (best
    first), then the longer left part, then the longer right part, then the token's place in
    the vocabulary (a split point fixes both parts, so a token's splits never tie).

    One pass over plain tuples, sorted once: 262,144 Gemma tokens in about a second."""
    candidates = []  # (score, len(left), len(right), -index): sorted descending
    for index, (token, score) in enumerate(zip(tokens, scores)):
        n = len(token)
        candidates += [
            (score, i, n - i, -index) for i in range(1, n) if token[:i] in vocab and token[i:] in vocab
        ]
    candidates.sort(reverse=True)
    return [(tokens[-index][:i], tokens[-index][i:]) for _, i, _, index in candidates]


def _bos_eos_template(backend, special: dict, add_bos: bool, add_eos: bool, source: str):
    """(BOS, EOS) as (token, id) or None each: what the file asks to add before and after a text."""
    parts = {}
    for name, wanted in (("bos_token", add_bos), ("eos_token", add_eos)):
        if not wanted:
            continue
        token = special.get(name)
        index = None if token is None else backend.token_to_id(token)
        if index is None:
            raise ValueError(f"{source}: add_{name}=True but the tokenizer has no {name} in its vocabulary")
        parts[name] = (token, index)
    return parts.get("bos_token"), parts.get("eos_token")


def _template_processing(bos: tuple[str, int] | None, eos: tuple[str, int] | None):
    """The `tokenizers` post-processor that adds BOS before and EOS after a text."""
    first = [bos[0]] if bos else []
    last = [eos[0]] if eos else []
    single = [*first, "$A:0", *last]
    pair = [*single, *first, "$B:1", *last]
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[part for part in (bos, eos) if part]
    )


def _gguf_chat_templates(metadata: dict) -> str | dict[str, str] | None:
    """tokenizer.chat_template, plus the named ones llama.cpp stores as tokenizer.chat_template.<name>."""
    main = metadata.get("tokenizer.chat_template")
    named = {
        key.removeprefix("tokenizer.chat_template."): value
        for key, value in metadata.items()
        if key.startswith("tokenizer.chat_template.") and isinstance(value, str)
    }
    if not named:
        return main
    return {**({"default": main} if main is not None else {}), **named}
