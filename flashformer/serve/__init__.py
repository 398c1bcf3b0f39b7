"""`flashformer serve`: an OpenAI-compatible server with continuous batching
over a paged KV cache.

    loop.py          the loop that owns a model (threads, inbox, waiting count, Busy)
    scheduler.py     the policy: admission (prefix reuse), the prefill plan, making room, preemption
    runner.py        the model's steps: packed or separate forwards, block tables, slots
    engine.py        requests, sequences, events, and the Engine that wires them
    paged_cache.py   the block pool (shared blocks, the prefix cache) and the per-layer paged caches
    embeddings.py    the embedding engine (an encoder served)
    http/            the HTTP core every API translates into: the one chat path, answers, the
                     request bodies it takes, errors, status, the chat page, the bare app
    openai/          OpenAI's endpoints (chat completions, completions, embeddings, responses)
    anthropic/       Anthropic's Messages API
    app.py           create_app: both APIs' routes on http/'s app, errors in each API's shape
    cluster/         engine replicas on Ray Serve behind that app

Imports run down that list's rooms: the engine's modules, http/, the two APIs (neither imports
the other), app.py, cluster/ (tests/test_layout.py checks it).
"""
