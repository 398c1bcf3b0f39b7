"""The HTTP core every API translates into (OpenAI's in openai/, Anthropic's in anthropic/): the
one chat path, the reading of answers, the request bodies the chat path takes and the error
shape, the routes no API owns (status, the chat page) and the app they are all mounted on (the
API key, the errors' statuses). It imports neither API; serve/app.py, above both, mounts them.

protocol.py    the request bodies the chat path takes (OpenAI's chat and completion bodies, the
               sampling fields from generate's table), the checks every endpoint makes, APIError
chat.py        the one chat path (chat completions, Anthropic's Messages, the Responses API):
               prompt, checked SamplingParams, answer plan, submit, and awaiting the events
answer.py      an answer's reasoning, text and tool calls, whole or streamed
tools.py       tools and tool_choice: the prompt, the forced call's schema
structured.py  structured outputs: response_format and vLLM's fields as one constraint
status.py      GET /v1/models, /health, /metrics (and the Prometheus text)
page.py        GET /: the chat page's files (serve/webui/) and config
base_app.py    the app before any API is mounted: the API key, the errors' statuses
"""
