"""POST /v1/chat/completions: messages through the model's chat template (http/chat.py's path, the
one every chat-shaped API takes), answered whole or streamed (bodies.py)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from flashformer.serve.http.chat import ServerOptions, prepare_chat
from flashformer.serve.http.protocol import (
    ChatCompletionRequest,
    check_generates,
    check_model,
    refuse_unsupported,
)
from flashformer.serve.openai.bodies import respond


def add_chat_routes(app: FastAPI, engine, model_name: str, server: ServerOptions) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        check_model(body.model, model_name, engine)
        check_generates(engine, model_name)
        refuse_unsupported(body)
        turn = await prepare_chat(engine, body, server)
        return await respond(
            engine, http, body, turn.prompt, turn.params, body.model, chat=True, answer=turn.answer
        )
