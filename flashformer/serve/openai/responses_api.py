"""POST /v1/responses (and GET /v1/responses/{id}): OpenAI's Responses API over the chat path
(http/chat.py), whole or streamed. The body becomes a ChatCompletionRequest:

    Responses                                    the chat request
    instructions                                 a system message first (not carried over)
    input: a string                              a user message
    input: items                                 messages (developer -> system; input_text /
                                                 output_text parts), function_call (an assistant's
                                                 tool_calls), function_call_output (role "tool"),
                                                 reasoning (the next assistant's reasoning_content)
    previous_response_id                         that response's conversation, before the input
    tools [{type: function, name, parameters}]   function tools; tool_choice, parallel_tool_calls
    text.format json_schema / json_object        response_format (the structured-output path)
    max_output_tokens, temperature, top_p        max_tokens, temperature, top_p
    chat_template_kwargs (vLLM's)                the same
    store, metadata                              whether the response is kept; echoed back

The answer (http/answer.py) becomes output items: a reasoning item (with --reasoning-parser), a
message with one output_text part, a function_call per call. Streamed: response.created,
response.in_progress, then per item response.output_item.added, its parts and deltas
(response.reasoning_text.delta, response.output_text.delta,
response.function_call_arguments.delta) and their .done events, response.output_item.done,
and last response.completed (response.incomplete when max_output_tokens cut it).

Stored responses (store, the default) are kept in this process's memory, the newest
KEPT_RESPONSES of them: a previous_response_id older than that is a 404, as an unknown one.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flashformer.serve.http.answer import Answer, AnswerReader, read_answer
from flashformer.serve.http.chat import ClientGone, ServerOptions, prepare_chat, submit, until_done
from flashformer.serve.http.protocol import APIError, ChatCompletionRequest, check_model, refuse_unsupported
from flashformer.text.reasoning import Thought
from flashformer.text.tool_calls import ToolCall

KEPT_RESPONSES = 1024
NO_EFFECT = {"user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier",
             "stream_options", "metadata", "store"}  # fmt: skip
NO_OP_VALUES: dict[str, tuple] = {
    "truncation": ("disabled",),
    "include": ([],),
    "background": (False,),
    "top_logprobs": (0,),
    "reasoning": ({}, {"effort": None}, {"summary": None}, {"effort": None, "summary": None}),
}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # refused by name unless NO_EFFECT or NO_OP_VALUES

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ResponseStore:
    """The newest `bound` stored responses: each its whole object and its conversation (the
    chat messages a follow-up continues, without the instructions)."""

    def __init__(self, bound: int = KEPT_RESPONSES):
        self.bound, self.kept = bound, OrderedDict()

    def get(self, ident: str) -> tuple[dict, list[dict]]:
        if ident not in self.kept:
            raise APIError(404, f"previous_response_id: no response {ident!r} is kept here (unknown, not "
                           f"stored, or older than the newest {self.bound})", param="previous_response_id",
                           code="previous_response_not_found")  # fmt: skip
        return self.kept[ident]

    def put(self, ident: str, response: dict, conversation: list[dict]) -> None:
        self.kept[ident] = (response, conversation)
        while len(self.kept) > self.bound:
            self.kept.popitem(last=False)


def add_responses_routes(app: FastAPI, engine, model_name: str, server: ServerOptions) -> None:
    store = ResponseStore()

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, http: Request):
        check_model(body.model, model_name, engine)
        refuse_unsupported(body, NO_EFFECT, NO_OP_VALUES)
        history = store.get(body.previous_response_id)[1] if body.previous_response_id else []
        conversation = history + _input_messages(body.input)
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        chat = _chat_request(body, system + conversation)
        turn = await prepare_chat(engine, chat, server)
        request, events = submit(engine, turn.prompt, turn.params)
        shape = ResponseShape(body, body.model, turn.answer, engine.tokenizer)
        keep = (
            (lambda response, output: store.put(response["id"], response, conversation + output))
            if body.store
            else None
        )
        if body.stream:
            return StreamingResponse(
                stream_response(request, events, shape, keep), media_type="text/event-stream"
            )
        return await whole_response(request, events, http, shape, keep)

    @app.get("/v1/responses/{ident}")
    async def retrieve(ident: str):
        return store.get(ident)[0]


def _input_messages(given) -> list[dict]:
    """The input as chat messages (see the module docstring)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict] = []
    reasoning = None
    for i, item in enumerate(given):
        where = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("user", "system", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant; got "
                               f"{item.get('role')!r}", param=f"{where}.role")  # fmt: skip
            message = {"role": role, "content": _content_text(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(
                    call
                )  # the calls after its text, or after another call
            else:
                turn = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    turn["reasoning_content"], reasoning = reasoning, None
                messages.append(turn)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _content_text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind == "reasoning":
            parts = item.get("content") or []
            reasoning = "".join(
                part.get("text", "") for part in parts if part.get("type") == "reasoning_text"
            )
        else:
            raise APIError(400, f"{where}.type: {kind!r} items are not supported by this server (message, "
                           "function_call, function_call_output, reasoning)", param=f"{where}.type")  # fmt: skip
    return messages


def _content_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(
            400, f"{where}: expected a string or a list of text parts; got {content!r}", param=where
        )
    texts = []
    for j, part in enumerate(content):
        if part.get("type") not in ("input_text", "output_text", "text"):
            raise APIError(400, f"{where}.{j}.type: {part.get('type')!r} parts are not supported by this server "
                           "(input_text, output_text)", param=f"{where}.{j}.type")  # fmt: skip
        texts.append(part.get("text", ""))
    return "".join(texts)


def _chat_request(body: ResponsesRequest, messages: list[dict]) -> ChatCompletionRequest:
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls,
        "chat_template_kwargs": body.chat_template_kwargs,
        "response_format": _text_format(body.text),
    }
    if body.tools is not None:
        fields["tools"] = [_function_tool(tool, f"tools.{i}") for i, tool in enumerate(body.tools)]
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise APIError(400, f"tool_choice must be auto, none, required or {{'type': 'function', 'name': ...}}; "
                           f"got {choice!r}", param="tool_choice")  # fmt: skip
        choice = {"type": "function", "function": {"name": choice["name"]}}
    fields["tool_choice"] = choice
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise APIError(400, f"{where}: {first['msg']}", param=where) from None


def _function_tool(tool: dict, where: str) -> dict:
    if tool.get("type") != "function":
        raise APIError(400, f"{where}.type: {tool.get('type')!r} tools are not supported by this server "
                       "(function)", param=f"{where}.type")  # fmt: skip
    unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
    if unknown:
        name = sorted(unknown)[0]
        raise APIError(400, f"{where}.{name} is not supported by this server", param=f"{where}.{name}")
    function = {
        k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None
    }
    return {"type": "function", "function": function}


def _text_format(text: dict | None) -> dict | None:
    """text.format as chat's response_format (text.verbosity is refused)."""
    if text is None:
        return None
    unknown = {k for k, v in text.items() if k != "format" and v is not None}
    if unknown:
        name = sorted(unknown)[0]
        raise APIError(
            400, f"text.{name} is not supported by this server (got {text[name]!r})", param=f"text.{name}"
        )
    given = text.get("format")
    if given is None or given.get("type") in ("text", "json_object"):
        return given
    if given.get("type") != "json_schema" or not isinstance(given.get("schema"), dict):
        raise APIError(400, "text.format must be text, json_object or {'type': 'json_schema', 'name', 'schema'}; "
                       f"got {given!r}", param="text.format")  # fmt: skip
    return {
        "type": "json_schema",
        "json_schema": {"name": given.get("name", "output"), "schema": given["schema"]},
    }


# ---- the answer ----


class ResponseShape:
    """A response's fixed fields and how its output items are made."""

    def __init__(self, body: ResponsesRequest, model: str, answer, tokenizer):
        self.ident = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.body, self.model, self.answer, self.tokenizer = body, model, answer, tokenizer

    def response(
        self, status: str, output: list[dict], usage: dict | None, reasoning: str | None = None
    ) -> dict:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.ident,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": None if usage is None else self.usage(usage, reasoning),
            "metadata": body.metadata or {},
        }

    def usage(self, usage: dict, reasoning: str | None) -> dict:
        # the engine counts tokens, not which part they fell in: the reasoning's text re-encoded
        thought = len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": min(thought, usage["completion_tokens"])},
            "total_tokens": usage["total_tokens"],
        }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(ident: str, text: str) -> dict:
    return {
        "id": ident,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def message_item(ident: str, text: str, status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {"id": ident, "type": "message", "status": status, "role": "assistant", "content": [part]}


def call_item(ident: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"id": ident, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


def conversation_of(answer: Answer, call_ids: list[str]) -> list[dict]:
    """The answer as the assistant's chat message a follow-up continues."""
    message: dict = {"role": "assistant", "content": answer.text or None}
    if answer.calls:
        message["tool_calls"] = [
            {"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for i, c in zip(call_ids, answer.calls)
        ]
    if answer.reasoning is not None:
        message["reasoning_content"] = answer.reasoning
    return [message]


def output_of(answer: Answer, status: str) -> tuple[list[dict], list[str]]:
    """(the output items, the calls' ids) of a whole answer."""
    output = []
    if answer.reasoning is not None:
        output.append(reasoning_item(_item_id("rs"), answer.reasoning))
    if answer.text or not answer.calls:
        output.append(message_item(_item_id("msg"), answer.text, status))
    call_ids = ["call_" + uuid.uuid4().hex[:24] for _ in answer.calls]
    for call, call_id in zip(answer.calls, call_ids):
        output.append(call_item(_item_id("fc"), call_id, call.name, call.arguments))
    return output, call_ids


async def whole_response(request, events, http, shape: ResponseShape, keep):
    text, reason, usage = "", None, None
    try:
        async for event in until_done(request, events, http):
            if event.kind == "delta":
                text += event.text
            elif event.kind == "finish":
                reason = event.finish_reason
            elif event.kind == "done":
                usage = event.usage
    except ClientGone:
        return JSONResponse({}, status_code=499)
    answer = read_answer(text, shape.answer)
    status = "incomplete" if reason == "length" else "completed"
    output, call_ids = output_of(answer, status)
    response = shape.response(status, output, usage, answer.reasoning)
    if keep is not None:
        keep(response, conversation_of(answer, call_ids))
    return response


class ItemStream:
    """The reader's pieces as output-item events: an item opens when a piece of another kind
    (or a new call) arrives, and is done before the next one opens."""

    def __init__(self, answer):
        self.reader = AnswerReader(answer)
        self.sequence = 0
        self.output: list[dict] = []  # the items done so far
        self.open: dict | None = None  # the open item, as it stands
        self.open_kind = None  # "reasoning", "message" or ("call", its index)
        self.texts = {"reasoning": None, "text": "", "calls": []}  # the whole answer, for keeping
        self.call_ids: list[str] = []

    def event(self, kind: str, **fields) -> str:
        self.sequence += 1
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def feed(self, text: str) -> list[str]:
        return self._events(self.reader.feed(text))

    def finish(self, status: str) -> list[str]:
        out = self._events(self.reader.finish())
        items = self.output + ([self.open] if self.open is not None else [])
        if not any(item["type"] in ("message", "function_call") for item in items):
            # no text and no call: an empty message, as a whole answer has
            out += self._open("message", message_item(_item_id("msg"), "", "in_progress"))
        return out + self._close(status)

    def _events(self, pieces: list) -> list[str]:
        out = []
        for piece in pieces:
            if isinstance(piece, Thought):
                out += self._open("reasoning", reasoning_item(_item_id("rs"), ""))
                index = len(self.output)
                self.open["content"][0]["text"] += piece.text
                out.append(self.event("response.reasoning_text.delta", item_id=self.open["id"], output_index=index,
                                      content_index=0, delta=piece.text))  # fmt: skip
            elif isinstance(piece, str):
                out += self._open("message", message_item(_item_id("msg"), "", "in_progress"))
                index = len(self.output)
                self.open["content"][0]["text"] += piece
                out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=index,
                                      content_index=0, delta=piece, logprobs=[]))  # fmt: skip
            else:
                if piece.name is not None:
                    self.call_ids.append("call_" + uuid.uuid4().hex[:24])
                    item = call_item(_item_id("fc"), self.call_ids[-1], piece.name, "", "in_progress")
                    out += self._open(("call", piece.index), item)
                index = len(self.output)
                if piece.arguments:
                    self.open["arguments"] += piece.arguments
                    out.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                          output_index=index, delta=piece.arguments))  # fmt: skip
        return out

    def _open(self, kind, item: dict) -> list[str]:
        if self.open is not None and self.open_kind == kind:
            return []
        out = self._close("completed")
        self.open, self.open_kind = item, kind
        index = len(self.output)
        added = {k: ([] if k == "content" and item["type"] == "message" else v) for k, v in item.items()}
        if item["type"] == "reasoning":
            added["content"] = []
        out.append(self.event("response.output_item.added", output_index=index, item=added))
        if item["type"] in ("message", "reasoning"):
            part = dict(item["content"][0])
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))  # fmt: skip
        return out

    def _close(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output)
        out = []
        if item["type"] == "message":
            item["status"] = status
            part = item["content"][0]
            self.texts["text"] += part["text"]
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=[]))  # fmt: skip
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))  # fmt: skip
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            self.texts["reasoning"] = (self.texts["reasoning"] or "") + text
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text))  # fmt: skip
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=item["content"][0]))  # fmt: skip
        else:
            item["status"] = "completed"
            self.texts["calls"].append(item)
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]))  # fmt: skip
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        self.output.append(item)
        return out

    def answer(self) -> tuple[Answer, list[str]]:
        """The whole answer the items make, and the calls' ids (for keeping the response)."""
        calls = self.texts["calls"]
        answer = Answer(
            self.texts["reasoning"], self.texts["text"], [ToolCall(c["name"], c["arguments"]) for c in calls]
        )
        return answer, [c["call_id"] for c in calls]


async def stream_response(request, events, shape: ResponseShape, keep):
    items = ItemStream(shape.answer)
    reason = None
    try:
        yield items.event("response.created", response=shape.response("in_progress", [], None))
        yield items.event("response.in_progress", response=shape.response("in_progress", [], None))
        while True:
            event = await events.get()
            if event.kind == "delta":
                for line in items.feed(event.text):
                    yield line
            elif event.kind == "finish":
                reason = event.finish_reason
                for line in items.finish("incomplete" if reason == "length" else "completed"):
                    yield line
            elif event.kind == "error":
                failed = shape.response("failed", items.output, None)
                failed["error"] = {"code": "server_error", "message": event.message}
                yield items.event("response.failed", response=failed)
                break
            elif event.kind == "done":
                status = "incomplete" if reason == "length" else "completed"
                answer, call_ids = items.answer()
                response = shape.response(status, items.output, event.usage, answer.reasoning)
                if keep is not None:
                    keep(response, conversation_of(answer, call_ids))
                yield items.event(f"response.{status}", response=response)
                break
    finally:
        if not request.finished:
            request.cancel()
