"""The tokenizer's endpoints, as vLLM names and shapes them (llama.cpp's server has the same
two): a client counts or builds prompts in the served model's own tokens.

    POST /tokenize        {"prompt": text, "add_special_tokens": true, "return_token_strs": false}
                          or {"messages": [...], "add_generation_prompt": true}
                       -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize      {"tokens": [ids]} -> {"prompt": text}
    GET  /tokenizer_info  the special tokens and the context (what lm-evaluation-harness'
                          remote tokenizer reads before it uses the two above)

A messages request renders the chat template exactly as /v1/chat/completions does, so its
count equals that request's usage.prompt_tokens. Outside /v1, as in vLLM: no API key.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from flashformer.serve.http.protocol import APIError, check_model


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(min_length=0)


def add_tokenizer_routes(app: FastAPI, engine, model_name: str) -> None:
    """/tokenize, /detokenize and /tokenizer_info for a text engine's tokenizer."""
    tokenizer = engine.tokenizer

    def check(name: str | None) -> None:
        if name is not None:  # an adapter's tokenizer is the base's
            check_model(name, model_name, engine)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give prompt (a text) or messages (a chat), not both or neither",
                           param="prompt")  # fmt: skip
        if body.prompt is not None:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        elif body.add_special_tokens:
            raise APIError(400, "add_special_tokens: the chat template writes the special tokens itself; "
                           "give false or leave it out with messages", param="add_special_tokens")  # fmt: skip
        else:
            try:
                ids = tokenizer.apply_chat_template(
                    body.messages, add_generation_prompt=body.add_generation_prompt
                )
            except (ValueError, KeyError, TypeError) as error:
                raise APIError(400, f"messages: {error}", param="messages") from None
        strings = (
            [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
            if body.return_token_strs
            else None
        )
        return {"count": len(ids), "max_model_len": engine.context, "tokens": ids, "token_strs": strings}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check(body.model)
        vocab = engine.model.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: {bad[0]} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        special = getattr(tokenizer, "special_tokens", {}) or {}
        return {
            "tokenizer_class": type(tokenizer).__name__,
            "bos_token": special.get("bos_token"),
            "eos_token": special.get("eos_token"),
            "pad_token": special.get("pad_token"),
            "unk_token": special.get("unk_token"),
            "model_max_length": engine.context,
        }
