"""What OpenAI's chat completions and completions answer (respond: a request submitted, then
answered either way): a whole completion's JSON or a stream of server-sent events, their
log-probabilities (chat's and completions' shapes), chat's message and deltas; and embeddings'
vectors. OpenAI's shapes, so the `openai` client reads them unchanged. (The Responses API's
bodies are responses_api.py's; what every API shares is serve/http/'s.)"""

from __future__ import annotations

import base64
import json
import time
import uuid

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from flashformer.serve.engine import Engine
from flashformer.serve.http.answer import AnswerPlan, AnswerReader, read_answer
from flashformer.serve.http.chat import ClientGone, submit, until_done
from flashformer.serve.request import SamplingParams
from flashformer.text.reasoning import Thought
from flashformer.text.tool_calls import CallDelta


async def respond(
    engine: Engine,
    http: Request,
    body,
    prompt: list[int],
    params: SamplingParams,
    model_name: str,
    chat: bool,
    echo: str | None = None,
    answer: AnswerPlan | None = None,
):
    """Submit a chat or completions request (`body`: its n, stream and stream_options) and
    answer it: server-sent events with stream, else one JSON when it is done."""
    request, events = submit(engine, prompt, params, body.n)
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            stream_events(request, events, ident, created, model_name, chat, usage, engine, answer),
            media_type="text/event-stream",
        )
    return await collect(request, events, http, ident, created, model_name, chat, engine, echo, answer)


async def collect(
    request, events, http, ident, created, model_name, chat, engine, echo=None, answer=None
) -> dict:
    """Wait for the whole answer (cancelling it if the client goes away), then one response.
    echo: the prompt's text, which then opens every choice's text (and the prompt's tokens its
    log-probabilities, when the engine scored them: OpenAI's legacy echo). answer: the chat
    request's AnswerPlan (http/answer.py): its reasoning and calls are read out of each choice's text."""
    texts = [""] * len(request.sequences)
    logprobs: list[list] = [[] for _ in request.sequences]
    prompt_logprobs: list = []
    reasons: list[str | None] = [None] * len(request.sequences)
    usage = None
    try:
        async for event in until_done(request, events, http):
            if event.kind == "delta":
                texts[event.index] += event.text
                logprobs[event.index] += event.logprobs
            elif event.kind == "prompt":
                prompt_logprobs = event.logprobs
            elif event.kind == "finish":
                reasons[event.index] = event.finish_reason
            elif event.kind == "done":
                usage = event.usage
    except ClientGone:
        return JSONResponse({}, status_code=499)
    asked = request.params.logprobs is not None
    choices = []
    for index, (text, reason) in enumerate(zip(texts, reasons)):
        if chat:
            message, reason = message_of(text, answer, reason)
            choice = {"index": index, "message": message, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text if echo is None else echo + text, "finish_reason": reason}
        entries = prompt_logprobs + logprobs[index]
        choice["logprobs"] = logprobs_of(entries, engine, chat) if asked else None
        choices.append(choice)
    kind = "chat.completion" if chat else "text_completion"
    return {
        "id": ident,
        "object": kind,
        "created": created,
        "model": model_name,
        "choices": choices,
        "usage": usage,
    }


async def stream_events(
    request, events, ident, created, model_name, chat, include_usage, engine, answer=None
):
    """Server-sent events: a chunk per piece of text, a closing chunk per choice, the usage
    chunk if asked, then [DONE]. Cancelled if the client goes away (the generator is closed).
    answer: the chat request's AnswerPlan; with tools or a reasoning parser each choice's text
    goes through ChatDeltas (below), and a chunk carries a piece of reasoning, content or a call."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    read = answer is not None and (answer.tools is not None or answer.reasoning is not None)
    calls = [ChatDeltas(answer) for _ in request.sequences] if read else None

    def chunk(choices, usage=None) -> str:
        payload = {"id": ident, "object": kind, "created": created, "model": model_name, "choices": choices}
        if include_usage:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"

    def choice(index, text=None, reason=None, logprobs=None, first=False, delta=None) -> dict:
        if chat:
            if delta is None:
                delta = {"content": text} if text is not None else {}
            if first:
                delta = {"role": "assistant", "content": ""}
            out = {"index": index, "delta": delta, "finish_reason": reason}
        else:
            out = {"index": index, "text": text or "", "finish_reason": reason}
        out["logprobs"] = logprobs_of(logprobs, engine, chat) if logprobs else None
        return out

    try:
        if chat:
            yield chunk([choice(i, first=True) for i in range(len(request.sequences))])
        while True:
            event = await events.get()
            if event.kind == "delta" and calls is not None:
                deltas = calls[event.index].feed(event.text) or ([{}] if event.logprobs else [])
                for n, delta in enumerate(deltas):  # the tokens' log-probabilities on the first
                    yield chunk(
                        [choice(event.index, delta=delta, logprobs=event.logprobs if n == 0 else None)]
                    )
            elif event.kind == "delta":
                yield chunk([choice(event.index, event.text, logprobs=event.logprobs)])
            elif event.kind == "finish" and calls is not None:
                for delta in calls[event.index].finish():
                    yield chunk([choice(event.index, delta=delta)])
                reason = calls[event.index].finish_reason(event.finish_reason)
                yield chunk([choice(event.index, reason=reason)])
            elif event.kind == "finish":
                yield chunk([choice(event.index, reason=event.finish_reason)])
            elif event.kind == "error":
                error = {
                    "error": {"message": event.message, "type": "server_error", "param": None, "code": None}
                }
                yield f"data: {json.dumps(error)}\n\n"
                break
            elif event.kind == "done":
                if include_usage:
                    yield chunk([], event.usage)
                break
        yield "data: [DONE]\n\n"
    finally:
        if not request.finished:
            request.cancel()


def logprobs_of(entries, engine, chat: bool) -> dict:
    """The tokens' log-probabilities in the endpoint's shape (chat's or completions')."""
    return chat_logprobs(entries, engine) if chat else completion_logprobs(entries, engine)


def token_text(engine: Engine, token: int) -> str:
    return engine.tokenizer.decode([token], skip_special_tokens=False)


def chat_logprobs(entries, engine) -> dict:
    content = []
    for entry in entries:
        text = token_text(engine, entry.token)
        top = [
            {"token": (t := token_text(engine, i)), "logprob": lp, "bytes": list(t.encode())}
            for i, lp in entry.top
        ]
        content.append(
            {"token": text, "logprob": entry.logprob, "bytes": list(text.encode()), "top_logprobs": top}
        )
    return {"content": content}


def completion_logprobs(entries, engine) -> dict:
    tokens = [token_text(engine, e.token) for e in entries]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],  # None for a prompt's first token
        "top_logprobs": [
            None if e.top is None else {token_text(engine, i): lp for i, lp in e.top} for e in entries
        ],
        "text_offset": offsets,
    }


def embedding_response(vectors: list[np.ndarray], encoding_format: str, tokens: int, model_name: str) -> dict:
    """OpenAI's embeddings response: float lists, or base64 of little-endian float32 (what the
    openai client asks for)."""

    def encoded_vector(vector: np.ndarray):
        if encoding_format == "base64":
            return base64.b64encode(vector.astype("<f4").tobytes()).decode()
        return vector.tolist()

    data = [
        {"object": "embedding", "index": i, "embedding": encoded_vector(v)} for i, v in enumerate(vectors)
    ]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model_name, "usage": usage}


# ---- chat completions' shapes ----


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def message_of(text: str, plan: AnswerPlan, finish_reason: str | None) -> tuple[dict, str | None]:
    """A whole answer's chat message (reasoning_content with a reasoning parser, tool_calls
    read from the text) and its finish reason ("tool_calls" where an answer that ended by
    itself made calls)."""
    answer = read_answer(text, plan)
    message: dict = {"role": "assistant", "content": answer.text}
    if plan.reasoning is not None:
        message["reasoning_content"] = answer.reasoning
    if not answer.calls:
        return message, finish_reason
    message["content"] = answer.text or None
    message["tool_calls"] = [
        {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in answer.calls
    ]
    return message, ("tool_calls" if finish_reason == "stop" else finish_reason)


class ChatDeltas:
    """One choice's streamed deltas in chat completions' shapes: {"reasoning_content": ...},
    {"content": ...}, or {"tool_calls": [{"index", "id", "type", "function": {"name",
    "arguments"}}]} for a call's first piece and {"tool_calls": [{"index", "function":
    {"arguments"}}]} for the next ones."""

    def __init__(self, plan: AnswerPlan):
        self.reader = AnswerReader(plan)
        self.ids: list[str] = []

    def feed(self, text: str) -> list[dict]:
        return [self._delta(piece) for piece in self.reader.feed(text)]

    def finish(self) -> list[dict]:
        return [self._delta(piece) for piece in self.reader.finish()]

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.reader.called and reason == "stop" else reason

    def _delta(self, piece) -> dict:
        if isinstance(piece, Thought):
            return {"reasoning_content": piece.text}
        if isinstance(piece, str):
            return {"content": piece}
        return {"tool_calls": [self._call_delta(piece)]}

    def _call_delta(self, piece: CallDelta) -> dict:
        if piece.name is None:
            return {"index": piece.index, "function": {"arguments": piece.arguments}}
        self.ids.append(call_id())
        function = {"name": piece.name, "arguments": piece.arguments}
        return {"index": piece.index, "id": self.ids[-1], "type": "function", "function": function}
