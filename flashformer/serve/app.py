"""create_app: the HTTP server over an Engine (FastAPI): OpenAI's endpoints (openai/) and
Anthropic's (anthropic/) mounted beside the core's routes (http/) on http/base_app.py's app (the
API key, the errors' statuses), each error in the shape of the API asked. It sits above both
APIs, which translate into serve/http/ and never import each other or this module.

    POST /v1/chat/completions   messages through the model's chat template (openai/chat_completions.py)
    POST /v1/completions        a prompt string or token ids (openai/completions.py)
    POST /v1/embeddings         sentence vectors, when the model is an encoder (openai/embeddings.py)
    POST /v1/responses          OpenAI's Responses API (openai/responses_api.py)
    POST /v1/messages, /v1/messages/count_tokens   Anthropic's Messages API (anthropic/)
    POST /tokenize, /detokenize, GET /tokenizer_info (openai/tokenize.py)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   LoRA adapters while serving (openai/lora_adapters.py)
    GET  /v1/models, /health, /metrics (Prometheus text) (http/status.py)
    GET  /                      the chat page (http/page.py), unless webui=False
Requests and responses have OpenAI's shapes, so the `openai` client (and
everything built on it) works unchanged: max_tokens, the sampling options
(temperature (0 = greedy), top_p, top_k, min_p, the penalties, ...: the rows of
generate.sampling_options, as generate() applies them), seed, stop (strings, never returned),
n, stream (server-sent events ending with `data: [DONE]`, stream_options.include_usage),
logprobs / top_logprobs, echo (the prompt's log-probabilities, max_tokens 0 allowed), usage;
vLLM's min_tokens, ignore_eos, stop_token_ids and OpenAI's logit_bias; structured outputs:
response_format (json_object, json_schema) and vLLM's structured_outputs / guided_* fields
(http/structured.py: compiled off the engine's thread); tools, tool_choice and tool calls in the
history and the answers (http/tools.py); any other field is refused by name (400) unless it cannot
change the answer (user, metadata, ...) or holds its no-op value (docs/serving.md, "Requests").
Errors are OpenAI's error JSON with the matching status (400 for a bad request, 401 for a wrong
API key, 404 for an unknown model, 503 when the queue is full). A client that goes away has its
request cancelled within one engine step.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import Response

from flashformer.serve.anthropic.messages import add_messages_routes
from flashformer.serve.anthropic.protocol import anthropic_error, speaks_anthropic
from flashformer.serve.embeddings import EmbeddingEngine
from flashformer.serve.engine import Engine
from flashformer.serve.http.base_app import base_app
from flashformer.serve.http.chat import ServerOptions
from flashformer.serve.http.page import add_page
from flashformer.serve.http.protocol import APIError
from flashformer.serve.http.status import add_status_routes
from flashformer.serve.http.structured import describe_vocabulary_soon
from flashformer.serve.http.tools import check_parser
from flashformer.serve.openai.chat_completions import add_chat_routes
from flashformer.serve.openai.completions import add_completion_routes
from flashformer.serve.openai.embeddings import add_embedding_routes
from flashformer.serve.openai.lora_adapters import add_lora_adapter_routes
from flashformer.serve.openai.responses_api import add_responses_routes
from flashformer.serve.openai.tokenize import add_tokenizer_routes


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
    app = base_app(api_key, error_shape)
    add_status_routes(app, engine, model_name)
    add_chat_routes(app, engine, model_name, server)
    add_completion_routes(app, engine, model_name)
    add_embedding_routes(app, engine, model_name)
    if isinstance(engine, Engine):
        add_tokenizer_routes(app, engine, model_name)
        add_lora_adapter_routes(app, engine, model_name)
        add_messages_routes(app, engine, model_name, server)
        add_responses_routes(app, engine, model_name, server)
        describe_vocabulary_soon(engine)
    if webui:
        add_page(app, "embeddings" if isinstance(engine, EmbeddingEngine) else "chat", api_key is not None)
    return app


def error_shape(path: str, error: APIError) -> Response:
    """An APIError in the shape of the API asked: Anthropic's under its paths, else OpenAI's."""
    return anthropic_error(error) if speaks_anthropic(path) else error.response()
