"""Scanning JSON text that may still be arriving, for the tool-call parsers (tool_calls.py):
where a value ends, whether a prefix can still become a literal, and a call object's head
(its name and where its arguments begin). Each answer is a position, MORE (the text so far
cannot decide) or NO (it cannot be what was looked for), so a parser waits rather than guesses."""

from __future__ import annotations

import json

WHITESPACE = " \t\n\r"
ARGUMENT_KEYS = ('"arguments"', '"parameters"')

MORE = "more"  # the text so far cannot decide: wait for more
NO = "no"  # the text cannot be what was looked for


def skip_ws(text: str, at: int) -> int:
    while at < len(text) and text[at] in WHITESPACE:
        at += 1
    return at


def literal(text: str, at: int, word: str):
    """The position after `word` at `at`, MORE if the text ends inside a prefix of it, else NO."""
    piece = text[at : at + len(word)]
    if piece == word:
        return at + len(word)
    return MORE if word.startswith(piece) and len(piece) < len(word) else NO


def string_end(text: str, at: int) -> int | None:
    """The position after the JSON string starting at text[at] == '"', None while unfinished."""
    i = at + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def value_end(text: str, at: int) -> int | None:
    """The position after the JSON value starting at `at` (an object, array, string, or a bare
    word / number), None while it may go on."""
    if text[at] == '"':
        return string_end(text, at)
    if text[at] not in "{[":
        i = at
        while i < len(text) and text[i] not in WHITESPACE + ",}]":
            i += 1
        return i if i < len(text) else None
    depth, i = 0, at
    while i < len(text):
        char = text[i]
        if char == '"':
            end = string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


class ValueScanner:
    """Finds where an object or array ends, a character at a time, remembering where it stopped
    (so a long argument costs O(its length) over the whole stream, not per delta)."""

    def __init__(self, depth: int = 0):
        self.depth, self.in_string, self.escaped = depth, False, False

    def scan(self, text: str, start: int) -> tuple[int, bool]:
        """(where scanning stopped, whether the value closed there: just past its last bracket)."""
        i = start
        while i < len(text):
            char = text[i]
            i += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i, True
        return i, False


def call_head(text: str, at: int):
    """A call object's beginning, `{"name": "...", "arguments": ` (or "parameters"), at `at`:
    (name, where its arguments' value starts, False), (name, just past the object, True) for an
    object that closes after its name, MORE, or NO (keys in another order, or not a call)."""
    i = literal(text, at, "{")
    if i in (MORE, NO):
        return i
    i = literal(text, skip_ws(text, i), '"name"')
    if i in (MORE, NO):
        return i
    i = literal(text, skip_ws(text, i), ":")
    if i in (MORE, NO):
        return i
    i = skip_ws(text, i)
    if i >= len(text):
        return MORE
    if text[i] != '"':
        return NO
    end = string_end(text, i)
    if end is None:
        return MORE
    name = json.loads(text[i:end])
    i = skip_ws(text, end)
    if i >= len(text):
        return MORE
    if text[i] == "}":
        return name, i + 1, True
    if text[i] != ",":
        return NO
    i = skip_ws(text, i + 1)
    found = [literal(text, i, key) for key in ARGUMENT_KEYS]
    after = next((f for f in found if f not in (MORE, NO)), None)
    if after is None:
        return MORE if MORE in found else NO
    i = literal(text, skip_ws(text, after), ":")
    if i in (MORE, NO):
        return i
    i = skip_ws(text, i)
    return MORE if i >= len(text) else (name, i, False)
