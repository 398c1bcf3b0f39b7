"""text.reasoning: the <think> family's split of reasoning and answer, whole and fed in pieces.
The expected parts are written out by hand for each case; every case is also fed one
character at a time and in every two-piece cut, and must give the same parts."""

from __future__ import annotations

import pytest

from flashformer.text.reasoning import ReasoningParser, Thought, reasoning_start, split_reasoning

# (format, where the text starts, the text, the reasoning (None: none), the answer)
CASES = [
    ("qwen3", "before", "<think>\nLet me add.\n</think>\n\n4", "Let me add.", "4"),
    ("qwen3", "before", "  <think>a < b</think>yes", "a < b", "yes"),
    ("qwen3", "before", "Just the answer.", None, "Just the answer."),
    ("qwen3", "before", "<thin", None, "<thin"),  # a tag that never completed is text
    ("qwen3", "before", "<think>cut short by max_tokens", "cut short by max_tokens", ""),
    ("qwen3", "thinking", "plan </thi nope</think>done", "plan </thi nope", "done"),
    ("qwen3", "answer", "<think>is text here</think>", None, "<think>is text here</think>"),
    ("deepseek-r1", "thinking", "no opening tag\n</think>\n\nanswer", "no opening tag", "answer"),
    ("deepseek-r1", "thinking", "<think>\nwith it</think>answer", "with it", "answer"),
    ("deepseek-r1", "thinking", "never closed", "never closed", ""),
    ("deepseek-r1", "thinking", "</think>\n\nempty reasoning", "", "empty reasoning"),
    ("qwen3", "before", "<think>a\n\nb  </think>  x\n\ny", "a\n\nb", "x\n\ny"),
]


def pieces_joined(pieces) -> tuple[str, str]:
    return (
        "".join(p.text for p in pieces if isinstance(p, Thought)),
        "".join(p for p in pieces if isinstance(p, str)),
    )


@pytest.mark.parametrize("fmt, start, text, reasoning, answer", CASES)
def test_whole_text_splits_as_written(fmt, start, text, reasoning, answer):
    assert split_reasoning(text, fmt, start) == (reasoning, answer)


@pytest.mark.parametrize("fmt, start, text, reasoning, answer", CASES)
def test_every_cut_gives_the_same_parts(fmt, start, text, reasoning, answer):
    cuts = [[text[i : i + 1] for i in range(len(text))]]
    cuts += [[text[:i], text[i:]] for i in range(1, len(text))]
    for deltas in cuts:
        parser = ReasoningParser(fmt, start)
        pieces = [piece for delta in deltas for piece in parser.feed(delta)] + parser.finish()
        assert pieces_joined(pieces) == (reasoning or "", answer), deltas


def test_a_thought_is_sent_before_its_end_tag_arrives():
    """Streaming: reasoning goes out as it comes, holding back only what may start </think>."""
    parser = ReasoningParser("qwen3", "before")
    assert parser.feed("<think>one two") == [Thought("one two")]
    assert parser.feed(" three </th") == [Thought(" three")]
    assert parser.feed("ink>\n\nok") == ["ok"]


@pytest.mark.parametrize(
    "fmt, tail, state",
    [
        ("qwen3", "<|im_start|>assistant\n", "before"),
        ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "answer"),
        ("qwen3", "<|im_start|>assistant\n<think>\n", "thinking"),
        ("deepseek-r1", "<｜Assistant｜>", "thinking"),
        ("deepseek-r1", "<｜Assistant｜><think>\n", "thinking"),
        ("deepseek-r1", "<think>\n\n</think>\n\n", "answer"),
    ],
)
def test_the_prompts_end_says_where_the_text_starts(fmt, tail, state):
    assert reasoning_start(fmt, tail) == state


def test_an_unknown_format_is_refused_by_name():
    with pytest.raises(ValueError, match="'granite'.*deepseek-r1.*qwen3"):
        ReasoningParser("granite")
