"""OpenAI's HTTP API, a translation into the shared core (serve/http/), in vLLM's layout
(entrypoints/openai/): one module per endpoint, each with its add_*_routes, which serve/app.py's
create_app mounts beside Anthropic's.

chat_completions.py  POST /v1/chat/completions
completions.py POST /v1/completions
embeddings.py  POST /v1/embeddings (and its request body)
responses_api.py  POST /v1/responses: OpenAI's Responses API over the chat path
tokenize.py    /tokenize, /detokenize and /tokenizer_info (vLLM's)
bodies.py      chat completions' and completions' answers: whole JSON or server-sent events,
               their log-probabilities, chat's message and deltas; embeddings' vectors
"""
