"""Tool calls in the chat endpoint: what a request's `tools` and `tool_choice` ask for, the
prompt they make and the JSON schema a forced call is generated under (answer.py reads the
calls out of the answers).

    tool_choice      what the model may do                     how the call is read
    none / no tools  answer in text (the tools are not shown)  -
    auto (default)   answer, or call any tools                 the template's format's parser
    required         call one or more of the tools             the generic parser, of JSON
    {"type": "function", "function": {"name": N}}              generated under a JSON schema
                     call N                                    (tool_call_schema)

For `required` and a named function the answer is generated under the JSON-schema constraint
of the call (`{"name": ..., "arguments": <the function's parameters>}`, an array of them for
`required`), so its arguments always validate against the function's schema; the prompt
still shows the tools in the model's own format. The format of an `auto` answer is the one
the chat template teaches (text.tool_calls.format_of_template) unless the server was started
with --tool-parser; a template without tool support gets the generic format
(text.tool_prompt). The shapes of the request's fields are in protocol.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashformer.generate.constraints import ConstraintSpec
from flashformer.serve.http.protocol import APIError, ChatCompletionRequest
from flashformer.text.tool_calls import PARSERS, format_of_template
from flashformer.text.tool_prompt import (
    generic_tool_messages,
    template_knows_tools,
    with_call_arguments_as_objects,
)

NO_ARGUMENTS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of one answer: choice ("auto", "required" or "named"), the
    parser of the answer (a text.tool_calls format), the tools as the template sees them, and
    the JSON schema the answer is generated under (None: free text, for auto)."""

    choice: str
    format: str
    tools: list[dict]
    schema: dict | None


def plan_tools(
    body: ChatCompletionRequest, template: str | None, parser: str | None = None
) -> ToolPlan | None:
    """The request's ToolPlan, None when no tool applies (none given, or tool_choice "none").
    Raises a 400 naming tool_choice or tools for a choice the tools cannot meet. template: the
    chat template the prompt is rendered with; parser: the server's --tool-parser, if any."""
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
    choice = body.tool_choice
    names = [tool["function"]["name"] for tool in tools]
    repeated = next((name for name in names if names.count(name) > 1), None)
    if repeated is not None:
        raise APIError(400, f"tools: the function name {repeated!r} is given twice", param="tools")
    if choice is None or choice == "auto":
        if not tools:
            return None
        if template is None or not template_knows_tools(template):
            return ToolPlan("auto", "generic", tools, None)  # the format its prompt teaches
        return ToolPlan("auto", parser or format_of_template(template), tools, None)
    if choice == "none":
        return None
    if not tools:
        asked = choice if isinstance(choice, str) else choice.model_dump()
        raise APIError(400, f"tool_choice {asked!r} needs tools; the request gives none", param="tool_choice")
    parallel = body.parallel_tool_calls is not False
    if choice == "required":
        return ToolPlan("required", "generic", tools, tool_call_schema(tools, many=True, parallel=parallel))
    named = choice.function.name
    chosen = [tool for tool in tools if tool["function"]["name"] == named]
    if not chosen:
        raise APIError(
            400, f"tool_choice names the function {named!r}; the tools are {names}", param="tool_choice"
        )
    return ToolPlan("named", "generic", tools, tool_call_schema(chosen, many=False))


def template_messages(messages: list[dict], template: str | None, plan: ToolPlan | None):
    """(messages, tools) for the chat template: the messages with their calls' arguments as
    objects and the tools, when the template renders tools; else the generic format's
    messages and no tools (text.tool_prompt). A conversation without tools stays as it is."""
    if template is not None and template_knows_tools(template):
        return with_call_arguments_as_objects(messages), (plan.tools if plan else None)
    with_tools = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if plan is None and not with_tools:
        return messages, None
    return generic_tool_messages(messages, plan.tools if plan else []), None


def call_constraint(plan: ToolPlan | None, asked: tuple | None) -> tuple[ConstraintSpec, str] | None:
    """The constraint of a forced call (required, named), as structured.compile_for takes it
    (the spec, and "tools": the field a 400 then names); None for an answer left free. asked:
    the request's structured output (structured.requested_constraint), which cannot also be
    the shape of a call."""
    if plan is None or plan.schema is None:
        return None
    if asked is not None:
        field = asked[1]
        raise APIError(
            400, f"tool_choice {plan.choice!r} and {field} both decide the answer's shape; ask for one",
            param=field,
        )  # fmt: skip
    return ConstraintSpec.of("json_schema", plan.schema), "tools"


def tool_call_schema(tools: list[dict], many: bool, parallel: bool = True) -> dict:
    """The JSON schema of a call to one of `tools`: {"name": <its name>, "arguments": <its
    parameters>}, name first (so a streamed call's name comes before its arguments); many: an
    array of one or more (one if not parallel). Each function's $defs move to the root under
    "<name>.<key>" (a reference inside arguments would otherwise point at the wrong root), and
    its objects take no keys beyond their properties unless they say so (_closed)."""
    definitions: dict = {}
    calls = []
    for tool in tools:
        function = tool["function"]
        parameters = function.get("parameters") or NO_ARGUMENTS
        calls.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": function["name"]},
                    "arguments": _closed(_hoisted(parameters, function["name"], definitions)),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": call, "minItems": 1} if many else dict(call)
    if many and not parallel:
        schema["maxItems"] = 1
    if definitions:
        schema["$defs"] = definitions
    return schema


def _hoisted(parameters: dict, name: str, definitions: dict) -> dict:
    """parameters without its $defs / definitions (added to `definitions` under "name.key"),
    its references rewritten to match."""
    local = {**parameters.get("$defs", {}), **parameters.get("definitions", {})}
    for key, value in local.items():
        definitions[f"{name}.{key}"] = _closed(_references_moved(value, name))
    return _references_moved({k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}, name)


COMBINATORS = ("allOf", "anyOf", "oneOf", "not", "$ref", "if")


def _closed(schema):
    """The schema with `additionalProperties: false` on each object that lists properties and
    says nothing of others (down through properties and items, not through combinators, where
    another branch may allow more keys). Every call it allows is valid under the original; a
    small model otherwise goes on inventing keys until max_tokens cuts the call."""
    if not isinstance(schema, dict) or any(key in schema for key in COMBINATORS):
        return schema
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {key: _closed(value) for key, value in out["properties"].items()}
        if not any(
            key in out for key in ("additionalProperties", "patternProperties", "unevaluatedProperties")
        ):
            out["additionalProperties"] = False
    if isinstance(out.get("items"), dict):
        out["items"] = _closed(out["items"])
    return out


def _references_moved(schema, name: str):
    if isinstance(schema, list):
        return [_references_moved(item, name) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str):
            for prefix in ("#/$defs/", "#/definitions/"):
                if value.startswith(prefix):
                    value = f"#/$defs/{name}.{value[len(prefix) :]}"
            out[key] = value
        else:
            out[key] = _references_moved(value, name)
    return out


def check_parser(name: str | None) -> None:
    """--tool-parser's value: one of text.tool_calls' formats."""
    if name is not None and name not in PARSERS:
        raise ValueError(
            f"--tool-parser {name!r} is not a tool-call format; expected one of {sorted(PARSERS)}"
        )
