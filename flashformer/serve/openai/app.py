"""create_app: the OpenAI-compatible HTTP API over an Engine (FastAPI): the routes, the API
key, the errors and their statuses.

    POST /v1/chat/completions   messages through the model's chat template
    POST /v1/completions        a prompt string or token ids
    POST /v1/embeddings         sentence vectors (when the model is an encoder)
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

from flashformer.generate.constraints import Constraint
from flashformer.serve.embeddings import EmbeddingEngine, EmbeddingRequest
from flashformer.serve.engine import Busy, Engine, Event, SamplingParams
from flashformer.serve.engine import Request as EngineRequest
from flashformer.serve.openai.page import add_page
from flashformer.serve.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingsRequest,
    Sampling,
    refuse_unsupported,
)
from flashformer.serve.openai.responses import collect, embedding_response, prometheus, stream_events
from flashformer.serve.openai.structured import compile_for, describe_vocabulary_soon, requested_constraint
from flashformer.serve.openai.tokenize import add_tokenizer_routes
from flashformer.serve.openai.tools import (
    ToolPlan,
    call_constraint,
    check_parser,
    plan_tools,
    template_messages,
)


def create_app(
    engine: Engine | EmbeddingEngine,
    model_name: str,
    api_key: str | None = None,
    webui: bool = True,
    tool_parser: str | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine` as the model `model_name`: a text Engine answers the
    completions endpoints, an EmbeddingEngine /v1/embeddings (each refuses the other's by
    name). With api_key, every /v1 call must carry `Authorization: Bearer <api_key>`
    (compared in constant time); the page at / asks for it. webui=False: no page (404 at /).
    tool_parser: the format tool calls are read in (text.tool_calls; default: the one the
    chat template teaches)."""
    check_parser(tool_parser)
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
            got = f"; got {first['input']!r}" if "input" in first and first.get("type") != "missing" else ""
            message = f"{where or 'the request body'}: {first.get('msg', 'invalid')}{got}"
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
        return PlainTextResponse(prometheus(engine.metrics()))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        _check_model(body.model, model_name)
        _check_generates(engine, model_name)
        refuse_unsupported(body)
        offered = body.tools if body.tool_choice != "none" else None  # "none": as if no tools
        template = _template_of(engine.tokenizer, offered)
        plan = plan_tools(body, template, tool_parser)
        messages, tools = template_messages([_message_of(m) for m in body.messages], template, plan)
        try:
            prompt = engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tools=tools, chat_template=template
            )
        except ValueError as error:
            raise APIError(400, f"messages: {error}", param="messages") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top = body.top_logprobs if body.logprobs else None
        if body.logprobs and top is None:
            top = 0
        asked = requested_constraint(body)
        constraint = await compile_for(engine, call_constraint(plan, asked) or asked)
        params = _params(body, limit, top, len(prompt), engine, constraint=constraint)
        return await _respond(engine, http, body, prompt, params, model_name, chat=True, tools=plan)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        _check_model(body.model, model_name)
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
        params = _params(body, body.max_tokens, body.logprobs, len(ids), engine, scored, constraint)
        echo = None
        if body.echo:
            echo = (
                prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids, skip_special_tokens=False)
            )
        return await _respond(engine, http, body, ids, params, model_name, chat=False, echo=echo)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingsRequest, http: Request):
        _check_model(body.model, model_name)
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


def _check_model(name: str, served: str) -> None:
    if name != served:
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def _message_of(message) -> dict:
    """A request's message for the chat template: its other fields (name, ...) reach the
    template too, as in transformers; an assistant's calls without text keep content None."""
    fields = {**(message.model_extra or {}), "role": message.role}
    if message.tool_calls:
        fields["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    calls_only = message.content is None and message.tool_calls
    fields["content"] = None if calls_only else _text_of(message.content)
    return fields


def _template_of(tokenizer, tools) -> str | None:
    """The chat template the prompt is rendered with (None: the tokenizer has none)."""
    try:
        return tokenizer.chat_template_for(None, tools or None)
    except (ValueError, AttributeError):
        return None


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
    body: Sampling,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_len: int,
    engine: Engine,
    prompt_logprobs: int | None = None,
    constraint: Constraint | None = None,
) -> SamplingParams:
    """The request's settings, checked (400 naming the field and the value). max_tokens 0 is
    allowed with echo (prompt_logprobs set, or echo alone): the prompt, and no token.
    constraint: the compiled structured output (structured.py), or None."""
    if prompt_len >= engine.context:
        raise APIError(
            400,
            f"the prompt is {prompt_len} tokens; this model's maximum context length is {engine.context} tokens",
            param="messages",
            code="context_length_exceeded",
        )
    echo = getattr(body, "echo", False)
    if max_tokens is not None and (max_tokens < 0 or (max_tokens == 0 and not echo)):
        least = "0 (with echo)" if isinstance(body, CompletionRequest) else "1"
        raise APIError(400, f"max_tokens must be at least {least}; got {max_tokens}", param="max_tokens")
    room = engine.context - prompt_len
    limit = room if max_tokens is None else min(max_tokens, room)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 4 or any(not s for s in stop):
        raise APIError(400, "stop: up to 4 non-empty strings", param="stop")
    vocab = engine.model.config.vocab_size
    bias = _logit_bias(body.logit_bias, vocab)
    asked_stops = list(body.stop_token_ids or [])
    bad = [t for t in asked_stops if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab})",
                       param="stop_token_ids")  # fmt: skip
    # ignore_eos: the model's own stop tokens go on; the request's stop_token_ids still end it
    own_stops = [] if body.ignore_eos else list(getattr(engine.tokenizer, "stop_token_ids", []) or [])
    min_tokens = body.min_tokens or 0
    if min_tokens > limit:
        raise APIError(
            400, f"min_tokens ({min_tokens}) must be at most max_tokens ({limit})", param="min_tokens"
        )
    return SamplingParams(
        max_tokens=limit,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),  # -1 and 0: none
        min_p=body.min_p or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        logit_bias=bias,
        min_tokens=min_tokens,
        seed=body.seed,
        stop=tuple(stop),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stop_token_ids=tuple(dict.fromkeys(own_stops + asked_stops)),
        constraint=constraint,
        speculative=body.speculative is not False,
    )


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: token ids as strings (JSON's keys), each in the vocabulary."""
    pairs = []
    for key, value in (bias or {}).items():
        token = int(key) if key.strip().lstrip("-").isdigit() else None
        if token is None or not 0 <= token < vocab:
            raise APIError(400, f"logit_bias: {key!r} is not a token id in [0, {vocab})", param="logit_bias")
        pairs.append((token, float(value)))
    return tuple(pairs)


async def _respond(
    engine: Engine,
    http: Request,
    body,
    prompt: list[int],
    params: SamplingParams,
    model_name: str,
    chat: bool,
    echo: str | None = None,
    tools: ToolPlan | None = None,
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
            stream_events(request, events, ident, created, model_name, chat, usage, engine, tools),
            media_type="text/event-stream",
        )
    return await collect(request, events, http, ident, created, model_name, chat, engine, echo, tools)
