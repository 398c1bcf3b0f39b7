"""Tools in a conversation's prompt: through the model's chat template when it knows `tools`,
else in the generic format below, so that any chat model can be offered functions.

    if template_knows_tools(template):
        text = render_chat_template(template, with_call_arguments_as_objects(messages), tools=tools)
    else:
        text = render_chat_template(template, generic_tool_messages(messages, tools))

The generic format (docs/serving.md, "Tool calls"): a system message lists the functions, one
JSON line each ({"name", "description", "parameters"}), and asks for a call as the whole
answer, `{"name": <function name>, "arguments": <object>}`, several on separate lines (what
text.tool_calls' generic parser reads). In the history, an assistant's calls become its text
in that same form, and the tools' results become a user message, each result introduced by
`Result of <name> (<call id>):`. Templates without tool support often accept only system,
user and assistant turns that alternate, which is why the results are user turns, and
consecutive results one turn.
"""

from __future__ import annotations

import json
from functools import lru_cache

from flashformer.text.chat_template import template_variables

GENERIC_INSTRUCTIONS = (
    "You can call these functions. Each is described by a JSON object with its name, what it "
    "does, and the JSON schema of its arguments:\n{functions}\n\n"
    "To call a function, answer with only a JSON object of this form, and nothing else:\n"
    '{{"name": <the function\'s name>, "arguments": <an object of its arguments>}}\n'
    "To call several, write one such object per line. The results come back in the next "
    "message. Answer in plain text when no function is needed."
)


@lru_cache(maxsize=16)
def template_knows_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable (and so renders tools itself)."""
    names = template_variables(template)  # None: not valid Jinja, which rendering will report
    return names is not None and "tools" in names


def function_of(tool: dict) -> dict:
    """A tool's function description: OpenAI's {"type": "function", "function": {...}}, or the
    bare function dict."""
    return tool.get("function", tool) if isinstance(tool, dict) else tool


def with_call_arguments_as_objects(messages: list[dict]) -> list[dict]:
    """The conversation with every assistant call's `arguments` as an object. OpenAI sends them
    as JSON text; templates write them with `| tojson`, which would quote the text again
    (transformers' documentation asks for a dict; vLLM converts them the same way). Arguments
    that are not a JSON object stay as they are."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            message = {**message, "tool_calls": [_call_with_object_arguments(call) for call in calls]}
        out.append(message)
    return out


def generic_tool_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation in the generic format (module docstring), for a template that does not
    know tools: only system, user and assistant messages with text content. No tools (a
    history with calls, and tool_choice "none"): the history alone, without instructions."""
    names = {}  # call id -> function name, for the results
    out: list[dict] = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            lines = []
            for call in message["tool_calls"]:
                function = call.get("function", call)
                names[call.get("id")] = function.get("name")
                arguments = _arguments_object(function.get("arguments", {}))
                lines.append(
                    json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
                )
            text = "\n".join(([content] if content else []) + lines)
            out.append({**_plain_fields(message), "role": "assistant", "content": text})
        elif role == "tool":
            call_id = message.get("tool_call_id")
            name = message.get("name") or names.get(call_id) or "the function"
            result = (
                f"Result of {name} ({call_id}):\n{content}" if call_id else f"Result of {name}:\n{content}"
            )
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n\n" + result
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
        else:
            out.append({**_plain_fields(message), "content": content})
    out = [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
    if not tools:
        return out
    functions = "\n".join(json.dumps(_description(function_of(t)), ensure_ascii=False) for t in tools)
    instructions = GENERIC_INSTRUCTIONS.format(functions=functions)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + instructions}
    else:
        out.insert(0, {"role": "system", "content": instructions})
    return out


# ---- small helpers ----


def _description(function: dict) -> dict:
    described = {"name": function.get("name")}
    if function.get("description"):
        described["description"] = function["description"]
    described["parameters"] = function.get("parameters") or {"type": "object", "properties": {}}
    return described


def _arguments_object(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _call_with_object_arguments(call: dict) -> dict:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    arguments = _arguments_object(function["arguments"])
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def _plain_fields(message: dict) -> dict:
    """A message without its tool fields (a template without tool support never reads them)."""
    return {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
