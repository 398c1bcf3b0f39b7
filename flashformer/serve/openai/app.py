"""create_app: the OpenAI-compatible HTTP API over an Engine (FastAPI): the routes, the API
key, the errors and their statuses.

    POST /v1/chat/completions   messages through the model's chat template
    POST /v1/completions        a prompt string or token ids
    POST /v1/embeddings         sentence vectors (when the model is an encoder)
    POST /v1/responses          OpenAI's Responses API (responses_api.py)
    POST /v1/messages, /v1/messages/count_tokens   Anthropic's Messages API (serve/anthropic/)
    POST /tokenize, /detokenize, GET /tokenizer_info (tokenize.py)
    GET  /v1/models, /health, /metrics (Prometheus text)
    GET  /                      the chat page (page.py), unless webui=False

Requests and responses have OpenAI's shapes, so the `openai` client (and
everything built on it) works unchanged: max_tokens, temperature (0 =
greedy), top_p, seed, stop (strings, never returned), n, stream (server-sent
events ending with `data: [DONE]`, stream_options.include_usage), logprobs /
top_logprobs, echo (the prompt's log-probabilities, max_tokens 0 allowed), usage; vLLM's
top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids and OpenAI's
presence / frequency penalties and logit_bias (generate.sampling, as generate() applies
them); structured outputs: response_format (json_object, json_schema) and vLLM's
structured_outputs / guided_* fields (structured.py: compiled off the engine's thread);
tools, tool_choice and tool calls in the history and the answers (tools.py); any other field is refused by name (400) unless it cannot change the answer (user, metadata, ...) or holds its no-op value (docs/serving.md, "Requests"). Errors are OpenAI's error JSON with the matching status
(400 for a bad request, 401 for a wrong API key, 404 for an unknown model,
503 when the queue is full). A client that goes away has its request
cancelled within one engine step.
"""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from flashformer.serve.anthropic.messages import add_messages_routes
from flashformer.serve.anthropic.protocol import anthropic_error, speaks_anthropic
from flashformer.serve.embeddings import EmbeddingEngine, EmbeddingRequest
from flashformer.serve.engine import Busy, Engine, SamplingParams
from flashformer.serve.openai.answer import AnswerPlan
from flashformer.serve.openai.chat import ServerOptions, check_model, params_of, prepare_chat, submit
from flashformer.serve.openai.page import add_page
from flashformer.serve.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingsRequest,
    refuse_unsupported,
)
from flashformer.serve.openai.responses import collect, embedding_response, prometheus, stream_events
from flashformer.serve.openai.responses_api import add_responses_routes
from flashformer.serve.openai.structured import compile_for, describe_vocabulary_soon, requested_constraint
from flashformer.serve.openai.tokenize import add_tokenizer_routes
from flashformer.serve.openai.tools import check_parser


def create_app(
    engine: Engine | EmbeddingEngine,
    model_name: str,
    api_key: str | None = None,
    webui: bool = True,
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine` as the model `model_name`: a text Engine answers the
    completions endpoints, an EmbeddingEngine /v1/embeddings (each refuses the other's by
    name). With api_key, every /v1 call must carry `Authorization: Bearer <api_key>`
    (compared in constant time; Anthropic's clients may send it as `x-api-key`); the page at /
    asks for it. webui=False: no page (404 at /). tool_parser: the format tool calls are read in
    (text.tool_calls; default: the one the chat template teaches); reasoning_parser: the format
    reasoning is split off the answers in (text.reasoning; None: none is)."""
    check_parser(tool_parser)
    server = ServerOptions(tool_parser, reasoning_parser)
    app = FastAPI(title="flashformer", docs_url=None, redoc_url=None)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return anthropic_error(error) if speaks_anthropic(request.url.path) else error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('msg')}"
        else:
            got = f"; got {first['input']!r}" if "input" in first and first.get("type") != "missing" else ""
            message = f"{where or 'the request body'}: {first.get('msg', 'invalid')}{got}"
        return await api_error(request, APIError(400, message, param=where))

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            bearer = request.headers.get("authorization", "").encode()
            anthropic = request.headers.get("x-api-key", "").encode()  # Anthropic's clients' header
            if not (
                hmac.compare_digest(bearer, f"Bearer {api_key}".encode())
                or hmac.compare_digest(anthropic, api_key.encode())
            ):
                refusal = APIError(
                    401, "incorrect API key", kind="authentication_error", code="invalid_api_key"
                )
                return await api_error(request, refusal)
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
        return PlainTextResponse(prometheus(engine.metrics()))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        check_model(body.model, model_name)
        _check_generates(engine, model_name)
        refuse_unsupported(body)
        turn = await prepare_chat(engine, body, server)
        return await _respond(
            engine, http, body, turn.prompt, turn.params, model_name, chat=True, answer=turn.answer
        )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        check_model(body.model, model_name)
        _check_generates(engine, model_name)
        refuse_unsupported(body)
        if body.echo and body.stream:
            raise APIError(400, "echo with stream=true is not supported (ask without stream)", param="echo")
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
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
        scored = body.logprobs if body.echo else None  # echo with logprobs: the prompt's too
        constraint = await compile_for(engine, requested_constraint(body))
        params = params_of(body, body.max_tokens, body.logprobs, len(ids), engine, scored, constraint)
        echo = None
        if body.echo:
            echo = (
                prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids, skip_special_tokens=False)
            )
        return await _respond(engine, http, body, ids, params, model_name, chat=False, echo=echo)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingsRequest, http: Request):
        check_model(body.model, model_name)
        refuse_unsupported(body)
        if not isinstance(engine, EmbeddingEngine):
            raise APIError(
                400,
                f"the model {model_name!r} generates text; /v1/embeddings needs an encoder model "
                "(serve a sentence-transformers or BERT-style folder)",
                param="model",
            )
        return await _embed(engine, http, body, model_name)

    if isinstance(engine, Engine):
        add_tokenizer_routes(app, engine, model_name)
        add_messages_routes(app, engine, model_name, server)
        add_responses_routes(app, engine, model_name, server)
        describe_vocabulary_soon(engine)
    if webui:
        add_page(app, "embeddings" if isinstance(engine, EmbeddingEngine) else "chat", api_key is not None)
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
    response (responses.embedding_response)."""
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
    return embedding_response(vectors, body.encoding_format, request.tokens, model_name)


async def _respond(
    engine: Engine,
    http: Request,
    body,
    prompt: list[int],
    params: SamplingParams,
    model_name: str,
    chat: bool,
    echo: str | None = None,
    answer: AnswerPlan | None = None,
):
    request, events = submit(engine, prompt, params, body.n)
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            stream_events(request, events, ident, created, model_name, chat, usage, engine, answer),
            media_type="text/event-stream",
        )
    return await collect(request, events, http, ident, created, model_name, chat, engine, echo, answer)
