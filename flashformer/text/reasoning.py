"""A thinking model's reasoning out of its text: what it writes between <think> and </think>
(Qwen3, DeepSeek-R1 and its distills, QwQ) is reasoning, what follows is the answer. One
state machine, fed the text as it comes (a server's deltas) or all at once, with the same
result either way (as text.tool_calls' parsers).

    parser = ReasoningParser("qwen3", starts_in="before")
    for delta in deltas:
        for piece in parser.feed(delta):      # Thought: reasoning; str: the answer's text
            ...
    pieces = parser.finish()                 # what was held back
    reasoning, answer = split_reasoning(text, "qwen3", "before")   # the same, whole

Where the text starts (starts_in; reasoning_start reads it off the prompt's end):

    thinking   the prompt opened <think> (DeepSeek-R1's template, Qwen3-Thinking-2507's): the
               text is reasoning until </think>
    before     the text may open with <think> (Qwen3's template with enable_thinking on: the
               model writes the tag itself); any other first word makes it all answer
    answer     the prompt closed the reasoning (Qwen3 with enable_thinking off writes an empty
               <think></think>): all answer

The two formats differ only where the prompt says nothing: qwen3 starts "before" (a Qwen3
answer without the tag has no reasoning), deepseek-r1 starts "thinking" (R1 often leaves the
opening tag out and its text up to </think> is still reasoning). A <think> that opens the text
is dropped in either state. The whitespace that only frames the reasoning (after <think>,
before </think>, after it) belongs to neither part.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
WHITESPACE = " \t\n\r"
FORMATS = {"qwen3": "before", "deepseek-r1": "thinking"}  # format -> where its text starts by default
STATES = ("thinking", "before", "answer")


@dataclass
class Thought:
    """A piece of reasoning (the answer's pieces are plain str)."""

    text: str


def reasoning_start(format: str, prompt_tail: str) -> str:
    """Where the text of a prompt ending in prompt_tail starts ("thinking", "before" or
    "answer"): a prompt that ends with </think> closed the reasoning; one whose last <think> has
    no </think> after it opened it; otherwise the format's default."""
    check_format(format)
    if prompt_tail.rstrip(WHITESPACE).endswith(END):
        return "answer"
    if prompt_tail.rfind(START) > prompt_tail.rfind(END):
        return "thinking"
    return FORMATS[format]


def check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError(f"reasoning parser {format!r} is not known; expected one of {sorted(FORMATS)}")


class ReasoningParser:
    """One answer's text split into Thought pieces and the answer's str pieces; see the module
    docstring. Nothing is decided on a tail that could still be the start of a tag."""

    def __init__(self, format: str, starts_in: str | None = None):
        check_format(format)
        if starts_in is not None and starts_in not in STATES:
            raise ValueError(f"starts_in must be one of {STATES}; got {starts_in!r}")
        self.state = starts_in or FORMATS[format]
        self.held = ""  # text not decided yet
        self.opening = True  # nothing but framing whitespace seen in the current part
        self.thought = False  # whether any reasoning was read

    def feed(self, text: str) -> list:
        self.held += text
        pieces: list = []
        while self.held:
            before = (self.state, len(self.held))
            piece = getattr(self, "_" + self.state)()
            if piece:
                pieces.append(piece)
            if (self.state, len(self.held)) == before:
                break  # waiting for more text
        return _merged(pieces)

    def finish(self) -> list:
        """The held-back text once the answer has ended: a tag that never completed is text."""
        held, self.held = self.held, ""
        if self.state == "thinking":
            held = held.rstrip(WHITESPACE)
            return [Thought(held)] if held else []
        if self.state == "before" or not self.opening:
            return [held] if held else []
        held = held.lstrip(WHITESPACE)
        return [held] if held else []

    # each reads what it can of self.held and returns a piece or None

    def _before(self):
        text = self.held.lstrip(WHITESPACE)
        if text.startswith(START):
            self.held, self.state, self.opening = text[len(START) :], "thinking", True
        elif text and not START.startswith(text[: len(START)]):
            self.state, self.opening = "answer", False  # the whole text is the answer, as written
        return None

    def _thinking(self):
        if self.opening:  # the framing whitespace and a repeated <think>
            text = self.held.lstrip(WHITESPACE)
            if not text or (START.startswith(text) and text != START):
                return None
            if text.startswith(START):
                text = text[len(START) :].lstrip(WHITESPACE)
            self.held, self.opening = text, not text
            if not text:
                return None
        end = self.held.find(END)
        if end >= 0:
            piece, self.held = self.held[:end].rstrip(WHITESPACE), self.held[end + len(END) :]
            self.state, self.opening, self.thought = "answer", True, True
            return Thought(piece) if piece else None
        # keep a tail that may begin </think>, and the whitespace before it (it may frame the tag)
        keep = _tag_prefix(self.held, END)
        body = self.held[: len(self.held) - keep]
        certain = body.rstrip(WHITESPACE)
        if not certain:
            return None
        self.held = self.held[len(certain) :]
        self.thought = True
        return Thought(certain)

    def _answer(self):
        if self.opening:
            text = self.held.lstrip(WHITESPACE)
            self.held, self.opening = text, not text
            if not text:
                return None
        piece, self.held = self.held, ""
        return piece


def split_reasoning(text: str, format: str, starts_in: str | None = None) -> tuple[str | None, str]:
    """(the reasoning, or None when there was none; the answer) of a whole text."""
    parser = ReasoningParser(format, starts_in)
    pieces = parser.feed(text) + parser.finish()
    reasoning = "".join(p.text for p in pieces if isinstance(p, Thought))
    answer = "".join(p for p in pieces if isinstance(p, str))
    return (reasoning if parser.thought or reasoning else None), answer


def _tag_prefix(text: str, tag: str) -> int:
    """The length of the longest tail of text that is a proper prefix of tag."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def _merged(pieces: list) -> list:
    """Neighbouring pieces of one kind joined."""
    out: list = []
    for piece in pieces:
        if out and isinstance(piece, Thought) and isinstance(out[-1], Thought):
            out[-1] = Thought(out[-1].text + piece.text)
        elif out and isinstance(piece, str) and isinstance(out[-1], str):
            out[-1] += piece
        else:
            out.append(piece)
    return out
