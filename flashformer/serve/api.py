"""The OpenAI-compatible HTTP API over an Engine (FastAPI).

    POST /v1/chat/completions   messages through the model's chat template
    POST /v1/completions        a prompt string or token ids
    POST /v1/embeddings         sentence vectors (when the model is an encoder)
    GET  /v1/models, /health, /metrics (Prometheus text)

Requests and responses have OpenAI's shapes, so the `openai` client (and
everything built on it) works unchanged: max_tokens, temperature (0 =
greedy), top_p, seed, stop (strings, never returned), n, stream (server-sent
events ending with `data: [DONE]`, stream_options.include_usage), logprobs /
top_logprobs, usage. Errors are OpenAI's error JSON with the matching status
(400 for a bad request, 401 for a wrong API key, 404 for an unknown model,
503 when the queue is full). A client that goes away has its request
cancelled within one engine step.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import time
import uuid
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from flashformer.serve.embeddings import EmbeddingEngine, EmbeddingRequest
from flashformer.serve.engine import Busy, Engine, Event, SamplingParams
from flashformer.serve.engine import Request as EngineRequest

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


# ---- errors ----


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# ---- the app ----


def create_app(engine: Engine | EmbeddingEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `engine` as the model `model_name`: a text Engine answers the
    completions endpoints, an EmbeddingEngine /v1/embeddings (each refuses the other's by
    name). With api_key, every /v1 call must carry `Authorization: Bearer <api_key>`
    (compared in constant time)."""
    app = FastAPI(title="flashformer", docs_url=None, redoc_url=None)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('msg')}"
        else:
            message = f"{where or 'the request body'}: {first.get('msg', 'invalid')}"
        return APIError(400, message, param=where).response()

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            expected = f"Bearer {api_key}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                return APIError(
                    401, "incorrect API key", kind="authentication_error", code="invalid_api_key"
                ).response()
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "flashformer"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(_prometheus(engine.metrics()))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        _check_model(body.model, model_name)
        _check_generates(engine, model_name)
        messages = [{"role": m.role, "content": _text_of(m.content)} for m in body.messages]
        try:
            prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as error:
            raise APIError(400, f"messages: {error}", param="messages") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top = body.top_logprobs if body.logprobs else None
        if body.logprobs and top is None:
            top = 0
        params = _params(body, limit, top, len(prompt), engine)
        return await _respond(engine, http, body, prompt, params, model_name, chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        _check_model(body.model, model_name)
        _check_generates(engine, model_name)
        if body.echo:
            raise APIError(400, "echo=true is not supported", param="echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(
                    400, "prompt: one prompt per request (use n for several choices)", param="prompt"
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = engine.tokenizer.encode(prompt)
        else:
            vocab = engine.model.config.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise APIError(
                    400, f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt"
                )
            ids = list(prompt)
        if not ids:
            raise APIError(400, "prompt: the prompt is empty", param="prompt")
        params = _params(body, body.max_tokens, body.logprobs, len(ids), engine)
        return await _respond(engine, http, body, ids, params, model_name, chat=False)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingsRequest, http: Request):
        _check_model(body.model, model_name)
        if not isinstance(engine, EmbeddingEngine):
            raise APIError(
                400,
                f"the model {model_name!r} generates text; /v1/embeddings needs an encoder model "
                "(serve a sentence-transformers or BERT-style folder)",
                param="model",
            )
        return await _embed(engine, http, body, model_name)

    return app


def _check_generates(engine, model_name: str) -> None:
    if isinstance(engine, EmbeddingEngine):
        raise APIError(
            400,
            f"the model {model_name!r} is an encoder (sentence embeddings); use /v1/embeddings",
            param="model",
        )


async def _embed(engine: EmbeddingEngine, http: Request, body: EmbeddingsRequest, model_name: str) -> dict:
    """Token ids of every input (texts through the tokenizer, cut to the encoder's length as
    sentence-transformers cuts them; ids as given), their vectors from the engine, OpenAI's
    response: float lists, or base64 of little-endian float32 (what the openai client asks for)."""
    if body.encoding_format not in ("float", "base64"):
        raise APIError(400, f"encoding_format must be 'float' or 'base64'; got {body.encoding_format!r}",
                       param="encoding_format")  # fmt: skip
    if body.dimensions is not None and body.dimensions != engine.dimension:
        raise APIError(400, f"dimensions: this model's vectors have {engine.dimension}; got {body.dimensions}",
                       param="dimensions")  # fmt: skip
    given = body.input
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        given = [given]  # one input
    empty = next((i for i, item in enumerate(given) if item == ""), None)
    if empty is not None:  # a text the tokenizer would turn into special tokens alone
        raise APIError(400, f"input[{empty}] is empty", param="input")
    texts = [item for item in given if isinstance(item, str)]
    encoded = iter(engine.encode(texts) if texts else [])
    inputs = [next(encoded) if isinstance(item, str) else list(item) for item in given]
    loop = asyncio.get_running_loop()
    answer: asyncio.Future = loop.create_future()

    def emit(vectors, message) -> None:
        loop.call_soon_threadsafe(lambda: answer.done() or answer.set_result((vectors, message)))

    request = EmbeddingRequest(inputs, emit)
    try:
        engine.submit(request)
    except Busy as busy:
        raise APIError(503, str(busy), kind="server_error", code="overloaded") from None
    except ValueError as error:
        raise APIError(400, str(error), param="input") from None
    try:  # wait, but cancel the request if the client goes away
        while not (await asyncio.wait({answer}, timeout=0.5))[0]:
            if await http.is_disconnected():
                request.cancel()
                return JSONResponse({}, status_code=499)
    except asyncio.CancelledError:
        request.cancel()
        raise
    vectors, message = answer.result()
    if message is not None:
        raise APIError(500, message, kind="server_error")

    def encoded_vector(vector: np.ndarray):
        if body.encoding_format == "base64":
            return base64.b64encode(vector.astype("<f4").tobytes()).decode()
        return vector.tolist()

    data = [
        {"object": "embedding", "index": i, "embedding": encoded_vector(v)} for i, v in enumerate(vectors)
    ]
    usage = {"prompt_tokens": request.tokens, "total_tokens": request.tokens}
    return {"object": "list", "data": data, "model": model_name, "usage": usage}


def _check_model(name: str, served: str) -> None:
    if name != served:
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def _text_of(content) -> str:
    """A message's content: a string, or OpenAI's list of parts (text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise APIError(
                400,
                f"messages: content parts of type {part.get('type')!r} are not supported",
                param="messages",
            )
        texts.append(part.get("text", ""))
    return "".join(texts)


def _params(
    body: Sampling, max_tokens: int | None, logprobs: int | None, prompt_len: int, engine: Engine
) -> SamplingParams:
    if body.presence_penalty or body.frequency_penalty:
        raise APIError(
            400, "presence_penalty and frequency_penalty are not supported (give 0)", param="presence_penalty"
        )
    if prompt_len >= engine.context:
        raise APIError(
            400,
            f"the prompt is {prompt_len} tokens; this model's maximum context length is {engine.context} tokens",
            param="messages",
            code="context_length_exceeded",
        )
    if max_tokens is not None and max_tokens <= 0:
        raise APIError(400, f"max_tokens must be at least 1; got {max_tokens}", param="max_tokens")
    room = engine.context - prompt_len
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise APIError(400, "stop: up to 4 non-empty strings", param="stop")
    return SamplingParams(
        max_tokens=min(max_tokens or room, room),
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=tuple(stop),
        logprobs=logprobs,
        stop_token_ids=tuple(getattr(engine.tokenizer, "stop_token_ids", []) or []),
    )


async def _respond(
    engine: Engine,
    http: Request,
    body,
    prompt: list[int],
    params: SamplingParams,
    model_name: str,
    chat: bool,
):
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()
    request = EngineRequest(
        prompt, params, body.n, lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
    )
    try:
        engine.submit(request)
    except Busy as busy:
        raise APIError(503, str(busy), kind="server_error", code="overloaded") from None
    except ValueError as error:
        raise APIError(400, str(error), code="context_length_exceeded") from None
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _stream(request, events, ident, created, model_name, chat, usage, engine),
            media_type="text/event-stream",
        )
    return await _collect(request, events, http, ident, created, model_name, chat, engine)


async def _collect(request, events, http, ident, created, model_name, chat, engine) -> dict:
    """Wait for the whole answer (cancelling it if the client goes away), then one response."""
    texts = [""] * len(request.sequences)
    logprobs: list[list] = [[] for _ in request.sequences]
    reasons: list[str | None] = [None] * len(request.sequences)
    usage = None
    try:
        while usage is None:
            try:
                event = await asyncio.wait_for(events.get(), timeout=0.5)
            except TimeoutError:
                if await http.is_disconnected():
                    request.cancel()
                    return JSONResponse({}, status_code=499)
                continue
            if event.kind == "delta":
                texts[event.index] += event.text
                logprobs[event.index] += event.logprobs
            elif event.kind == "finish":
                reasons[event.index] = event.finish_reason
            elif event.kind == "done":
                usage = event.usage
            elif event.kind == "error":
                raise APIError(500, event.message, kind="server_error")
    except asyncio.CancelledError:
        request.cancel()
        raise
    choices = []
    for index, (text, reason) in enumerate(zip(texts, reasons)):
        if chat:
            choice = {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "finish_reason": reason,
            }
            choice["logprobs"] = (
                _chat_logprobs(logprobs[index], engine) if request.params.logprobs is not None else None
            )
        else:
            choice = {"index": index, "text": text, "finish_reason": reason}
            choice["logprobs"] = (
                _completion_logprobs(logprobs[index], engine) if request.params.logprobs is not None else None
            )
        choices.append(choice)
    kind = "chat.completion" if chat else "text_completion"
    return {
        "id": ident,
        "object": kind,
        "created": created,
        "model": model_name,
        "choices": choices,
        "usage": usage,
    }


async def _stream(request, events, ident, created, model_name, chat, include_usage, engine):
    """Server-sent events: a chunk per piece of text, a closing chunk per choice, the usage
    chunk if asked, then [DONE]. Cancelled if the client goes away (the generator is closed)."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices, usage=None) -> str:
        payload = {"id": ident, "object": kind, "created": created, "model": model_name, "choices": choices}
        if include_usage:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"

    def choice(index, text=None, reason=None, logprobs=None, first=False) -> dict:
        if chat:
            delta = (
                {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
            )
            out = {"index": index, "delta": delta, "finish_reason": reason}
            out["logprobs"] = _chat_logprobs(logprobs, engine) if logprobs else None
        else:
            out = {"index": index, "text": text or "", "finish_reason": reason}
            out["logprobs"] = _completion_logprobs(logprobs, engine) if logprobs else None
        return out

    try:
        if chat:
            yield chunk([choice(i, first=True) for i in range(len(request.sequences))])
        while True:
            event = await events.get()
            if event.kind == "delta":
                yield chunk([choice(event.index, event.text, logprobs=event.logprobs)])
            elif event.kind == "finish":
                yield chunk([choice(event.index, reason=event.finish_reason)])
            elif event.kind == "error":
                error = {
                    "error": {"message": event.message, "type": "server_error", "param": None, "code": None}
                }
                yield f"data: {json.dumps(error)}\n\n"
                break
            elif event.kind == "done":
                if include_usage:
                    yield chunk([], event.usage)
                break
        yield "data: [DONE]\n\n"
    finally:
        if not request.finished:
            request.cancel()


def _token_text(engine: Engine, token: int) -> str:
    return engine.tokenizer.decode([token], skip_special_tokens=False)


def _chat_logprobs(entries, engine) -> dict:
    content = []
    for entry in entries:
        text = _token_text(engine, entry.token)
        top = [
            {"token": (t := _token_text(engine, i)), "logprob": lp, "bytes": list(t.encode())}
            for i, lp in entry.top
        ]
        content.append(
            {"token": text, "logprob": entry.logprob, "bytes": list(text.encode()), "top_logprobs": top}
        )
    return {"content": content}


def _completion_logprobs(entries, engine) -> dict:
    tokens = [_token_text(engine, e.token) for e in entries]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_token_text(engine, i): lp for i, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def _prometheus(metrics: dict) -> str:
    help_texts = {
        "requests_running": ("gauge", "requests with a sequence in the running batch"),
        "sequences_running": ("gauge", "sequences in the running batch"),
        "sequences_waiting": ("gauge", "sequences waiting to be admitted"),
        "kv_blocks_in_use": ("gauge", "KV cache blocks held by sequences"),
        "kv_blocks_total": ("gauge", "KV cache blocks sequences can hold"),
        "tokens_per_second": ("gauge", "generated tokens per second over the last 10 s"),
        "steps": ("counter", "engine steps"),
        "generated_tokens": ("counter", "tokens generated"),
        "prompt_tokens": ("counter", "prompt tokens computed"),
        "preemptions": ("counter", "sequences preempted for lack of KV blocks"),
        "inputs_waiting": ("gauge", "embedding inputs waiting to be encoded"),
        "inputs_per_second": ("gauge", "embedding inputs encoded per second over the last 10 s"),
        "embedded_inputs": ("counter", "embedding inputs encoded"),
    }
    lines = []
    for name, value in metrics.items():
        kind, text = help_texts.get(name, ("gauge", name))
        full = f"flashformer_{name}" + ("_total" if kind == "counter" else "")
        lines += [f"# HELP {full} {text}", f"# TYPE {full} {kind}", f"{full} {value}"]
    return "\n".join(lines) + "\n"
