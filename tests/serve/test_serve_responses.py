"""OpenAI's Responses API (/v1/responses) with the real `openai` client, against the real
SmolLM2-135M-Instruct Q4_1 file served with --quantize gguf (one server for the module). The
references: the same conversation through /v1/chat/completions (greedy: the same tokens),
`jsonschema` for structured outputs and calls, and the event names OpenAI documents."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from test_serve import KEY, openai_client, serving

from flashformer.checkpoints.gguf.packaged_models import smollm2_path

NAME = "SmolLM2-135M-Instruct.Q4_1"
INSTRUCTIONS = "You are a concise assistant."
QUESTION = "What is the capital of France? Answer in one sentence."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city now",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}


@pytest.fixture(scope="module")
def server():
    with serving(smollm2_path(), "--quantize", "gguf", "--api-key", KEY, "--max-batch", "4",
                 "--kv-blocks", "256", "--no-webui") as url:  # fmt: skip
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def chat_answer(client, messages, **kwargs):
    return client.chat.completions.create(model=NAME, temperature=0, messages=messages, **kwargs)


def test_output_text_equals_the_chat_answer(client):
    response = client.responses.create(model=NAME, instructions=INSTRUCTIONS, input=QUESTION,
                                       max_output_tokens=40, temperature=0)  # fmt: skip
    chat = chat_answer(client, [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}],
                       max_tokens=40)  # fmt: skip
    assert response.output_text == chat.choices[0].message.content and response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.status == ("completed" if chat.choices[0].finish_reason == "stop" else "incomplete")
    assert response.id.startswith("resp_") and response.model == NAME


def test_input_items_read_as_the_string(client):
    items = [{"role": "developer", "content": INSTRUCTIONS},
             {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]  # fmt: skip
    from_items = client.responses.create(model=NAME, input=items, max_output_tokens=12, temperature=0)
    from_text = client.responses.create(model=NAME, instructions=INSTRUCTIONS, input=QUESTION,
                                        max_output_tokens=12, temperature=0)  # fmt: skip
    assert from_items.output_text == from_text.output_text
    assert from_items.usage.input_tokens == from_text.usage.input_tokens


def test_streamed_equals_whole_and_the_events_are_in_order(client):
    # a budget the answer ends within: the SDK's accumulator below wants "response.completed"
    kwargs = dict(model=NAME, input="Name three colors.", max_output_tokens=120, temperature=0)
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed", whole.incomplete_details
    events = list(client.responses.create(stream=True, **kwargs))
    names = [event.type for event in events]
    assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert names[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]  # fmt: skip
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    with client.responses.stream(**kwargs) as stream:  # the SDK's own accumulator
        final = stream.get_final_response()
    assert final.output_text == whole.output_text


def test_a_json_schema_format_is_followed(client):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}  # fmt: skip
    response = client.responses.create(
        model=NAME, input=QUESTION, max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)


def test_a_function_call_and_its_output_continue_a_stored_response(client):
    """tool_choice names the function: a function_call whose arguments validate; then its output
    through previous_response_id, whose answer equals the chat API's for the whole history."""
    question = "What is the weather in Paris?"
    first = client.responses.create(model=NAME, input=question, tools=[WEATHER], max_output_tokens=60,
                                    temperature=0, tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    (call,) = [item for item in first.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    result = '{"temperature": 21}'
    second = client.responses.create(model=NAME, previous_response_id=first.id, tools=[WEATHER],
                                     max_output_tokens=30, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": call.call_id, "output": result}])  # fmt: skip
    tool = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    history = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]  # fmt: skip
    chat = chat_answer(client, history, tools=[tool], max_tokens=30)
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == (chat.choices[0].message.content or "")
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_unknown_and_unstored_responses_cannot_be_continued(client):
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(
            model=NAME, input="Hi", previous_response_id="resp_nothing", max_output_tokens=2
        )
    unstored = client.responses.create(model=NAME, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model=NAME, input="And?", previous_response_id=unstored.id, max_output_tokens=2
        )


def test_max_output_tokens_makes_it_incomplete(client):
    response = client.responses.create(model=NAME, input="Tell me a long story.", max_output_tokens=5)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5


@pytest.mark.parametrize(
    "change, named",
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused_by_name(client, change, named):
    body = {"model": NAME, "input": "Hi", "max_output_tokens": 2, **change}
    with pytest.raises(openai.BadRequestError, match=named.replace(".", r"\.")):
        client.post("/responses", body=body, cast_to=object)
