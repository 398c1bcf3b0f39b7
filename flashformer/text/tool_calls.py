"""Tool calls out of a model's text: one parser per common format, each fed the text as it
comes (a server's deltas) or all at once, with the same result either way.

    parser = parser_for("hermes")
    for delta in deltas:
        for piece in parser.feed(delta):       # str: content; CallDelta: a tool call's piece
            ...
    pieces = parser.finish()                  # what was held back
    content, calls = parse_tool_calls(text, "hermes")   # the same, whole

The formats (what each model family is taught to write):

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number, text
                 around them (Qwen2.5, Hermes 2/3, SmolLM3)
    llama3_json  {"name": ..., "parameters": {...}} as the whole answer, after an optional
                 <|python_tag|>, several joined by ";" (Llama 3.1-3.3)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (the marker is a special
                 token: a server that skips special tokens sees the bare array)
    phi4_mini_json  <|tool_call|>[{"name": ..., "arguments": {...}}, ...]<|/tool_call|> as
                 the whole answer (Phi-4-mini; the tags are special tokens: the bare array too)
    generic      {"name": ..., "arguments": {...}} as the whole answer, or an array of them
                 (the format flashformer's server teaches a template without tool support,
                 and the shape of a call generated under a JSON-schema constraint)

Every JSON format accepts "arguments" or "parameters". A call's arguments are the model's own
JSON text for them, streamed character by character as they arrive (a string value is decoded:
some models write the arguments JSON-encoded). Text that is not a call is content, exactly as
written, except the whitespace that only separates content from a call.

Why one state machine for both uses: a server streams the pieces and also answers whole, and
the two answers must agree. Each parser decides only on text it has seen, and waits while the
text could still go either way (a tail that may be the start of "<tool_call>", a JSON object
whose first key has not arrived), so where the deltas are cut never changes the result.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from flashformer.text.tool_call_json import (
    MORE,
    NO,
    WHITESPACE,
    ValueScanner,
    call_head,
    literal,
    skip_ws,
    value_end,
)


@dataclass
class CallDelta:
    """A piece of tool call `index` (0, 1, ... in the order the model wrote them): the call's
    first piece has its name; the pieces' arguments join to its arguments' JSON text."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as the model wrote it


def _whole_call(text: str) -> ToolCall | None:
    """A complete JSON object read as a call (any key order), or None if it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


# ---- the parsers ----


class ToolCallParser:
    """What the formats share: the text so far, how far it is decided, the calls, the content's
    whitespace rule, and reading one call object (its name, then its arguments as they come).

    Subclasses write _advance(final): consume self.text from self.at as far as it is decided,
    calling _content and the call methods; `final` says no more text will come."""

    name = ""

    def __init__(self):
        self.text, self.at = "", 0
        self.calls: list[ToolCall] = []
        self._out: list = []
        self._pending_ws = ""  # content whitespace not yet known to be content
        self._after_call = False  # a call was made and no content has followed it yet
        self._reading = None  # the call object being read: a _CallReader

    def feed(self, delta: str) -> list:
        """Take the next text; the pieces it decided (str content, CallDelta)."""
        self.text += delta
        self._advance(final=False)
        return self._take()

    def finish(self) -> list:
        """The text ended: the pieces still held back."""
        self._advance(final=True)
        if not self.calls and self._pending_ws:
            self._out.append(self._pending_ws)
        self._pending_ws = ""
        return self._take()

    def _take(self) -> list:
        out, self._out = _merged(self._out), []
        return out

    def _advance(self, final: bool) -> None:
        raise NotImplementedError

    # ---- content ----

    def _content(self, text: str) -> None:
        """Certain content. Whitespace right after a call and right before one is dropped (it
        only separates them); elsewhere it is content, so an answer without calls is exact."""
        text = self._pending_ws + text
        if self._after_call:
            text = text.lstrip(WHITESPACE)
        body = text.rstrip(WHITESPACE)
        self._pending_ws = text[len(body) :]
        if body:
            self._out.append(body)
            self._after_call = False

    # ---- one call object ----

    def _read_call(self, final: bool):
        """Read the call object at self.at: "done" once it closed (self.at after it), MORE while
        it goes on, NO if the text there is not a call (self.at unchanged)."""
        if self._reading is None:
            head = call_head(self.text, self.at)
            if head == MORE and not final:
                return MORE
            if head in (MORE, NO):
                return self._read_whole_call(final)
            self._reading = _CallReader(self, *head)
        return self._reading.advance(final)

    def _read_whole_call(self, final: bool):
        """A call whose keys come in another order: read once its object has closed."""
        end = value_end(self.text, self.at) if self.text[self.at] == "{" else None
        if end is None:
            return MORE if not final and self.text[self.at] == "{" else NO
        call = _whole_call(self.text[self.at : end])
        if call is None:
            return NO
        self._start_call(call.name)
        self._arguments(call.arguments)
        self.at = end
        return "done"

    def _start_call(self, name: str) -> None:
        self._pending_ws = ""
        self.calls.append(ToolCall(name, ""))
        self._out.append(CallDelta(len(self.calls) - 1, name, ""))
        self._after_call = True

    def _arguments(self, piece: str) -> None:
        if piece:
            self.calls[-1].arguments += piece
            self._out.append(CallDelta(len(self.calls) - 1, None, piece))


class _CallReader:
    """The rest of a call object after its head: the arguments' value streamed as it arrives,
    then the object's other keys skipped up to its closing brace."""

    def __init__(self, parser: ToolCallParser, name: str, at: int, closed: bool):
        self.parser = parser
        parser._start_call(name)
        parser.at = at
        if closed:  # {"name": "f"}: no arguments
            parser._arguments("{}")
            self.stage = "done"
        else:
            self.stage = "arguments"  # arguments | streaming | rest | done
        self.scanner = ValueScanner()

    def advance(self, final: bool):
        parser = self.parser
        text = parser.text
        if self.stage == "arguments":
            if text[parser.at] in "{[":  # an object or array: streamed as it comes
                self.stage = "streaming"
            else:  # a string (JSON-encoded arguments) or a bare word: read whole
                end = value_end(text, parser.at)
                if end is None:
                    if not final:
                        return MORE
                    end = len(text)
                raw = text[parser.at : end]
                try:
                    value = json.loads(raw)
                except ValueError:
                    value = raw
                parser._arguments(value if isinstance(value, str) else "{}" if value is None else raw)
                parser.at, self.stage, self.scanner = end, "rest", ValueScanner(depth=1)
        if self.stage == "streaming":
            end, closed = self.scanner.scan(text, parser.at)
            parser._arguments(text[parser.at : end])
            parser.at = end
            if not closed:
                return self._cut(final)
            self.stage, self.scanner = "rest", ValueScanner(depth=1)
        if self.stage == "rest":  # other keys, up to the object's "}"
            end, closed = self.scanner.scan(text, parser.at)
            parser.at = end
            if not closed:
                return self._cut(final)
        parser._reading = None
        return "done"

    def _cut(self, final: bool):
        """The text ended inside the call (max_tokens): the call is what was written."""
        if final:
            self.parser._reading = None
            return "done"
        return MORE


class HermesParser(ToolCallParser):
    """<tool_call>{call}</tool_call> anywhere in the text; the text outside the tags is content.
    A tag not followed by a call object is content too."""

    name = "hermes"
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self.stage = "text"  # text | call | close

    def _advance(self, final: bool) -> None:
        while self.at < len(self.text) or (final and self.stage != "text"):
            if self.stage == "text":
                if not self._text(final):
                    return
            elif self.stage == "call":
                if not self._call(final):
                    return
            elif not self._close(final):
                return

    def _text(self, final: bool) -> bool:
        found = self.text.find(self.open_tag, self.at)
        if found < 0:
            end = len(self.text) if final else len(self.text) - _tag_prefix(self.text, self.at, self.open_tag)
            self._content(self.text[self.at : end])
            self.at = end
            return False
        self._content(self.text[self.at : found])
        self.at = found + len(self.open_tag)
        self.tag_at, self.stage = found, "call"
        return True

    def _call(self, final: bool) -> bool:
        if self._reading is None:
            start = skip_ws(self.text, self.at)
            if start >= len(self.text):
                if final:  # a tag and nothing after it
                    self._content(self.text[self.tag_at :])
                    self.at, self.stage = len(self.text), "text"
                return False
            self.at = start
        result = self._read_call(final)
        if result == MORE:
            return False
        if result == NO:  # the tag was text; what follows it is read as text again
            self._content(self.open_tag)
            self.at, self.stage = self.tag_at + len(self.open_tag), "text"
            return True
        self.stage = "close"
        return True

    def _close(self, final: bool) -> bool:
        start = skip_ws(self.text, self.at)
        found = literal(self.text, start, self.close_tag) if start < len(self.text) else MORE
        if found == MORE and not final:
            return False
        if found not in (MORE, NO):
            self.at = found
        self.stage = "text"
        return True


class JsonCallsParser(ToolCallParser):
    """Calls as the whole answer: an optional marker, then call objects (joined by `separators`,
    or in one JSON array). An answer that does not open with a call is content, whole; text
    after the last call is content."""

    name = "generic"
    markers: tuple[str, ...] = ()
    separators = ";,"

    def __init__(self):
        super().__init__()
        self.stage = "start"  # start | calls | between | text
        self.in_array = False

    def _advance(self, final: bool) -> None:
        while True:
            if self.stage == "text":
                self._content(self.text[self.at :])
                self.at = len(self.text)
                return
            step = getattr(self, "_" + self.stage)  # _start, _calls, _between (a subclass's own)
            if not step(final):
                return

    def _start(self, final: bool) -> bool:
        i = skip_ws(self.text, self.at)
        for marker in self.markers:
            found = literal(self.text, i, marker) if i < len(self.text) else MORE
            if found == MORE and not final:
                return False
            if found not in (MORE, NO):
                i = skip_ws(self.text, found)
                break
        if i >= len(self.text):
            if final:
                self.stage = "text"
                return True
            return False
        if self.text[i] == "[":
            self.in_array = True
            i = skip_ws(self.text, i + 1)
            if i >= len(self.text):
                if final:
                    self.stage = "text"
                    return True
                return False
        if self.text[i] != "{":
            self.stage = "text"  # plain text from the beginning
            return True
        self.opened_at, self.at, self.stage = self.at, i, "calls"
        return True

    def _calls(self, final: bool) -> bool:
        result = self._read_call(final)
        if result == MORE:
            return False
        if result == NO:
            if not self.calls:  # not a call answer: all of it is content
                self.at = self.opened_at
            self.stage = "text"
            return True
        self.stage = "between"
        return True

    def _between(self, final: bool) -> bool:
        i = skip_ws(self.text, self.at)
        if i >= len(self.text):
            if final:
                self.at, self.stage = i, "text"
                return True
            return False
        char = self.text[i]
        if self.in_array and char == "]":
            self.at, self.stage = i + 1, "text"
            return True
        if char in self.separators:
            i = skip_ws(self.text, i + 1)
            if i >= len(self.text):
                if final:
                    self.at, self.stage = i, "text"
                    return True
                return False
            char = self.text[i]
        if char == "{":
            self.at, self.stage = i, "calls"
            return True
        self.stage = "text"  # what follows the calls is content
        return True


class Llama3JsonParser(JsonCallsParser):
    name = "llama3_json"
    markers = ("<|python_tag|>",)


class MistralParser(JsonCallsParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)


class Phi4MiniParser(JsonCallsParser):
    """Phi-4-mini's <|tool_call|>[calls]<|/tool_call|>: both tags are special tokens, so a
    server that skips them sees the bare array; the closing tag, where it is seen, is dropped."""

    name = "phi4_mini_json"
    markers = ("<|tool_call|>",)
    close_tag = "<|/tool_call|>"

    def _between(self, final: bool) -> bool:
        progressed = super()._between(final)
        if self.stage == "text":  # the calls ended: their closing tag first
            self.stage = "close"
        return progressed

    def _close(self, final: bool) -> bool:
        """Past the closing tag, if the text has one there (then content), or the start of one
        that the text's end cut (max_tokens); False while a tail may still become it."""
        i = skip_ws(self.text, self.at)
        found = literal(self.text, i, self.close_tag) if i < len(self.text) else MORE
        if found == MORE and not final:
            return False
        if found != NO:
            self.at = len(self.text) if found == MORE else found
        self.stage = "text"
        return True


PARSERS: dict[str, type[ToolCallParser]] = {
    parser.name: parser
    for parser in (HermesParser, Llama3JsonParser, MistralParser, Phi4MiniParser, JsonCallsParser)
}


def parser_for(name: str) -> ToolCallParser:
    """A fresh parser of the format `name` (one of PARSERS)."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call format {name!r}; expected one of {sorted(PARSERS)}")
    return PARSERS[name]()


def format_of_template(template: str) -> str:
    """The tool-call format a chat template teaches, from the markers it writes: hermes for
    <tool_call>, mistral for [TOOL_CALLS], phi4_mini_json for Phi-4-mini's <|tool_call|> or its
    tools' <|tool|>, llama3_json for Llama 3's headers, else generic."""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|tool_call|>" in template or "<|tool|>" in template:
        return "phi4_mini_json"
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return "llama3_json"
    return "generic"


def parse_tool_calls(text: str, format: str) -> tuple[str, list[ToolCall]]:
    """A whole answer's content and calls (what the streamed pieces join to)."""
    parser = parser_for(format)
    pieces = parser.feed(text) + parser.finish()
    return "".join(p for p in pieces if isinstance(p, str)), parser.calls


# ---- small helpers ----


def _tag_prefix(text: str, at: int, tag: str) -> int:
    """The length of the longest tail of text[at:] that starts `tag` (it may be completed)."""
    for n in range(min(len(tag) - 1, len(text) - at), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _merged(pieces: list) -> list:
    """Adjacent content pieces joined, and adjacent argument pieces of one call."""
    out: list = []
    for piece in pieces:
        last = out[-1] if out else None
        if isinstance(piece, str) and isinstance(last, str):
            out[-1] = last + piece
        elif (
            isinstance(piece, CallDelta)
            and isinstance(last, CallDelta)
            and piece.name is None
            and piece.index == last.index
        ):
            out[-1] = CallDelta(last.index, last.name, last.arguments + piece.arguments)
        else:
            out.append(piece)
    return out
