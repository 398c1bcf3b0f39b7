"""What a client or a monitor asks of the server itself: GET /v1/models (the one model served),
/health, and /metrics (the engine's counters in Prometheus' text format)."""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from flashformer.serve.openai.responses import prometheus


def add_status_routes(app: FastAPI, engine, model_name: str) -> None:
    created = int(time.time())

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
