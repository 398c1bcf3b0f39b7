"""OpenAI's request bodies (pydantic: fastapi checks them and answers 400 by name) and its
error shape, for the endpoints of app.py."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

# ---- request bodies ----


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """The settings both endpoints share (OpenAI's names and defaults)."""

    # other fields are kept for refuse_unsupported: each is refused by name unless it cannot
    # change the answer (user, metadata, ...) or holds its no-op value
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None


# ---- fields outside the models above ----

# fields that cannot change an answer: who asks, what to store, how to bill
NO_EFFECT = {"user", "metadata", "store", "service_tier", "prediction", "parallel_tool_calls"}

# fields this server does not implement, with the values that ask for nothing (OpenAI's and
# vLLM's defaults); any other value would change the answer, so it is refused by name
NO_OP_VALUES: dict[str, tuple] = {
    "logit_bias": ({},),
    "top_k": (0, -1),
    "min_p": (0,),
    "repetition_penalty": (1,),
    "best_of": (1,),
    "suffix": ("",),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none", "auto"),  # without tools, both mean plain text
    "modalities": (["text"],),
    "min_tokens": (0,),
    "ignore_eos": (False,),
}


def refuse_unsupported(body: BaseModel) -> None:
    """Raise a 400 naming the first field of the request that this server would not honour: a
    field it does not know or implement, unless it cannot change the answer or holds its no-op
    value (null counts as absent). Nothing a client sends is silently ignored."""
    for name, value in (body.model_extra or {}).items():
        if value is None or name in NO_EFFECT:
            continue
        if name in NO_OP_VALUES and any(value == no_op for no_op in NO_OP_VALUES[name]):
            continue
        raise APIError(400, f"{name} is not supported by this server (got {value!r})", param=name)


# ---- errors ----


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)
