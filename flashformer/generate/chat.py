"""A conversation with a decoder model, through its chat template.

    chat = Chat(model, tokenizer, system="You are terse.", do_sample=False)
    for piece in chat.send("What is the capital of France?"):
        print(piece, end="")

Each turn the whole history is rendered again by the model's chat template
(as transformers' apply_chat_template would), so the prompt is exactly what
the template makes of the conversation. The KV cache of the earlier turns is
kept: the new prompt is compared token by token with what the cache holds,
and only the tokens after the first difference are computed. Generation
stops at the tokens that end a turn (tokenizer.stop_token_ids).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from flashformer.generate.cache import RecurrentState, make_caches
from flashformer.generate.draft_model import common_prefix
from flashformer.generate.mixin import stream_tokens
from flashformer.generate.proposers import check_speculation
from flashformer.generate.sampling import TokenHistory, make_generator, settings_from
from flashformer.generate.session import DecoderSession
from flashformer.text.detokenizer import stream_text


class Chat:
    """The messages so far, the KV cache holding their tokens, and the
    generation settings (transformers' names: max_new_tokens, do_sample,
    temperature, top_k, top_p, repetition_penalty, compile; seed makes a
    sampled conversation repeatable).

    context: the tokens the cache holds; when a turn would not fit, the oldest
    exchanges (after the system message) are dropped from the history.
    chat_template: a Jinja template to use instead of the tokenizer's own.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        system: str | None = None,
        context: int | None = None,
        seed: int | None = None,
        chat_template: str | None = None,
        **settings,
    ):
        if model.config.arch != "decoder":
            raise ValueError(f"a chat needs a decoder model (GPT-2, LLaMA); got arch {model.config.arch!r}")
        if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "this model's tokenizer has no chat template: give one (--chat-template FILE), or use "
                "`generate` without --chat"
            )
        if not hasattr(tokenizer, "apply_chat_template"):
            raise ValueError(
                "a chat needs a tokenizer with special tokens and templates, not a byte tokenizer"
            )
        self.model, self.tokenizer, self.chat_template = model, tokenizer, chat_template
        self.messages: list[dict] = [{"role": "system", "content": system}] if system else []
        limit = model.config.max_seq_len
        self.context = min(limit, context or 4096)
        if not 1 < self.context <= limit:
            raise ValueError(f"context must be in [2, {limit}] (the model's max_seq_len); got {context}")
        self.settings = dict(settings)
        self.settings.setdefault("max_new_tokens", 512)
        self.settings.setdefault("eos_token_id", tokenizer.stop_token_ids)
        check_speculation(settings_from(model, **dict(self.settings, max_new_tokens=1)), model)  # all now
        self.device = next(model.parameters()).device
        self.generator = make_generator(None, seed, self.device)
        self.caches = self._new_caches()
        self.cached: list[int] = []  # the tokens whose keys and values the cache holds, in order
        self.reused = 0  # of the last prompt, the tokens found in the cache

    def _new_caches(self) -> list:
        return make_caches(
            self.model,
            1,
            self.context,
            self.device,
            self.settings.get("cache_type_k"),
            self.settings.get("cache_type_v"),
        )

    def prompt_ids(self) -> list[int]:
        """The conversation so far, rendered by the template, ending with the assistant's turn."""
        return self.tokenizer.apply_chat_template(
            self.messages, add_generation_prompt=True, chat_template=self.chat_template
        )

    def send(self, text: str) -> Iterator[str]:
        """Add a user message; yield the answer's text as it is generated. The answer (whole, or
        as far as it got if the caller stops iterating) joins the history."""
        self.messages.append({"role": "user", "content": text})
        ids = self._fit()
        room = self.context - len(ids)
        settings = settings_from(
            self.model, **dict(self.settings, max_new_tokens=min(self.settings["max_new_tokens"], room))
        )
        self.reused = min(common_prefix(self.cached, ids), len(ids) - 1)
        held = {cache.length for cache in self.caches if isinstance(cache, RecurrentState)}
        if held and held != {self.reused}:  # a conv state (LFM2) cannot rewind: the prompt runs again
            self.caches, self.reused = self._new_caches(), 0
        input_ids = torch.tensor([ids], device=self.device)
        session = DecoderSession(self.model, input_ids, None, settings, self.caches, self.reused)
        history = TokenHistory.for_settings(settings, input_ids, None, self.model.config.vocab_size)
        answer: list[int] = []
        try:
            tokens = (int(t[0]) for t in stream_tokens(session, settings, history, self.generator))
            yield from stream_text(self.tokenizer, _recording(tokens, answer))
        finally:  # also when the caller stops early (Ctrl-C): the history keeps what was said
            self.cached = (ids + answer)[: max(session.length, self.reused)]
            self.messages.append({"role": "assistant", "content": self.tokenizer.decode(answer)})

    def _fit(self) -> list[int]:
        """The prompt, after dropping the oldest exchanges until it leaves room for an answer."""
        while True:
            ids = self.prompt_ids()
            if len(ids) < self.context:
                return ids
            first = 1 if self.messages and self.messages[0]["role"] == "system" else 0
            if len(self.messages) - first <= 1:
                self.messages.pop()
                raise ValueError(
                    f"the message alone is {len(ids)} tokens with the template, beyond the chat's context of "
                    f"{self.context} tokens"
                )
            del self.messages[first : first + 2]  # the oldest user message and its answer


def _recording(tokens: Iterator[int], into: list[int]) -> Iterator[int]:
    for token in tokens:
        into.append(token)
        yield token
