"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path
(protocol.py translates the body; serve/http/chat.py renders, checks and submits it; the
answer is read by serve/http/answer.py and only shaped here).

A whole answer is a message: {"id": "msg_...", "type": "message", "role": "assistant",
"content": [thinking?, text?, tool_use...], "stop_reason", "stop_sequence", "usage"}. A streamed
one is Anthropic's event sequence:

    message_start          the message without content, usage.input_tokens
    ping                   then again every PING_SECONDS while nothing else is sent
    content_block_start    per block, in order: thinking, text, tool_use (input {})
    content_block_delta    thinking_delta, text_delta, input_json_delta (the arguments' JSON text
                           as the model writes it)
    content_block_stop
    message_delta          stop_reason, stop_sequence, usage (output_tokens, and the input's
                           tokens now that the prefix cache's share is known)
    message_stop

stop_reason: end_turn (the model ended), max_tokens, stop_sequence (stop_sequence names it),
tool_use (the answer calls a tool). usage.input_tokens counts the prompt's tokens the prefix
cache did not give (cache_read_input_tokens), as Anthropic counts: the two add up to
count_tokens' input_tokens.
"""

from __future__ import annotations

import asyncio
import json
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from flashformer.serve.anthropic.protocol import MessagesBase, MessagesRequest, chat_request
from flashformer.serve.http.answer import AnswerPlan, AnswerReader, read_answer
from flashformer.serve.http.chat import (
    ClientGone,
    ServerOptions,
    prepare_chat,
    render_prompt,
    submit,
    until_done,
)
from flashformer.serve.http.protocol import check_model
from flashformer.text.reasoning import Thought

PING_SECONDS = 5.0


def add_messages_routes(app: FastAPI, engine, model_name: str, server: ServerOptions) -> None:
    """/v1/messages and /v1/messages/count_tokens for a text engine."""
    thinks = server.reasoning_parser is not None

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, http: Request):
        check_model(body.model, model_name, engine)
        translation = chat_request(body, thinks)
        turn = await prepare_chat(engine, translation.chat, server, thinking_budget=translation.budget)
        request, events = submit(engine, turn.prompt, turn.params)
        ident = "msg_" + uuid.uuid4().hex[:24]
        shape = MessageShape(ident, body.model, len(turn.prompt), turn.answer, translation.one_call)
        if body.stream:
            return StreamingResponse(stream_message(request, events, shape), media_type="text/event-stream")
        return await whole_message(request, events, http, shape)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: MessagesBase):
        check_model(body.model, model_name, engine)
        prompt, _ = render_prompt(engine, chat_request(body, thinks).chat, server)
        return {"input_tokens": len(prompt)}


class MessageShape:
    """What a message's shape needs beyond the engine's events: its id, the model's name, the
    prompt's length, how its text is read, and whether only its first tool_use counts."""

    def __init__(self, ident: str, model: str, prompt_tokens: int, answer: AnswerPlan, one_call: bool):
        self.ident, self.model, self.prompt_tokens = ident, model, prompt_tokens
        self.answer, self.one_call = answer, one_call

    def usage(self, usage: dict | None, output_tokens: int) -> dict:
        cached = (usage or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)
        return {
            "input_tokens": self.prompt_tokens - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": output_tokens,
        }

    def stop_reason(self, finish_reason: str | None, called: bool) -> str:
        if finish_reason == "length":
            return "max_tokens"
        if called:
            return "tool_use"
        return "end_turn"


def tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def _input_of(arguments: str) -> dict:
    """A call's arguments as the tool_use's input; {} when cut before they closed (the
    stop_reason max_tokens says so)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


async def whole_message(request, events, http, shape: MessageShape):
    """Wait for the answer (cancelling it if the client goes away), then one message."""
    text, reason, stop, usage = "", None, None, None
    try:
        async for event in until_done(request, events, http):
            if event.kind == "delta":
                text += event.text
            elif event.kind == "finish":
                reason, stop = event.finish_reason, event.stop
            elif event.kind == "done":
                usage = event.usage
    except ClientGone:
        return JSONResponse({}, status_code=499)
    answer = read_answer(text, shape.answer)
    calls = answer.calls[:1] if shape.one_call else answer.calls
    content = []
    if answer.reasoning is not None:
        content.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.text:
        content.append({"type": "text", "text": answer.text})
    for call in calls:
        content.append(
            {"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": _input_of(call.arguments)}
        )
    return {
        "id": shape.ident,
        "type": "message",
        "role": "assistant",
        "model": shape.model,
        "content": content,
        "stop_reason": "stop_sequence" if stop is not None else shape.stop_reason(reason, bool(calls)),
        "stop_sequence": stop,
        "usage": shape.usage(usage, usage["completion_tokens"]),
    }


def sse(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n"


class BlockStream:
    """The reader's pieces as content-block events: a block opens when a piece of another kind
    arrives (or a new call), and closes before the next one opens."""

    def __init__(self, answer: AnswerPlan, one_call: bool):
        self.reader = AnswerReader(answer)
        self.one_call = one_call
        self.index = -1  # the open block's index
        self.open: object = None  # "thinking", "text", or a call's index
        self.calls = 0

    def feed(self, text: str) -> list[str]:
        return self._events(self.reader.feed(text))

    def finish(self) -> list[str]:
        return self._events(self.reader.finish()) + self._close()

    def _events(self, pieces: list) -> list[str]:
        out = []
        for piece in pieces:
            if isinstance(piece, Thought):
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": piece.text}))
            elif isinstance(piece, str):
                out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": piece}))
            elif piece.name is not None:  # a call's first piece
                if self.one_call and self.calls:
                    continue  # disable_parallel_tool_use: only the first call is answered
                self.calls += 1
                block = {"type": "tool_use", "id": tool_use_id(), "name": piece.name, "input": {}}
                out += self._open(("call", piece.index), block)
                if piece.arguments:
                    out.append(self._delta({"type": "input_json_delta", "partial_json": piece.arguments}))
            elif self.open == ("call", piece.index):
                out.append(self._delta({"type": "input_json_delta", "partial_json": piece.arguments}))
        return out

    def _open(self, kind, block: dict) -> list[str]:
        if self.open == kind:
            return []
        out = self._close()
        self.index += 1
        self.open = kind
        return out + [sse("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict) -> str:
        return sse("content_block_delta", {"index": self.index, "delta": delta})


async def stream_message(request, events, shape: MessageShape):
    """Anthropic's server-sent events (the module docstring). Cancelled if the client goes away."""
    blocks = BlockStream(shape.answer, shape.one_call)
    start = {
        "id": shape.ident,
        "type": "message",
        "role": "assistant",
        "model": shape.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": shape.usage(None, 0),
    }
    reason = stop = None
    try:
        yield sse("message_start", {"message": start})
        yield sse("ping", {})
        while True:
            try:
                event = await asyncio.wait_for(events.get(), timeout=PING_SECONDS)
            except TimeoutError:  # a long prompt: keep the connection alive
                yield sse("ping", {})
                continue
            if event.kind == "delta":
                for line in blocks.feed(event.text):
                    yield line
            elif event.kind == "finish":
                reason, stop = event.finish_reason, event.stop
                for line in blocks.finish():
                    yield line
            elif event.kind == "error":
                yield sse("error", {"error": {"type": "api_error", "message": event.message}})
                break
            elif event.kind == "done":
                stop_reason = (
                    "stop_sequence" if stop is not None else shape.stop_reason(reason, blocks.calls > 0)
                )
                delta = {"stop_reason": stop_reason, "stop_sequence": stop}
                usage = shape.usage(event.usage, event.usage["completion_tokens"])
                yield sse("message_delta", {"delta": delta, "usage": usage})
                yield sse("message_stop", {})
                break
    finally:
        if not request.finished:
            request.cancel()
