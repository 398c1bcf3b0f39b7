"""An answer's parts out of a choice's text, whole or streamed: the reasoning (text.reasoning,
with --reasoning-parser), then, in the rest, the text and the tool calls (text.tool_calls, when
the request has tools). Every API reads its answers here and only shapes them: chat
completions' message and deltas (openai/bodies.py), Anthropic's content blocks, the Responses API's
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

from dataclasses import dataclass

from flashformer.serve.http.tools import ToolPlan
from flashformer.text.reasoning import ReasoningParser, Thought
from flashformer.text.tool_calls import ToolCall, parser_for


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
