"""Tool calls through `flashformer serve` with the real `openai` client: the tiny model of
test_serve.py, its folder given a second chat template, "tool_use", in Qwen2.5's style (the
tokenizer renders a request with tools through it, as transformers picks it); a request
without tools but with a tool history goes through SmolLM2's own template, which has no
tools: the generic format. The prompts are compared with transformers' rendering of the same
template and messages; `required` and a named function give calls whose arguments validate
(jsonschema); streamed answers equal whole ones; bad shapes get a 400 naming the field."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_chat_folder
from test_serve import KEY, http, openai_client, serving

from flashformer.text.tool_prompt import generic_tool_messages, with_call_arguments_as_objects

HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

TOOL_USE_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' + (messages[0].content if messages[0].role == 'system' else 'You are helpful.') }}
{{- '\\n\\n# Tools\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\nCall one within <tool_call></tool_call>: {"name": <name>, "arguments": <object>}<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- for call in message.tool_calls %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = QUESTION + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_7",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_7", "content": '{"temperature": 21}'},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """test_serve.py's tiny model with a 1024-token context and a second template, tool_use."""
    folder = tiny_chat_folder(tmp_path_factory.mktemp("tiny-tools"), max_positions=1024)
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_USE_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def server(folder):
    with serving(folder, "--api-key", KEY, "--max-batch", "8", "--kv-blocks", "96") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def theirs(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def post(server, body: dict) -> tuple[int, dict]:
    code, text = http("POST", server + "/v1/chat/completions", json.dumps(body).encode(), HEADERS)
    return code, json.loads(text)


def ask(client, folder, messages, **kwargs):
    return client.chat.completions.create(model=folder.name, messages=messages, **kwargs)


def joined(chunks, index: int = 0) -> tuple[str, list[dict], str]:
    """A stream's content, calls (name, arguments, id) and finish reason for choice `index`, as
    the client sees them."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        for choice in (c for c in chunk.choices if c.index == index):
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"name": "", "arguments": "", "id": None})
                if piece.id:
                    assert call["id"] is None and piece.id.startswith("call_")
                    call["id"] = piece.id
                if piece.function.name:
                    call["name"] += piece.function.name
                call["arguments"] += piece.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def test_tools_render_through_the_templates_tool_use(client, folder, theirs):
    """With tools, the prompt is the tool_use template's, as transformers renders the same
    messages (calls' arguments as objects) and tools."""
    reply = ask(client, folder, HISTORY, tools=[WEATHER, TIME], max_tokens=3, temperature=0)
    expected = theirs.apply_chat_template(
        with_call_arguments_as_objects(HISTORY),
        tools=[WEATHER, TIME],
        add_generation_prompt=True,
        return_dict=False,
    )
    assert reply.usage.prompt_tokens == len(expected)
    text = theirs.decode(expected)
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in text and "<tools>" in text


def test_tool_history_without_tools_is_the_generic_format(client, folder, theirs):
    """No tools in the request (SmolLM2's template, which has none): the calls and results of the
    history in the generic format; tool_choice "none" with tools: the same, tools not shown."""
    for extra in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        reply = ask(client, folder, HISTORY, max_tokens=3, temperature=0, **extra)
        messages = generic_tool_messages(HISTORY, [])
        expected = theirs.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        assert reply.usage.prompt_tokens == len(expected)
        assert reply.choices[0].message.tool_calls is None
        assert '{"name": "get_weather", "arguments": {"city": "Paris"' in theirs.decode(expected)


def test_auto_streamed_equals_whole(client, folder):
    """auto: the model decides (this one writes no call); the text is content, streamed or not."""
    kwargs = dict(tools=[WEATHER], max_tokens=24, temperature=0)
    whole = ask(client, folder, QUESTION, **kwargs)
    content, calls, reason = joined(ask(client, folder, QUESTION, stream=True, **kwargs))
    message = whole.choices[0].message
    assert (content, calls, reason) == (message.content, [], whole.choices[0].finish_reason)
    assert message.tool_calls is None and len(content) > 10


def calls_of(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def whole_and_streamed(client, folder, messages, **kwargs):
    """(content, [(name, arguments)], finish reason) of the same request whole and streamed,
    checking the whole answer's shapes (ids, content null without text)."""
    reply = ask(client, folder, messages, **kwargs)
    message, reason = reply.choices[0].message, reply.choices[0].finish_reason
    for call in message.tool_calls or []:
        assert call.id.startswith("call_") and call.type == "function"
    whole = (message.content or "", calls_of(message), reason)
    content, calls, streamed_reason = joined(ask(client, folder, messages, stream=True, **kwargs))
    assert all(call["id"] for call in calls)
    return whole, (content, [(c["name"], c["arguments"]) for c in calls], streamed_reason)


@pytest.mark.parametrize("temperature", [0, 1])
def test_named_function_arguments_validate(client, folder, temperature):
    import jsonschema

    for seed in range(2 if temperature else 1):
        kwargs = dict(tools=[TIME, WEATHER], max_tokens=160, temperature=temperature, seed=seed)
        whole, streamed = whole_and_streamed(
            client,
            folder,
            QUESTION,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            **kwargs,
        )
        assert whole == streamed
        content, calls, reason = whole
        assert reason == "tool_calls" and content == "" and [name for name, _ in calls] == ["get_weather"]
        jsonschema.validate(json.loads(calls[0][1]), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("temperature", [0, 1])
def test_required_calls_validate(client, folder, temperature):
    import jsonschema

    schemas = {tool["function"]["name"]: tool["function"].get("parameters") or {} for tool in (WEATHER, TIME)}
    for parallel in (False, True):
        kwargs = dict(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=parallel,
                      max_tokens=200, temperature=temperature, seed=3)  # fmt: skip
        whole, streamed = whole_and_streamed(client, folder, QUESTION, **kwargs)
        assert whole == streamed
        content, calls, reason = whole
        assert reason == "tool_calls" and content == "" and calls
        assert len(calls) == 1 or parallel
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), schemas[name])


def test_several_choices_each_call(client, folder):
    """n=2: each choice its own call and its own parser, whole and streamed alike."""
    import jsonschema

    kwargs = dict(model=folder.name, messages=QUESTION, tools=[WEATHER], tool_choice="required", n=2,
                  parallel_tool_calls=False, max_tokens=160, temperature=1, seed=5)  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert len(whole.choices) == 2
    for choice in whole.choices:
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        content, calls, reason = joined(chunks, choice.index)
        assert (content, [(c["name"], c["arguments"]) for c in calls], reason) == (
            "",
            calls_of(choice.message),
            "tool_calls",
        )


def test_round_trip(client, folder, theirs):
    """A forced call, its result in the history, then the model's answer in text; the second
    prompt holds the call as the template writes it (transformers' rendering)."""
    tools = [WEATHER]
    first = ask(client, folder, QUESTION, tools=tools, tool_choice="required", max_tokens=160, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    history = QUESTION + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    final = ask(client, folder, history, tools=tools, tool_choice="none", max_tokens=12, temperature=0)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    expected = theirs.apply_chat_template(
        generic_tool_messages(with_call_arguments_as_objects(history), []),
        add_generation_prompt=True,
        return_dict=False,
    )  # tool_choice "none": no tools, so SmolLM2's own template and the generic history
    assert final.usage.prompt_tokens == len(expected)
    again = ask(client, folder, history, tools=tools, max_tokens=12, temperature=0)  # auto: tool_use
    expected = theirs.apply_chat_template(
        with_call_arguments_as_objects(history), tools=tools, add_generation_prompt=True, return_dict=False
    )
    assert again.usage.prompt_tokens == len(expected)
    assert f'"arguments": {call.function.arguments}' in theirs.decode(expected)


BAD = [
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools.0.function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "'get_weather' is given twice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice names the function 'get_time'"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "needs tools"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"not": {}}}}}}],
      "tool_choice": "required"}, "tools: "),  # a keyword the grammar engine cannot enforce
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice 'required' and response_format both decide"),
]  # fmt: skip


@pytest.mark.parametrize("fields, named", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_shapes_get_400_naming_the_field(server, folder, fields, named):
    code, reply = post(server, {"model": folder.name, "messages": QUESTION, **fields})
    assert code == 400 and named in reply["error"]["message"], reply
    field = named.split()[0].rstrip(":")
    if "." in field or field == "tools":
        assert reply["error"]["param"] == field


# ---- the schema a forced call is generated under (no server) ----

ADDRESS = {
    "type": "function",
    "function": {
        "name": "ship",
        "parameters": {
            "type": "object",
            "$defs": {"place": {"type": "object", "properties": {"zip": {"$ref": "#/$defs/zip"}}, "required": ["zip"]},
                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "properties": {"to": {"$ref": "#/$defs/place"}, "count": {"type": "integer", "minimum": 1}},
            "required": ["to", "count"],
        },
    },
}  # fmt: skip


def test_call_schemas_accept_exactly_the_valid_calls():
    """jsonschema's verdicts on calls under tool_call_schema equal its verdicts on the arguments
    under the function's own schema ($defs moved to the root, references kept), except keys
    the function's objects do not list."""
    import jsonschema

    from flashformer.serve.http.tools import tool_call_schema

    good = {"to": {"zip": "75001"}, "count": 2}
    bad = [{"to": {"zip": "7500"}, "count": 2}, {"to": {"zip": "75001"}, "count": 0}, {"to": {}}]
    tools = [WEATHER, ADDRESS, TIME]
    named = tool_call_schema([ADDRESS], many=False)
    required = tool_call_schema(tools, many=True)
    single = tool_call_schema(tools, many=True, parallel=False)
    for schema in (named, required, single):
        jsonschema.Draft202012Validator.check_schema(schema)
    own = ADDRESS["function"]["parameters"]
    assert jsonschema.Draft202012Validator(own).is_valid(good)
    assert not any(jsonschema.Draft202012Validator(own).is_valid(b) for b in bad)
    valid = jsonschema.Draft202012Validator(named).is_valid
    assert valid({"name": "ship", "arguments": good})
    assert not any(valid({"name": "ship", "arguments": b}) for b in bad)
    assert not valid({"name": "get_weather", "arguments": good}) and not valid({"name": "ship"})
    # keys the function does not list: valid for its own schema, not generated in a call
    extra = {"to": {"zip": "75001", "floor": 3}, "count": 2, "note": "x"}
    assert jsonschema.Draft202012Validator(own).is_valid(extra) and not valid(
        {"name": "ship", "arguments": extra}
    )
    assert list(named["properties"]) == ["name", "arguments"]  # the name streams first
    valid = jsonschema.Draft202012Validator(required).is_valid
    weather = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    assert valid([weather, {"name": "ship", "arguments": good}, {"name": "get_time", "arguments": {}}])
    assert not valid([]) and not valid([{"name": "ship", "arguments": bad[0]}])
    assert not valid([{"name": "get_weather", "arguments": good}])
    assert jsonschema.Draft202012Validator(single).is_valid([weather])
    assert not jsonschema.Draft202012Validator(single).is_valid([weather, weather])


# ---- a real model (slow) ----


@pytest.fixture(scope="module")
def smollm2_server():
    from flashformer.checkpoints.gguf.packaged_models import smollm2_path

    with serving(smollm2_path(), "--quantize", "gguf", "--max-batch", "4", "--kv-blocks", "64") as url:
        yield url


@pytest.mark.slow
def test_smollm2_calls_the_weather_tool(smollm2_server):
    """SmolLM2-135M-Instruct (its template has no tools: the generic format) asked for the
    weather in Paris: the forced call names Paris and validates, streamed as whole."""
    import jsonschema
    from openai import OpenAI

    client = OpenAI(base_url=smollm2_server + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        kwargs = dict(
            model=model, messages=QUESTION, tools=[WEATHER], tool_choice=choice, max_tokens=80, temperature=0
        )
        reply = client.chat.completions.create(**kwargs)
        (call,) = reply.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])
        assert call.function.name == "get_weather" and arguments["city"] == "Paris"
        assert reply.choices[0].finish_reason == "tool_calls"
        content, calls, reason = joined(client.chat.completions.create(stream=True, **kwargs))
        assert (content, [(c["name"], c["arguments"]) for c in calls], reason) == (
            "",
            calls_of(reply.choices[0].message),
            "tool_calls",
        )
