"""`flashformer serve`: an OpenAI-compatible server with continuous batching
over a paged KV cache.

    paged_cache.py   the block pool and the per-layer paged caches
    engine.py        the scheduler loop that owns the model (continuous batching)
    api.py           the HTTP API (FastAPI): OpenAI's endpoints, shapes and errors
"""
