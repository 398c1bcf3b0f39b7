"""An answer's parts out of a choice's text, whole or streamed: the reasoning (text.reasoning,
with --reasoning-parser), then, in the rest, the text and the tool calls (text.tool_calls, when
the request has tools). Every API reads its answers here and only shapes them: chat
completions' message and deltas (below), Anthropic's content blocks, the Responses API's
output items.

    reader = AnswerReader(plan)
    for delta in deltas:
        for piece in reader.feed(delta):   # Thought, str (the answer's text) or CallDelta
            ...
    pieces = reader.finish()

Tool calls are read in the answer only: a model that thinks about a call in its reasoning has
not made it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from flashformer.serve.openai.tools import ToolPlan
from flashformer.text.reasoning import ReasoningParser, Thought
from flashformer.text.tool_calls import CallDelta, ToolCall, parser_for


@dataclass(frozen=True)
class AnswerPlan:
    """How one request's answers are read: tools (None: no call is read), reasoning (the
    --reasoning-parser format, None: no reasoning is split off) and where its text starts
    (text.reasoning's states, read off the prompt's end)."""

    tools: ToolPlan | None = None
    reasoning: str | None = None
    starts_in: str = "answer"


@dataclass
class Answer:
    """A whole answer: its reasoning (None: none was split off), text and calls."""

    reasoning: str | None
    text: str
    calls: list[ToolCall]


class AnswerReader:
    """One choice's text in pieces: Thought (reasoning), str (the answer's text) and CallDelta
    (a piece of a tool call), in the order they were written."""

    def __init__(self, plan: AnswerPlan):
        self.thinking = ReasoningParser(plan.reasoning, plan.starts_in) if plan.reasoning else None
        self.calls = parser_for(plan.tools.format) if plan.tools is not None else None

    def feed(self, text: str) -> list:
        pieces = self.thinking.feed(text) if self.thinking is not None else [text]
        return self._answer_pieces(pieces)

    def finish(self) -> list:
        pieces = self._answer_pieces(self.thinking.finish()) if self.thinking is not None else []
        if self.calls is not None:
            pieces += self.calls.finish()
        return pieces

    @property
    def called(self) -> list[ToolCall]:
        return self.calls.calls if self.calls is not None else []

    def _answer_pieces(self, pieces: list) -> list:
        if self.calls is None:
            return [p for p in pieces if not isinstance(p, str) or p]
        out = []
        for piece in pieces:
            out += self.calls.feed(piece) if isinstance(piece, str) else [piece]
        return out


def read_answer(text: str, plan: AnswerPlan) -> Answer:
    """A whole text's Answer (what the streamed pieces join to)."""
    reader = AnswerReader(plan)
    pieces = reader.feed(text) + reader.finish()
    thoughts = [p.text for p in pieces if isinstance(p, Thought)]
    thought = reader.thinking is not None and reader.thinking.thought
    reasoning = "".join(thoughts) if thoughts or thought else None
    return Answer(reasoning, "".join(p for p in pieces if isinstance(p, str)), reader.called)


# ---- chat completions' shapes ----


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def message_of(text: str, plan: AnswerPlan, finish_reason: str | None) -> tuple[dict, str | None]:
    """A whole answer's chat message (reasoning_content with a reasoning parser, tool_calls
    read from the text) and its finish reason ("tool_calls" where an answer that ended by
    itself made calls)."""
    answer = read_answer(text, plan)
    message: dict = {"role": "assistant", "content": answer.text}
    if plan.reasoning is not None:
        message["reasoning_content"] = answer.reasoning
    if not answer.calls:
        return message, finish_reason
    message["content"] = answer.text or None
    message["tool_calls"] = [
        {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in answer.calls
    ]
    return message, ("tool_calls" if finish_reason == "stop" else finish_reason)


class ChatDeltas:
    """One choice's streamed deltas in chat completions' shapes: {"reasoning_content": ...},
    {"content": ...}, or {"tool_calls": [{"index", "id", "type", "function": {"name",
    "arguments"}}]} for a call's first piece and {"tool_calls": [{"index", "function":
    {"arguments"}}]} for the next ones."""

    def __init__(self, plan: AnswerPlan):
        self.reader = AnswerReader(plan)
        self.ids: list[str] = []

    def feed(self, text: str) -> list[dict]:
        return [self._delta(piece) for piece in self.reader.feed(text)]

    def finish(self) -> list[dict]:
        return [self._delta(piece) for piece in self.reader.finish()]

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.reader.called and reason == "stop" else reason

    def _delta(self, piece) -> dict:
        if isinstance(piece, Thought):
            return {"reasoning_content": piece.text}
        if isinstance(piece, str):
            return {"content": piece}
        return {"tool_calls": [self._call_delta(piece)]}

    def _call_delta(self, piece: CallDelta) -> dict:
        if piece.name is None:
            return {"index": piece.index, "function": {"arguments": piece.arguments}}
        self.ids.append(call_id())
        function = {"name": piece.name, "arguments": piece.arguments}
        return {"index": piece.index, "id": self.ids[-1], "type": "function", "function": function}
