"""What a client or a monitor asks of the server itself: GET /v1/models (the model served and its
LoRA adapters, each with the base as its `parent`, as vLLM lists them),
/health, and /metrics (the engine's counters in Prometheus' text format)."""

from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse


def add_status_routes(app: FastAPI, engine, model_name: str) -> None:
    created = int(time.time())

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "flashformer"}
        adapters = [
            {**card, "id": name, "root": name, "parent": model_name}
            for name in getattr(engine, "adapters", ())
        ]
        return {"object": "list", "data": [card, *adapters]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus(engine.metrics()))


def prometheus(metrics: dict) -> str:
    help_texts = {
        "requests_running": ("gauge", "requests with a sequence in the running batch"),
        "sequences_running": ("gauge", "sequences in the running batch"),
        "sequences_waiting": ("gauge", "sequences waiting to be admitted"),
        "kv_blocks_in_use": ("gauge", "KV cache blocks held by sequences"),
        "kv_blocks_total": ("gauge", "KV cache blocks sequences can hold"),
        "kv_blocks_cached": ("gauge", "KV cache blocks holding a cached prefix (held or free)"),
        "kv_window_blocks_in_use": ("gauge", "sliding-window layers' KV blocks held by sequences"),
        "kv_window_blocks_total": ("gauge", "sliding-window layers' KV blocks sequences can hold"),
        "kv_bytes_in_use": ("gauge", "bytes of the KV blocks held by sequences, every layer"),
        "kv_bytes_in_use_peak": ("gauge", "the most bytes of KV blocks held at once since the start"),
        "kv_bytes_total": ("gauge", "bytes of the KV pools, every layer"),
        "kv_block_bytes": ("gauge", "bytes of one KV block, every layer of its group (full attention)"),
        "kv_window_block_bytes": ("gauge", "bytes of one KV block of the sliding-window layers' group"),
        "prefix_cache_hit_rate": ("gauge", "prompt tokens reused from the prefix cache / tokens looked up"),
        "prefix_cache_queries": ("counter", "tokens looked up in the prefix cache at admissions"),
        "prefix_cache_hits": ("counter", "tokens reused from the prefix cache at admissions"),
        "tokens_per_second": ("gauge", "generated tokens per second over the last 10 s"),
        "steps": ("counter", "engine steps"),
        "generated_tokens": ("counter", "tokens generated"),
        "prompt_tokens": ("counter", "prompt tokens computed"),
        "preemptions": ("counter", "sequences preempted for lack of KV blocks"),
        "start_seconds": ("gauge", "seconds from the server process's start to serving its first request"),
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
