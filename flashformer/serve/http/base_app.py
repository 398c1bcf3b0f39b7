"""The FastAPI app before any API is mounted on it (base_app): the API key checked at the door and
the errors' statuses, each error answered in the shape of the API whose path was asked. Which
shape that is, the caller says (serve/app.py's create_app, which knows the APIs): the core
imports none of them."""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from flashformer.serve.http.protocol import APIError

# (the request's path, the error) -> the error's answer in the shape of that path's API
ErrorShape = Callable[[str, APIError], Response]


def base_app(api_key: str | None, error_shape: ErrorShape) -> FastAPI:
    """A FastAPI app with no route yet: APIError and a body that fails its model answered by
    error_shape; with api_key, every /v1 call must carry it (401 otherwise)."""
    app = FastAPI(title="flashformer", docs_url=None, redoc_url=None)
    add_error_handlers(app, error_shape)
    add_api_key(app, api_key, error_shape)
    return app


def add_error_handlers(app: FastAPI, error_shape: ErrorShape) -> None:
    """APIError answers in its API's shape; a body that fails its pydantic model answers 400
    naming the first field at fault, the rule and the value received."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error_shape(request.url.path, error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        if first.get("type") == "json_invalid":
            message = f"the request body is not valid JSON: {first.get('msg')}"
        else:
            got = f"; got {first['input']!r}" if "input" in first and first.get("type") != "missing" else ""
            message = f"{where or 'the request body'}: {first.get('msg', 'invalid')}{got}"
        return error_shape(request.url.path, APIError(400, message, param=where))


def add_api_key(app: FastAPI, api_key: str | None, error_shape: ErrorShape) -> None:
    """With a key, every /v1 call must carry it: `Authorization: Bearer <key>`, or `x-api-key` as
    Anthropic's clients send it; compared in constant time. 401 otherwise."""
    if api_key is not None:
        app.add_middleware(RequireAPIKey, api_key=api_key, error_shape=error_shape)


class RequireAPIKey:
    """add_api_key's check as a plain ASGI middleware: a /v1 request without the key is answered
    401 here, and everything else passes through untouched. (Starlette's BaseHTTPMiddleware, an
    @app.middleware("http") function, carries every chunk of a streamed answer through a memory
    stream to a task of its own: a task switch per token, on the cores that decode.)"""

    def __init__(self, app, api_key: str, error_shape: ErrorShape):
        self.app, self.error_shape = app, error_shape
        self.bearer, self.key = f"Bearer {api_key}".encode(), api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and not self._carries_key(scope):
            refusal = APIError(401, "incorrect API key", kind="authentication_error", code="invalid_api_key")
            await self.error_shape(scope["path"], refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _carries_key(self, scope) -> bool:
        bearer = _header(scope, b"authorization")
        anthropic = _header(scope, b"x-api-key")  # Anthropic's clients' header
        # both compared, in constant time, whichever is given
        return hmac.compare_digest(bearer, self.bearer) | hmac.compare_digest(anthropic, self.key)


def _header(scope, name: bytes) -> bytes:
    """The first value of a request header (names are lowercase in ASGI), b"" if absent."""
    return next((value for key, value in scope["headers"] if key == name), b"")
