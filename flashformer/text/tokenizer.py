"""The tokenizer of a real model on the `tokenizers` library, encoding and decoding as
transformers does for the same files.

    tokenizer = Tokenizer.from_folder("folder")                  # an HF folder with tokenizer.json
    ids = tokenizer.encode("Hello")                               # list[int]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    model.generate(..., eos_token_id=tokenizer.stop_token_ids)

A GGUF file's tokenizer is built from its metadata by checkpoints.gguf (read_tokenizer, or
flashformer.load with the model); the result is this same class.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from flashformer.files import write_atomic

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

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


class Tokenizer:
    """A `tokenizers` backend plus what transformers keeps beside it: the named special tokens,
    whether BOS/EOS are added, the chat template(s) and the tokens that end a turn.

    add_bos_token / add_eos_token: what a GGUF file asked for (the backend's post-processor adds
    them); None for an HF folder, whose tokenizer.json post-processor decides on its own.
    Satisfies the tokenizer interface of text.bpe and the trainer (kind, encode, encode_many, decode,
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
        tokenizer.stop_token_ids = unique_ids(stops)
        return tokenizer

    # ---- what the trainer and the data pipeline use (text.bpe's interface) ----

    @property
    def kind(self) -> str:
        kind = getattr(self.backend, "kind", None)  # text.sentencepiece's backend says it
        return kind or type(self.backend.model).__name__.lower()  # "bpe", "unigram", "wordpiece"

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
        from flashformer.text.chat_template import render_chat_template  # Jinja: for chats only

        template = self.chat_template_for(chat_template, tools)
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

    def chat_template_for(self, name_or_template: str | None = None, tools=None) -> str:
        """The template apply_chat_template renders with: one of the model's by name, a given
        template string, the model's "tool_use" template when tools are given and it has one,
        else its default. ValueError when there is none."""
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


# ---- small helpers ----


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _special_texts(backend: Backend) -> set[str]:
    return {token.content for token in backend.get_added_tokens_decoder().values() if token.special}


def unique_ids(ids) -> list[int]:
    return list(dict.fromkeys(int(i) for i in ids if i is not None))
