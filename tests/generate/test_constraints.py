"""Constrained decoding (generate.constraints) with a tiny random-weight LLaMA over SmolLM2's
49k-token vocabulary: whatever the model prefers, the text parses. Checked against independent
references: `jsonschema` for schemas, Python's `re` for regexes, the option list for choices,
and for the mask itself a brute force over every token's bytes (as llguidance's own tokenizer
loader spells them, not text.vocabulary)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from helpers import tiny_chat_folder

import flashformer
from flashformer.generate.constraints import (
    Constraint,
    ConstraintSpec,
    UnsupportedSchema,
    allowed_tokens,
    compile_constraint,
)
from flashformer.text.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "pet": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}
MODES = {
    "greedy": {},
    "sampling": {"do_sample": True, "temperature": 1.0, "seed": 3},
    "beams": {"num_beams": 3},
}


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    folder = tiny_chat_folder(tmp_path_factory.mktemp("tiny-chat"), max_positions=256)
    return flashformer.from_pretrained(folder), Tokenizer.from_folder(folder)


def prompt_ids(tokenizer, text="Answer in JSON."):
    messages = [{"role": "user", "content": text}]
    return torch.tensor([tokenizer.apply_chat_template(messages, add_generation_prompt=True)])


def generated_text(model, tokenizer, constraint, max_new_tokens=60, **kwargs):
    ids = prompt_ids(tokenizer)
    out = model.generate(
        ids,
        constraint=constraint,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.stop_token_ids,
        **kwargs,
    )
    new = out[0, ids.shape[1] :].tolist()
    ended = any(t in tokenizer.stop_token_ids for t in new)
    return tokenizer.decode(new), ended


@pytest.mark.parametrize("mode", sorted(MODES))
def test_json_schema_output_validates(chat, mode):
    model, tokenizer = chat
    constraint = Constraint.json_schema(SCHEMA, tokenizer, model.config.vocab_size)
    text, ended = generated_text(model, tokenizer, constraint, **MODES[mode])
    assert ended, text  # every string and number of the schema is bounded: the grammar must end
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_regex_output_matches(chat, mode):
    model, tokenizer = chat
    pattern = r"(ab|cd)[0-9]{2,4}-[a-z]{3}"
    text, ended = generated_text(model, tokenizer, Constraint.regex(pattern, tokenizer), **MODES[mode])
    assert ended and re.fullmatch(pattern, text), text


@pytest.mark.parametrize("mode", sorted(MODES))
def test_choice_output_is_an_option(chat, mode):
    model, tokenizer = chat
    options = ["positive", "negative", "neutral or mixed"]
    text, ended = generated_text(model, tokenizer, Constraint.choice(options, tokenizer), **MODES[mode])
    assert ended and text in options, text


def test_lark_and_gbnf_grammars(chat):
    model, tokenizer = chat
    lark = 'start: "x=" NUMBER ";"\nNUMBER: /[1-9][0-9]?/'
    text, ended = generated_text(model, tokenizer, Constraint.grammar(lark, tokenizer))
    assert ended and re.fullmatch(r"x=[1-9][0-9]?;", text), text
    gbnf = 'root ::= "color: " ("red" | "green") "."'
    text, ended = generated_text(model, tokenizer, Constraint.grammar(gbnf, tokenizer))
    assert ended and text in ("color: red.", "color: green."), text


def test_json_object_parses(chat):
    model, tokenizer = chat
    text, ended = generated_text(model, tokenizer, Constraint.json_object(tokenizer), max_new_tokens=40)
    if ended:
        assert isinstance(json.loads(text), dict), text
    else:  # cut by max_new_tokens: still the start of an object
        assert text.startswith("{"), text


def test_mask_is_every_token_that_keeps_an_option_possible(chat):
    """The allowed tokens after each prefix of an option are exactly those whose bytes extend
    the text towards some option (and the stop tokens once the text is one)."""
    import llguidance

    _, tokenizer = chat
    reference = llguidance.LLTokenizer(tokenizer.backend.to_str())
    vocab = tokenizer.vocab_size
    spelled = [reference.decode_bytes([i]) for i in range(vocab)]
    special = {i for i, t in tokenizer.backend.get_added_tokens_decoder().items() if t.special}
    options = [b"yes", b"yes please", b"no"]
    constraint = Constraint.choice([o.decode() for o in options], tokenizer)
    matcher = constraint.matcher()
    stops = torch.tensor(tokenizer.stop_token_ids)
    text = b""
    for token in tokenizer.encode("yes please", add_special_tokens=False) + [None]:
        allowed = set(allowed_tokens([matcher], stops, vocab)[0].nonzero().flatten().tolist())
        expected = {
            i
            for i in range(vocab)
            if i not in special and spelled[i] and any(o.startswith(text + spelled[i]) for o in options)
        }
        if text in options:
            expected |= set(tokenizer.stop_token_ids)
        assert allowed == expected, (text, sorted(allowed ^ expected)[:10])
        if token is not None:
            assert matcher.advance(token)
            text += spelled[token]
    assert matcher.finished


def test_free_rows_are_untouched_by_constrained_ones(chat):
    model, tokenizer = chat
    ids = torch.cat([prompt_ids(tokenizer, "one"), prompt_ids(tokenizer, "two")])
    stops = tokenizer.stop_token_ids
    constraint = Constraint.regex(r"[0-9]+", tokenizer)
    mixed = model.generate(ids, constraint=[constraint, None], max_new_tokens=12, eos_token_id=stops)
    free = model.generate(ids[1:], max_new_tokens=12, eos_token_id=stops)
    assert torch.equal(mixed[1, : free.shape[1]], free[0])
    assert re.fullmatch(r"[0-9]+", tokenizer.decode(mixed[0, ids.shape[1] :].tolist()))


def test_a_finished_grammar_ends_despite_min_new_tokens(chat):
    model, tokenizer = chat
    text, ended = generated_text(model, tokenizer, Constraint.choice(["ok"], tokenizer), min_new_tokens=5)
    assert ended and text == "ok"


def test_unenforceable_keyword_is_named():
    from helpers.gguf import smollm2_tokenizer

    with pytest.raises(UnsupportedSchema) as error:
        Constraint.json_schema({"type": "array", "uniqueItems": True}, smollm2_tokenizer())
    assert error.value.keyword == "uniqueItems" and "uniqueItems" in str(error.value)


def test_compiled_once_per_distinct_spec():
    from helpers.gguf import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    first = compile_constraint(ConstraintSpec.of("json_schema", {"type": "integer", "minimum": 3}), tokenizer)
    again = compile_constraint(ConstraintSpec.of("json_schema", {"minimum": 3, "type": "integer"}), tokenizer)
    other = compile_constraint(ConstraintSpec.of("json_schema", {"type": "integer", "minimum": 4}), tokenizer)
    assert first is again and first is not other


@pytest.mark.parametrize(
    "spec",
    [
        {"regex": ""},
        {"choice": []},
        {"choice": ["a", 3]},
        {"json_schema": "{not json"},
        {"yaml": "x"},
        "json",
    ],
)
def test_bad_specs_are_refused_by_name(spec):
    with pytest.raises(ValueError):
        ConstraintSpec.parse(spec)
