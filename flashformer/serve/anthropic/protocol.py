"""Anthropic's Messages API as a chat request: the bodies (pydantic), their translation into a
ChatCompletionRequest for the one chat path (serve/http/chat.py), and Anthropic's error shape.

    Messages                                   the chat request
    system (a string or text blocks)           a system message (blocks joined by a blank line)
    user text blocks                           the user's content parts
    user tool_result blocks                    role "tool" messages (tool_call_id), before the text
    assistant text / tool_use / thinking       content, tool_calls (input as JSON), reasoning_content
    tools [{name, description, input_schema}]  function tools (parameters = input_schema)
    tool_choice auto / any / tool / none       auto / required / the named function / none
      disable_parallel_tool_use               parallel_tool_calls false (auto: the first call kept)
    stop_sequences, temperature, top_p, top_k  stop, temperature, top_p, top_k (body fields)
    output_config.format json_schema           response_format json_schema
    thinking disabled / enabled / adaptive     chat_template_kwargs enable_thinking (and the budget)
    metadata, service_tier, cache_control      nothing: they cannot change the answer

cache_control marks where Anthropic caches a prompt's prefix; this server's prefix cache reuses
every common prefix by itself (serve/scheduler.py), and a cache never changes the tokens, so the
marks are accepted wherever Anthropic allows them and change nothing. Any other field or block
this server cannot honour (images, documents, server tools, redacted thinking, a final
assistant message to continue) is refused with a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flashformer.serve.http.protocol import APIError, ChatCompletionRequest

# fields that cannot change an answer: who asks, how to bill, where to cache
NO_EFFECT = {"metadata", "service_tier", "cache_control"}
BLOCK_NO_EFFECT = {"cache_control"}
ERROR_KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control; anything else is refused by name

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # a server tool (web_search, bash, ...) has no input_schema


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesBase(BaseModel):
    """What shapes the prompt (all of /v1/messages/count_tokens' body)."""

    model_config = ConfigDict(extra="allow")  # refused by name in chat_request, unless NO_EFFECT

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # checked, and for counting changes nothing


class MessagesRequest(MessagesBase):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)  # 0: no filter


class TranslatedChat(ChatCompletionRequest):
    most_stops: ClassVar[int] = 64  # stop_sequences has no limit of 4


class Translation(BaseModel):
    """A Messages body as the chat path takes it, with what only Messages says: the thinking
    budget, and whether at most one tool_use may be answered."""

    chat: TranslatedChat
    budget: int | None = None
    one_call: bool = False


def chat_request(body: MessagesBase, thinks: bool) -> Translation:
    """The body as a chat request (400 naming the field it cannot honour). thinks: the server
    splits reasoning off (--reasoning-parser), so thinking blocks can be answered."""
    _refuse(body.model_extra, "", NO_EFFECT)
    messages = []
    system = _system_text(body.system)
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        messages += _chat_messages(message, f"messages.{i}")
    if body.messages[-1].role == "assistant":
        raise APIError(400, f"messages.{len(body.messages) - 1}: a final assistant message to continue "
                       "(prefill) is not supported; end with a user message", param="messages")  # fmt: skip
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    one_call = False
    if body.tools is not None:
        fields["tools"] = [_function_tool(tool, f"tools.{i}") for i, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        fields["tool_choice"], one_call = _tool_choice(body.tool_choice)
        fields["parallel_tool_calls"] = False if one_call else None
    kwargs, budget = _thinking(body.thinking, getattr(body, "max_tokens", None), thinks)
    response_format = _output_format(body.output_config)
    if kwargs:
        fields["chat_template_kwargs"] = kwargs
    if isinstance(body, MessagesRequest):
        fields.update(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            stop=_stop_sequences(body.stop_sequences),
            response_format=response_format,
        )
    try:
        chat = TranslatedChat.model_validate(fields)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise APIError(400, f"{where}: {first['msg']}", param=where) from None
    return Translation(chat=chat, budget=budget, one_call=one_call)


def _refuse(extra: dict | None, where: str, allowed: set) -> None:
    for name, value in (extra or {}).items():
        if value is None or name in allowed:
            continue
        field = f"{where}{name}"
        raise APIError(400, f"{field} is not supported by this server (got {value!r})", param=field)


def _system_text(system) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n\n".join(_text_block(block, f"system.{i}") for i, block in enumerate(system))


def _text_block(block: dict, where: str) -> str:
    if block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise APIError(400, f"{where}: expected a text block {{'type': 'text', 'text': ...}}; got "
                       f"{_short(block)}", param=where)  # fmt: skip
    _refuse(
        {k: v for k, v in block.items() if k not in ("type", "text")},
        f"{where}.",
        BLOCK_NO_EFFECT | {"citations"},
    )
    if block.get("citations"):
        raise APIError(400, f"{where}.citations: citations are not supported", param=f"{where}.citations")
    return block["text"]


def _chat_messages(message: Message, where: str) -> list[dict]:
    """One Messages message as chat messages: a user's tool results become role "tool"
    messages (first, as Anthropic puts them first), its text the user message after them."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, results, calls, thoughts = [], [], [], []
    for j, block in enumerate(message.content):
        at = f"{where}.content.{j}"
        kind = block.get("type")
        if kind == "text":
            texts.append({"type": "text", "text": _text_block(block, at)})
        elif kind == "tool_result" and message.role == "user":
            results.append(_tool_result(block, at))
        elif kind == "tool_use" and message.role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "thinking" and message.role == "assistant":
            _refuse(
                {k: v for k, v in block.items() if k not in ("type", "thinking")}, f"{at}.", {"signature"}
            )
            thoughts.append(str(block.get("thinking", "")))
        else:
            raise APIError(400, f"{at}.type: {kind!r} blocks in a {message.role} message are not supported by "
                           "this server (text, tool_use, tool_result, thinking)", param=f"{at}.type")  # fmt: skip
    out = list(results)
    if message.role == "user" and (texts or not results):
        out.append({"role": "user", "content": texts})
    if message.role == "assistant":
        turn: dict[str, Any] = {"role": "assistant", "content": texts if texts or not calls else None}
        if calls:
            turn["tool_calls"] = calls
        if thoughts:
            turn["reasoning_content"] = "\n".join(thoughts)
        out.append(turn)
    return out


def _tool_result(block: dict, where: str) -> dict:
    _refuse({k: v for k, v in block.items() if k not in ("type", "tool_use_id", "content", "is_error")},
            f"{where}.", BLOCK_NO_EFFECT)  # fmt: skip
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text_block(part, f"{where}.content.{k}") for k, part in enumerate(content))
    if not isinstance(content, str) or not isinstance(block.get("tool_use_id"), str):
        raise APIError(400, f"{where}: a tool_result needs tool_use_id (a string) and content (a string or "
                       f"text blocks); got {_short(block)}", param=where)  # fmt: skip
    if block.get("is_error"):  # the model must know the call failed: say so where it reads it
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _tool_use(block: dict, where: str) -> dict:
    _refuse(
        {k: v for k, v in block.items() if k not in ("type", "id", "name", "input")},
        f"{where}.",
        BLOCK_NO_EFFECT,
    )
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise APIError(
            400, f"{where}: a tool_use needs id and name (strings); got {_short(block)}", param=where
        )
    arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
    return {
        "id": block["id"],
        "type": "function",
        "function": {"name": block["name"], "arguments": arguments},
    }


def _function_tool(tool: ToolDefinition, where: str) -> dict:
    _refuse(tool.model_extra, f"{where}.", BLOCK_NO_EFFECT)
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _tool_choice(choice: ToolChoice) -> tuple[Any, bool]:
    one_call = bool(choice.disable_parallel_tool_use)
    if choice.type == "tool":
        if not choice.name:
            raise APIError(
                400, "tool_choice.name: a tool choice of type 'tool' names the tool", param="tool_choice.name"
            )
        return {"type": "function", "function": {"name": choice.name}}, one_call
    if choice.name is not None:
        raise APIError(400, f"tool_choice.name: only a choice of type 'tool' names a tool (type {choice.type!r})",
                       param="tool_choice.name")  # fmt: skip
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], one_call


def _thinking(thinking: dict | None, max_tokens: int | None, thinks: bool) -> tuple[dict, int | None]:
    """(the template's enable_thinking, the budget) for Anthropic's thinking."""
    if thinking is None:
        return {}, None
    kind = thinking.get("type")
    if kind == "disabled":
        _refuse({k: v for k, v in thinking.items() if k != "type"}, "thinking.", set())
        return {"enable_thinking": False}, None
    if kind not in ("enabled", "adaptive"):
        raise APIError(400, f"thinking.type must be 'enabled', 'adaptive' or 'disabled'; got {kind!r}",
                       param="thinking.type")  # fmt: skip
    if not thinks:
        raise APIError(400, f"thinking: this server was started without --reasoning-parser, so it cannot "
                       f"return thinking blocks (got type {kind!r})", param="thinking")  # fmt: skip
    if thinking.get("display") not in (None, "summarized"):
        raise APIError(400, f"thinking.display {thinking['display']!r} is not supported (the reasoning is "
                       "returned as written)", param="thinking.display")  # fmt: skip
    _refuse(
        {k: v for k, v in thinking.items() if k not in ("type", "display", "budget_tokens")},
        "thinking.",
        set(),
    )
    budget = thinking.get("budget_tokens")
    if kind == "adaptive":
        if budget is not None:
            raise APIError(
                400,
                "thinking.budget_tokens: only type 'enabled' takes a budget",
                param="thinking.budget_tokens",
            )
        return {"enable_thinking": True}, None
    limit = max_tokens if max_tokens is not None else float("inf")
    if not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget < limit:
        raise APIError(400, f"thinking.budget_tokens must be an integer of at least 1 and below max_tokens "
                       f"({max_tokens}); got {budget!r}", param="thinking.budget_tokens")  # fmt: skip
    return {"enable_thinking": True}, budget


def _stop_sequences(stops: list[str] | None) -> list[str] | None:
    for i, stop in enumerate(stops or []):
        if not stop:
            raise APIError(
                400, f"stop_sequences.{i}: a stop sequence cannot be empty", param=f"stop_sequences.{i}"
            )
    return stops or None


def _output_format(config: dict | None) -> dict | None:
    """output_config.format (Anthropic's structured outputs) as response_format."""
    if config is None:
        return None
    _refuse({k: v for k, v in config.items() if k != "format"}, "output_config.", set())
    given = config.get("format")
    if given is None:
        return None
    if (
        not isinstance(given, dict)
        or given.get("type") != "json_schema"
        or not isinstance(given.get("schema"), dict)
    ):
        raise APIError(400, "output_config.format must be {'type': 'json_schema', 'schema': {...}}; got "
                       f"{_short(given)}", param="output_config.format")  # fmt: skip
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": given["schema"]}}


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


# ---- errors ----


def speaks_anthropic(path: str) -> bool:
    """Whether a path is Anthropic's (its errors then take Anthropic's shape)."""
    return path.startswith("/v1/messages")


def anthropic_error(error: APIError) -> JSONResponse:
    """Anthropic's error: {"type": "error", "error": {"type", "message"}}, with its statuses (a
    full queue is 529, overloaded_error, which Anthropic's clients retry)."""
    status = 529 if error.status == 503 else error.status
    body = {
        "type": "error",
        "error": {"type": ERROR_KINDS.get(status, "api_error"), "message": error.message},
    }
    return JSONResponse(body, status_code=status)
