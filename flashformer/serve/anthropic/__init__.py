"""Anthropic's Messages API over the engine (what the `anthropic` SDK and Claude Code call with
ANTHROPIC_BASE_URL pointing here): a translation into the shared chat path of serve/http/, never
a second sampling path. serve/app.py's create_app mounts its routes beside OpenAI's.

protocol.py    the request bodies, their translation into a chat request, Anthropic's errors
messages.py    POST /v1/messages (whole and streamed) and /v1/messages/count_tokens
"""
