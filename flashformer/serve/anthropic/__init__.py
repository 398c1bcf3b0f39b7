"""Anthropic's Messages API over the engine (what the `anthropic` SDK and Claude Code call with
ANTHROPIC_BASE_URL pointing here): a translation into the chat path of serve/openai/, never a
second sampling path. serve/openai/app.py's create_app adds its routes beside OpenAI's.

protocol.py    the request bodies, their translation into a chat request, Anthropic's errors
messages.py    POST /v1/messages (whole and streamed) and /v1/messages/count_tokens
"""

# The app that serves these routes imports them, and they import its chat path: importing the
# app's package first lets either side be imported first.
import flashformer.serve.openai  # noqa: F401
