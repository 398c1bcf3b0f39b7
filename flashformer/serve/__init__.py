"""`flashformer serve`: an OpenAI-compatible server with continuous batching
over a paged KV cache.

    loop.py          the loop that owns a model (threads, inbox, waiting count, Busy)
    scheduler.py     the policy: admission (prefix reuse), the prefill plan, making room, preemption
    runner.py        the model's steps: packed or separate forwards, block tables, slots
    engine.py        requests, sequences, events, and the Engine that wires them
    paged_cache.py   the block pool (shared blocks, the prefix cache) and the per-layer paged caches
    embeddings.py    the embedding engine (an encoder served)
    openai/          the HTTP API (FastAPI): protocol.py (request bodies), one module per
                     endpoint family (chat_completions.py, completions.py, ...), app.py
                     (create_app: their routes, auth, errors), responses.py (JSON, SSE, logprobs)
"""
