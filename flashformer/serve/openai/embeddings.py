"""POST /v1/embeddings: sentence vectors from an EmbeddingEngine (serve/embeddings.py), in
OpenAI's shape (float or base64); a text-generating model refuses it by name."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from flashformer.serve.embeddings import EmbeddingEngine, EmbeddingRequest
from flashformer.serve.engine import Busy
from flashformer.serve.http.protocol import APIError, check_model, refuse_unsupported
from flashformer.serve.openai.bodies import embedding_response


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"
    dimensions: int | None = None


def add_embedding_routes(app: FastAPI, engine, model_name: str) -> None:
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
        return await embed(engine, http, body, model_name)


async def embed(engine: EmbeddingEngine, http: Request, body: EmbeddingsRequest, model_name: str) -> dict:
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
