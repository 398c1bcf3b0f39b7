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

    model_config = ConfigDict(extra="allow")  # clients send fields we do not use (user, metadata, ...)

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


# ---- errors ----


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)
