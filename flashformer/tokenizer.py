"""The tokenizer of a real model, from a GGUF file's metadata or a Hugging Face folder, on the
`tokenizers` library, encoding and decoding as transformers does for the same files.

    tokenizer = Tokenizer.from_pretrained("model.gguf")          # or an HF folder with tokenizer.json
    ids = tokenizer.encode("Hello")                               # list[int]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    model.generate(..., eos_token_id=tokenizer.stop_token_ids)

A GGUF file has no tokenizer.json: it lists the tokens, their types and the merges, and names
the pre-tokenizer (`tokenizer.ggml.pre`, the regex that cuts text into words before the merges
run) that llama.cpp's converter recognised. That name decides how digits and whitespace split,
so it is mapped here to the same split llama.cpp applies, and an unknown name is refused rather
than guessed. Byte-level BPE (`tokenizer.ggml.model` "gpt2") and SentencePiece-style BPE with
byte fallback ("llama") are built.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from flashformer.chat_template import render_chat_template
from flashformer.files import write_atomic
from flashformer.gguf.reader import read_file

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Control tokens that end a turn in the common chat formats. llama.cpp stops generation at these
# (its end-of-generation set) besides the EOS and EOT ids the file names.
END_OF_TURN_TEXTS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "<end_of_utterance>",
)

# ---- pre-tokenizers named by tokenizer.ggml.pre ----

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


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
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "smaug-bpe", "dbrx"),
        (_regex(LLAMA3_SPLIT), True),
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), (_regex(QWEN2_SPLIT), False)),
}


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


class Tokenizer:
    """A `tokenizers` backend plus what transformers keeps beside it: the named special tokens,
    whether BOS/EOS are added, the chat template(s) and the tokens that end a turn.

    add_bos_token / add_eos_token: what a GGUF file asked for (the backend's post-processor adds
    them); None for an HF folder, whose tokenizer.json post-processor decides on its own.
    Satisfies flashformer.data's tokenizer interface (kind, encode, encode_many, decode,
    token_id, save, vocab_size).
    """

    def __init__(
        self,
        backend: Backend,
        special_tokens: dict[str, str | None] | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        chat_template: str | dict[str, str] | None = None,
        stop_token_ids: list[int] | None = None,
    ):
        self.backend = backend
        self.special_tokens = {name: (special_tokens or {}).get(name) for name in SPECIAL_NAMES}
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self.chat_template = chat_template
        eos = self.eos_token_id
        self.stop_token_ids = list(stop_token_ids) if stop_token_ids else ([eos] if eos is not None else [])
        # every named special token is matched whole in text and skipped in decode, as in transformers
        named = [token for token in self.special_tokens.values() if token is not None]
        self.backend.add_special_tokens(
            [AddedToken(token, special=True, normalized=False) for token in named]
        )

    # ---- construction ----

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """From a .gguf file or a Hugging Face folder (tokenizer.json)."""
        path = Path(path)
        if path.is_dir():
            return cls.from_folder(path)
        if path.is_file():
            return cls.from_gguf(path)
        raise FileNotFoundError(
            f"no tokenizer at {path}: expected a .gguf file or a folder with tokenizer.json"
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """From a GGUF file's metadata (its tensors are not read)."""
        return cls.from_gguf_metadata(read_file(path).metadata, source=str(path))

    @classmethod
    def from_gguf_metadata(cls, metadata: dict, source: str = "the GGUF metadata") -> Tokenizer:
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
        elif kind == "llama":
            backend = _sentencepiece_bpe(metadata, tokens, types, source)
        else:
            raise ValueError(
                f"{source}: tokenizer.ggml.model={kind!r} is not supported (supported: 'gpt2', 'llama')"
            )

        # Control tokens are matched whole in text and skipped in decode; user-defined ones (<think>)
        # are matched whole but decoded. Only where the vocabulary holds the text as it is written:
        # a byte-level vocabulary respelled it otherwise, and adding it would create a new id.
        vocab = backend.get_vocab()
        added = [
            AddedToken(token, special=token_type == CONTROL, normalized=False)
            for token, token_type in zip(tokens, types)
            if token_type in (CONTROL, USER_DEFINED) and token in vocab
        ]
        backend.add_special_tokens([t for t in added if t.special])
        backend.add_tokens([t for t in added if not t.special])

        def token_at(key: str) -> str | None:
            index = metadata.get(f"tokenizer.ggml.{key}")
            if index is None:
                return None
            if not 0 <= index < len(tokens):
                raise ValueError(
                    f"{source}: tokenizer.ggml.{key}={index} is outside the {len(tokens)} tokens"
                )
            return tokens[index]

        special = {
            "bos_token": token_at("bos_token_id"),
            "eos_token": token_at("eos_token_id"),
            "unk_token": token_at("unknown_token_id"),
            "pad_token": token_at("padding_token_id"),
        }
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        backend.post_processor = _bos_eos_template(backend, special, add_bos, add_eos, source)

        stops = [metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
        stops += [
            i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in END_OF_TURN_TEXTS
        ]
        return cls(backend, special, add_bos, add_eos, _gguf_chat_templates(metadata), _unique(stops))

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """From a Hugging Face folder: tokenizer.json, and where present tokenizer_config.json,
        special_tokens_map.json, chat_template.jinja (+ additional_chat_templates/*.jinja) and
        generation_config.json (its eos_token_id list joins the stop tokens)."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        backend.no_padding()  # a tokenizer.json may pad or cut every text to a fixed length: never here
        backend.no_truncation()
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        special = {name: _token_text(config.get(name, special_map.get(name))) for name in SPECIAL_NAMES}
        # tokenizer.json's post-processor decides whether BOS/EOS are added: transformers (5.x) drops
        # tokenizer_config.json's add_bos_token/add_eos_token when a tokenizer.json is present
        templates = {}
        if (folder / "chat_template.jinja").is_file():
            templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        for path in sorted((folder / "additional_chat_templates").glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
        if not templates and config.get("chat_template") is not None:
            template = config["chat_template"]
            templates = (
                template if isinstance(template, str) else {t["name"]: t["template"] for t in template}
            )
        if isinstance(templates, dict) and list(templates) == ["default"]:
            templates = templates["default"]

        tokenizer = cls(backend, special, None, None, templates or None)
        generation_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        stops = [tokenizer.eos_token_id]
        stops += generation_eos if isinstance(generation_eos, list) else [generation_eos]
        stops += [backend.token_to_id(text) for text in END_OF_TURN_TEXTS if text in _special_texts(backend)]
        tokenizer.stop_token_ids = _unique(stops)
        return tokenizer

    # ---- what the trainer and the data pipeline use (flashformer.data) ----

    @property
    def kind(self) -> str:
        return type(self.backend.model).__name__.lower()  # "bpe", "unigram", "wordpiece"

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added tokens included (transformers' len(tokenizer))."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens: add BOS/EOS as the model expects (special tokens written in the text
        are always matched whole, as transformers does)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_many(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Several texts at once: the Rust tokenizer spreads them over the cores."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int:
        index = self.backend.token_to_id(token)
        if index is None:
            raise KeyError(f"token {token!r} is not in the tokenizer's vocabulary")
        return index

    # ---- special tokens ----

    def _id(self, name: str) -> int | None:
        token = self.special_tokens[name]
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._id("unk_token")

    # ---- chat ----

    def apply_chat_template(
        self,
        messages: list[dict] | list[list[dict]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **kwargs,
    ) -> str | list[int] | list[str] | list[list[int]]:
        """The conversation rendered by the model's chat template, as transformers renders it:
        the template sees messages, add_generation_prompt, tools, documents, the special tokens
        (bos_token, eos_token, ...) and any extra keyword argument. tokenize=True encodes the
        text without adding BOS/EOS (the template writes them). A list of conversations gives a
        list of results. chat_template: a template string, or the name of one of the model's."""
        template = self._chat_template(chat_template, tools)
        batch = bool(messages) and isinstance(messages[0], list | tuple)
        variables = {name: token for name, token in self.special_tokens.items() if token is not None}
        variables.update(kwargs)
        results = []
        for conversation in messages if batch else [messages]:
            text = render_chat_template(
                template,
                conversation,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=documents,
                **variables,
            )
            results.append(self.encode(text, add_special_tokens=False) if tokenize else text)
        return results if batch else results[0]

    def _chat_template(self, name_or_template: str | None, tools) -> str:
        templates = self.chat_template
        if isinstance(templates, dict):
            if name_or_template in templates:
                return templates[name_or_template]
            if name_or_template is not None:
                return name_or_template
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(
                f"the tokenizer has several chat templates and none is 'default': pass chat_template= one of "
                f"{sorted(templates)}"
            )
        if name_or_template is not None:
            return name_or_template
        if templates is None:
            raise ValueError(
                "the tokenizer has no chat template; pass chat_template= a Jinja template string"
            )
        return templates

    # ---- saving ----

    def save(self, folder: str | Path) -> None:
        """tokenizer.json, tokenizer_config.json and chat_template.jinja (plus
        additional_chat_templates/ for named ones), each written atomically, in the layout
        transformers' AutoTokenizer reads."""
        folder = Path(folder)
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
        config.update({name: token for name, token in self.special_tokens.items() if token is not None})
        if self.add_bos_token is not None:
            config.update(add_bos_token=self.add_bos_token, add_eos_token=self.add_eos_token)
        write_atomic(folder / "tokenizer.json", self.backend.to_str())
        write_atomic(
            folder / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        )
        templates = self.chat_template
        if isinstance(templates, str):
            templates = {"default": templates}
        for name, template in (templates or {}).items():
            path = "chat_template.jinja" if name == "default" else f"additional_chat_templates/{name}.jinja"
            write_atomic(folder / path, template)


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
    spelled = [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")) for t in tokens]
    pairs = []
    for rank, merge in enumerate(merges):
        pair = tuple(merge.split(" "))
        if len(pair) != 2:
            raise ValueError(
                f"{source}: tokenizer.ggml.merges[{rank}]={merge!r} is not two tokens joined by a space"
            )
        pairs.append(pair)
    vocab = {token: index for index, token in enumerate(spelled)}
    backend = Backend(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(metadata: dict, tokens: list[str], types: list[int], source: str) -> Backend:
    """SentencePiece-style BPE ("▁" for the space, byte fallback to <0xNN> tokens).

    The file gives a score per token instead of merges; the merges are the pairs of tokens that
    join into a token, best score first, as transformers derives them."""
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError(f"{source}: a SentencePiece tokenizer needs tokenizer.ggml.scores, one per token")
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None:
        pairs = [tuple(merge.split(" ")) for merge in merges]
    else:
        candidates = []
        for token, score in zip(tokens, scores):
            splits = [(token[:i], token[i:]) for i in range(1, len(token))]
            splits = [(a, b) for a, b in splits if a in vocab and b in vocab]
            candidates += [(a, b, score) for a, b in sorted(splits, key=lambda p: (vocab[p[0]], vocab[p[1]]))]
        candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
        pairs = [(a, b) for a, b, _ in candidates]
    backend = Backend(models.BPE(vocab, pairs, fuse_unk=True, byte_fallback=True))
    prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _bos_eos_template(backend: Backend, special: dict, add_bos: bool, add_eos: bool, source: str):
    """The post-processor that adds BOS before and EOS after a text, as the file asks."""
    parts = {}
    for name, wanted in (("bos_token", add_bos), ("eos_token", add_eos)):
        if not wanted:
            continue
        token = special.get(name)
        index = None if token is None else backend.token_to_id(token)
        if index is None:
            raise ValueError(f"{source}: add_{name}=True but the tokenizer has no {name} in its vocabulary")
        parts[name] = (token, index)
    bos = [parts["bos_token"][0]] if "bos_token" in parts else []
    eos = [parts["eos_token"][0]] if "eos_token" in parts else []
    single = [*bos, "$A:0", *eos]
    pair = [*single, *bos, "$B:1", *eos]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=list(parts.values()))


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


# ---- small helpers ----


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _special_texts(backend: Backend) -> set[str]:
    return {token.content for token in backend.get_added_tokens_decoder().values() if token.special}


def _unique(ids) -> list[int]:
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def stream_text(tokenizer, tokens: Iterator[int]) -> Iterator[str]:
    """The text of a stream of new tokens, piece by piece, as it becomes certain.

    A token can end in the middle of a character's UTF-8 bytes (byte-level
    vocabularies split emoji and CJK that way): such a piece decodes to
    U+FFFD, so it is held back until the next token completes it. The pieces
    join to tokenizer.decode(all tokens).
    """
    ids: list[int] = []
    shown = ""
    for token in tokens:
        ids.append(int(token))
        text = tokenizer.decode(ids)
        if not text.endswith("\ufffd") and len(text) > len(shown):
            yield text[len(shown) :]
            shown = text
    rest = tokenizer.decode(ids)[len(shown) :]
    if rest:
        yield rest
