"""Structured outputs in a request: OpenAI's response_format and vLLM's fields, read into one
generate.constraints spec and compiled off the engine's thread.

    spec = requested_constraint(body)              # None: free text; APIError 400 when malformed
    constraint = await compile_for(engine, spec)   # compiled once per distinct spec (cached)

The fields, each of the two endpoints:
- response_format {"type": "json_object"} | {"type": "json_schema", "json_schema": {"name",
  "schema", "strict", "description"}} (OpenAI's; {"type": "text"} is free text);
- structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...} (vLLM's
  current object; its disable_fallback and disable_any_whitespace change nothing here: the
  engine never falls back, and JSON's whitespace is always json.dumps' one space);
- guided_json, guided_regex, guided_choice, guided_grammar (vLLM's older names, removed from
  vLLM in 0.12 but still sent by many clients).
At most one of them may ask for a constraint. A schema keyword the grammar engine cannot
enforce (uniqueItems, not, if/then/else, ...) is refused with 400 naming it: the response
would otherwise not be guaranteed to validate.
"""

from __future__ import annotations

import asyncio
import threading

from pydantic import BaseModel

from flashformer.generate.constraints import (
    Constraint,
    ConstraintSpec,
    GrammarVocabulary,
    UnsupportedSchema,
    compile_constraint,
)
from flashformer.serve.http.protocol import APIError

GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}
STRUCTURED_NO_EFFECT = {"disable_fallback", "disable_any_whitespace"}


def requested_constraint(body: BaseModel) -> tuple[ConstraintSpec, str] | None:
    """The constraint a request asks for and the field that asked (for errors), or None."""
    asked = []
    response_format = getattr(body, "response_format", None)
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            asked.append((spec, "response_format"))
    structured = getattr(body, "structured_outputs", None)
    if structured is not None:
        asked += _structured_outputs(structured)
    for name, kind in GUIDED.items():
        value = getattr(body, name, None)
        if value is not None:
            asked.append((_spec(kind, value, name), name))
    if len(asked) > 1:
        fields = ", ".join(name for _, name in asked)
        raise APIError(400, f"ask for one structured output at a time; got {fields}", param=asked[1][1])
    return asked[0] if asked else None


def _response_format(value) -> ConstraintSpec | None:
    if not isinstance(value, dict) or "type" not in value:
        raise APIError(
            400, f"response_format must be an object with a type; got {value!r}", param="response_format"
        )
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec.of("json_object")
    if kind == "json_schema":
        described = value.get("json_schema")
        if not isinstance(described, dict) or not isinstance(described.get("schema"), dict):
            raise APIError(
                400,
                "response_format.json_schema must be an object with a schema (a JSON schema object); "
                f"got {described!r}",
                param="response_format.json_schema",
            )
        return _spec("json_schema", described["schema"], "response_format.json_schema.schema")
    raise APIError(
        400,
        f"response_format.type {kind!r} is not supported (text, json_object or json_schema)",
        param="response_format.type",
    )


def _structured_outputs(value) -> list[tuple[ConstraintSpec, str]]:
    if not isinstance(value, dict):
        raise APIError(
            400, f"structured_outputs must be an object; got {value!r}", param="structured_outputs"
        )
    asked = []
    for key, given in value.items():
        if given is None or key in STRUCTURED_NO_EFFECT:
            continue
        name = f"structured_outputs.{key}"
        if key not in STRUCTURED:
            raise APIError(400, f"{name} is not supported by this server (got {given!r})", param=name)
        if key == "json_object" and given is False:
            continue
        asked.append((_spec(STRUCTURED[key], given, name), name))
    return asked


def _spec(kind: str, value, name: str) -> ConstraintSpec:
    try:
        return ConstraintSpec.of(kind, value)
    except ValueError as error:
        raise APIError(400, f"{name}: {error}", param=name) from None


async def compile_for(engine, asked: tuple[ConstraintSpec, str] | None) -> Constraint | None:
    """The compiled constraint (generate.constraints' cache: once per distinct spec), built in
    the event loop's thread pool so that neither the engine's loop nor other requests wait on
    it; 400 naming the field (and the schema keyword) when it cannot be compiled."""
    if asked is None:
        return None
    spec, name = asked
    vocab = engine.model.config.vocab_size
    loop = asyncio.get_running_loop()
    try:
        return await loop.run_in_executor(None, compile_constraint, spec, engine.tokenizer, vocab)
    except UnsupportedSchema as error:
        raise APIError(400, f"{name}: {error}", param=name, code="unsupported_schema_keyword") from None
    except ImportError as error:
        raise APIError(400, f"{name}: this server cannot constrain outputs: {error}", param=name) from None
    except ValueError as error:
        raise APIError(400, f"{name}: {error}", param=name) from None


def describe_vocabulary_soon(engine) -> None:
    """Describe the tokenizer's vocabulary for the grammar engine in a background thread at
    start (0.2 s for SmolLM2's 49k tokens, 2 s for Gemma's 262k), so that the first constrained
    request does not wait for it; a server without llguidance serves free text as before."""

    def describe() -> None:
        try:
            GrammarVocabulary.of(engine.tokenizer, engine.model.config.vocab_size)
        except (ImportError, ValueError):  # a constrained request then says why, with a 400
            pass

    threading.Thread(target=describe, name="describe-vocabulary", daemon=True).start()
