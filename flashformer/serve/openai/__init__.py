"""OpenAI's HTTP API over an Engine (FastAPI), in vLLM's layout (entrypoints/openai/):

protocol.py    the request bodies (pydantic) and the error shape
app.py         create_app: the routes, the API key, the errors' statuses
responses.py   the JSON and server-sent-event answers, log-probabilities, /metrics' text
tokenize.py    /tokenize, /detokenize and /tokenizer_info (vLLM's)
tools.py       tools and tool_choice: the prompt, the forced call's schema, the calls in answers
page.py        GET /: the chat page's files (serve/webui/) and config
"""

from flashformer.serve.openai.app import create_app

__all__ = ["create_app"]
