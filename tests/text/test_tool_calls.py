"""flashformer.text.tool_calls: each format's fixtures give the content and calls written by hand
beside them, and the same fed one character at a time, or in random cuts, as a server streams."""

from __future__ import annotations

import json
import random

import pytest

from flashformer.text.tool_calls import PARSERS, CallDelta, format_of_template, parse_tool_calls, parser_for

WEATHER = '{"city": "Paris", "unit": "celsius"}'

# (format, model text, content, [(name, arguments JSON text)])
FIXTURES = [
    # Hermes / Qwen2.5: tags anywhere, text around them
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>', "",
     [("get_weather", WEATHER)]),
    ("hermes", f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     "Let me look.", [("get_weather", WEATHER)]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": "}{\\"<tool_call>", "y": [1, {"z": null}]}}\n'
     '</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\nBoth asked.',
     "Both asked.", [("a", '{"x": "}{\\"<tool_call>", "y": [1, {"z": null}]}'), ("b", "{}")]),
    ("hermes", '<tool_call>{"arguments": {"q": "é ✓"}, "name": "search"}</tool_call>', "",
     [("search", '{"q": "é ✓"}')]),  # keys in another order: read once the object closes
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', "",
     [("f", '{"a": 1}')]),  # arguments JSON-encoded in a string
    ("hermes", '<tool_call>\n{"name": "f", "id": 7, "arguments": {"a": 1}}\n</tool_call>', "",
     [("f", '{"a": 1}')]),  # an unknown key where "arguments" should come: read whole
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}, "id": "x}"}\n</tool_call>', "",
     [("f", '{"a": 1}')]),  # keys after the arguments are skipped
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2', "", [("f", '{"a": [1, 2')]),  # cut
    ("hermes", "2 < 3 and <tool_ <tool_call", "2 < 3 and <tool_ <tool_call", []),
    ("hermes", "see <tool_call> not a call </tool_call>  ", "see <tool_call> not a call </tool_call>  ", []),
    ("hermes", "  Plain answer.\n\n", "  Plain answer.\n\n", []),
    ("hermes", "", "", []),
    # Llama 3.1-3.3's JSON
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}', "", [("get_weather", WEATHER)]),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; {{"name": "t", '
     '"parameters": {}}', "", [("get_weather", WEATHER), ("t", "{}")]),
    ("llama3_json", '{"name": "now"}', "", [("now", "{}")]),
    ("llama3_json", '{"answer": 42, "unit": "m"} is my reply', '{"answer": 42, "unit": "m"} is my reply', []),
    ("llama3_json", 'The JSON is {"name": "x", "parameters": {}}', 'The JSON is {"name": "x", "parameters": {}}',
     []),
    ("llama3_json", "<|python", "<|python", []),
    # Mistral: the marker is a special token, often skipped by the detokenizer
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "b", '
     '"arguments": {"n": -1.5e3}}]', "", [("get_weather", WEATHER), ("b", '{"n": -1.5e3}')]),
    ("mistral", f'[{{"name": "get_weather", "arguments": {WEATHER}}}]', "", [("get_weather", WEATHER)]),
    ("mistral", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    # Phi-4-mini: an array between special tokens, which a detokenizer may skip
    ("phi4_mini_json", f'<|tool_call|>[{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "t", '
     '"arguments": {}}]<|/tool_call|>', "", [("get_weather", WEATHER), ("t", "{}")]),
    ("phi4_mini_json", f'<|tool_call|> [{{"name": "get_weather", "arguments": {WEATHER}}}] <|/tool_call|>\nDone.',
     "Done.", [("get_weather", WEATHER)]),
    ("phi4_mini_json", f'[{{"name": "get_weather", "arguments": {WEATHER}}}]', "", [("get_weather", WEATHER)]),
    ("phi4_mini_json", '<|tool_call|>{"name": "now"}<|/tool', "", [("now", "{}")]),  # cut in the tag
    ("phi4_mini_json", "[1, 2] <|/tool_call|> are", "[1, 2] <|/tool_call|> are", []),
    ("phi4_mini_json", "<|tool_c", "<|tool_c", []),
    # the generic format (and a call generated under a JSON-schema constraint)
    ("generic", f'{{"name": "get_weather", "arguments": {WEATHER}}}', "", [("get_weather", WEATHER)]),
    ("generic", f'{{"name": "get_weather", "arguments": {WEATHER}}}\n{{"name": "get_time", "arguments": '
     '{"zone": "CET"}}', "", [("get_weather", WEATHER), ("get_time", '{"zone": "CET"}')]),
    ("generic", f'[{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "g", "arguments": {{}}}}]',
     "", [("get_weather", WEATHER), ("g", "{}")]),
    ("generic", f'{{"name": "get_weather", "arguments": {WEATHER}}}\nI asked for the weather.',
     "I asked for the weather.", [("get_weather", WEATHER)]),
    ("generic", '{"name": "get_weather", "arguments": {"city": "Par', "", [("get_weather", '{"city": "Par')]),
    ("generic", '{"name": "get_wea', '{"name": "get_wea', []),  # cut before its name ended: text
    ("generic", "It is sunny in Paris.", "It is sunny in Paris.", []),
    ("generic", "  {not json", "  {not json", []),
]  # fmt: skip


def streamed(fmt: str, deltas: list[str]) -> tuple[str, list[tuple[str, str]], list]:
    """What the pieces of a streamed parse join to: content, calls, and the pieces themselves."""
    parser = parser_for(fmt)
    pieces = [piece for delta in deltas for piece in parser.feed(delta)] + parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    calls: dict[int, list] = {}
    for piece in pieces:
        if isinstance(piece, CallDelta):
            if piece.name is not None:
                assert piece.index not in calls, "a call's name comes once, with its first piece"
                calls[piece.index] = [piece.name, ""]
            calls[piece.index][1] += piece.arguments
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(call) for call in calls.values()], pieces


@pytest.mark.parametrize("fmt, text, content, calls", FIXTURES)
def test_fixture_whole_and_one_character_at_a_time(fmt, text, content, calls):
    whole_content, whole_calls = parse_tool_calls(text, fmt)
    assert (whole_content, [(c.name, c.arguments) for c in whole_calls]) == (content, calls)
    by_character = streamed(fmt, list(text))
    assert by_character[:2] == (content, calls)
    for seed in range(3):  # random cuts, as a detokenizer's pieces fall
        rng, cuts = random.Random(seed), []
        at = 0
        while at < len(text):
            step = rng.randint(1, 6)
            cuts.append(text[at : at + step])
            at += step
        assert streamed(fmt, cuts)[:2] == (content, calls)


def test_arguments_stream_as_they_arrive():
    """A client sees a call's name before its arguments end, and the arguments in pieces."""
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>'
    parser, seen = parser_for("hermes"), []
    for char in text:
        seen.append(parser.feed(char))
    named_at = next(i for i, pieces in enumerate(seen) if pieces)
    assert named_at == text.index(WEATHER)  # the name, once the arguments' first character came
    assert seen[named_at] == [CallDelta(0, "get_weather", "{")]
    arguments = [p.arguments for pieces in seen[named_at + 1 :] for p in pieces]
    assert arguments == list(WEATHER[1:])
    assert parser.finish() == []


def test_content_before_a_call_streams_before_the_call_ends():
    parser = parser_for("hermes")
    pieces = parser.feed("Let me look. <tool_c")
    assert pieces == ["Let me look."]  # the space before a possible tag waits with it


def test_arguments_validate_as_json_where_complete():
    for fmt, text, _, _ in FIXTURES:
        for call in parse_tool_calls(text, fmt)[1]:
            if not text.endswith(("[1, 2", '"Par')):  # the two cut by max_tokens
                assert isinstance(json.loads(call.arguments), dict)


def test_formats_of_templates():
    assert format_of_template("{{ '<tool_call>' }}{% if tools %}{% endif %}") == "hermes"
    assert format_of_template("<|start_header_id|>{{ tools }}") == "llama3_json"
    assert format_of_template("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]") == "mistral"
    assert format_of_template("{{ tools }}") == "generic"
    assert format_of_template("<|system|>{{ tools }}<|tool|>") == "phi4_mini_json"
    assert sorted(PARSERS) == ["generic", "hermes", "llama3_json", "mistral", "phi4_mini_json"]
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'"):
        parser_for("xml")
