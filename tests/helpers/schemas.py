"""JSON schemas made from seeds, for the structured-output suites: nested objects, arrays with
minItems/maxItems, enums, integers and numbers with minimum/maximum, required and optional
properties, and `$defs` references. Strings and arrays are bounded, so that a grammar-following
answer ends within a few hundred tokens (numbers' digits are not: those may be cut)."""

from __future__ import annotations

import random

WORDS = ["red", "green", "blue", "cat", "dog", "owl", "north", "south", "small", "large", "yes", "no"]
NAMES = ["alpha", "beta", "gamma", "delta", "kind", "size", "count", "label", "items", "score", "owner"]


def random_schema(seed: int) -> dict:
    rng = random.Random(seed)
    defs: dict[str, dict] = {}

    def value(depth: int) -> dict:
        kinds = ["string", "integer", "number", "boolean", "enum", "ref"]
        if depth < 2:
            kinds += ["array", "object", "object"]
        kind = rng.choice(kinds)
        if kind == "string":
            schema = {"type": "string", "maxLength": rng.randint(2, 10)}
            if rng.random() < 0.3:
                schema["minLength"] = 1
            if rng.random() < 0.2:
                return {"type": "string", "pattern": "^[a-z]{1,6}$"}
            return schema
        if kind == "integer":
            low = rng.randint(-50, 50)
            return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
        if kind == "number":
            low = rng.choice([0, -1, 10])
            return {"type": "number", "minimum": low, "maximum": low + rng.choice([1, 100])}
        if kind == "boolean":
            return {"type": "boolean"}
        if kind == "enum":
            return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
        if kind == "ref":
            name = f"def{len(defs)}"
            defs[name] = {}  # the name is taken before its body is made (which may hold refs)
            defs[name] = {"enum": rng.sample(WORDS, 3)} if rng.random() < 0.5 else obj(2)
            return {"$ref": f"#/$defs/{name}"}
        if kind == "array":
            low = rng.randint(0, 2)
            return {
                "type": "array",
                "items": value(depth + 1),
                "minItems": low,
                "maxItems": low + rng.randint(0, 2),
            }
        return obj(depth + 1)

    def obj(depth: int) -> dict:
        names = rng.sample(NAMES, rng.randint(1, 3 if depth else 4))
        properties = {name: value(depth) for name in names}
        required = [name for name in names if rng.random() < 0.7]
        schema = {"type": "object", "properties": properties, "additionalProperties": False}
        if required:
            schema["required"] = required
        return schema

    schema = obj(0)
    if defs:
        schema["$defs"] = defs
    return schema


def schema_suite(count: int = 100, first_seed: int = 0) -> list[dict]:
    return [random_schema(seed) for seed in range(first_seed, first_seed + count)]
