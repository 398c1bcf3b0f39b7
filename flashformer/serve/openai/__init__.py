"""OpenAI's HTTP API over an Engine (FastAPI), in vLLM's layout (entrypoints/openai/):

protocol.py    the request bodies (pydantic), the checks every endpoint makes, the error shape
app.py         create_app: the endpoints' modules assembled, the API key, the errors' statuses
chat_completions.py  POST /v1/chat/completions
completions.py POST /v1/completions
embeddings.py  POST /v1/embeddings
status.py      GET /v1/models, /health, /metrics
responses.py   the JSON and server-sent-event answers, log-probabilities, /metrics' text
tokenize.py    /tokenize, /detokenize and /tokenizer_info (vLLM's)
chat.py        the chat path every chat-shaped API takes (chat, Anthropic's Messages, Responses)
answer.py      an answer's reasoning, text and tool calls, whole or streamed; chat's shapes of them
responses_api.py  /v1/responses: OpenAI's Responses API over the chat path
tools.py       tools and tool_choice: the prompt, the forced call's schema
structured.py  structured outputs: response_format and vLLM's fields as one constraint
page.py        GET /: the chat page's files (serve/webui/) and config
"""

from flashformer.serve.openai.app import create_app

__all__ = ["create_app"]
