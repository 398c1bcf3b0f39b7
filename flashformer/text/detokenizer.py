"""Tokens to text as they come: the one incremental detokenizer of `generate`, `chat` and the
server.

    detokenizer = Detokenizer(tokenizer, stop=("\\n\\n",))
    for token in tokens:
        print(detokenizer.add(token), end="")      # the text that is certain so far
        if detokenizer.stopped:
            break
    print(detokenizer.finish())                   # what was held back

Two things make the text of a token uncertain when it arrives:
- a token can end in the middle of a character's UTF-8 bytes (byte-level vocabularies split
  emoji and CJK that way, SentencePiece's byte fallback too): the incomplete bytes decode to
  U+FFFD, so they are held back until a later token completes the character (the complete
  characters before them are certain);
- the end of the text may be the start of a stop string, which the next token may complete:
  that tail is held back too, and a stop string, once it appears, ends the text before it.

Decoding the whole sequence again for every token costs O(n) per token. As vLLM does, only a
window is decoded: the tokens of the last piece handed out (their context) and the new ones;
the new text is what the new tokens add to the window's start. The pieces join to
tokenizer.decode(every token) (cut at the first stop string).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

REPLACEMENT = "\ufffd"  # what a decoder gives for incomplete UTF-8 bytes


class Detokenizer:
    """The text of one sequence's new tokens; see the module docstring.

    stop: strings that end the text (never part of it). After `stopped` turns True, add() must
    not be called again; finish() gives the text up to the stop string, and stop_string says
    which one it was (what Anthropic's API returns as stop_sequence).
    """

    def __init__(self, tokenizer, stop: Iterable[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""  # the certain text so far (complete characters, cut at a stop string)
        self.sent = 0  # characters of text handed out
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended the text
        self._context = 0  # ids[_context:_read]: the tokens of the last certain piece
        self._read = 0  # ids[_read:]: tokens whose text is not certain yet
        self._partial = 0  # characters of their text already taken (before an incomplete one)

    def add(self, token: int) -> str:
        """Take one more token; the text that became certain (possibly "")."""
        if self.stopped:
            raise ValueError("the text already ended at a stop string: add() takes no more tokens")
        self.ids.append(int(token))
        new = self._window_text()
        if new.endswith(REPLACEMENT):  # a character still incomplete: what precedes it is certain
            certain = new.rstrip(REPLACEMENT)
            self.text += certain[self._partial :]
            self._partial = max(self._partial, len(certain))
        else:
            self.text += new[self._partial :]
            self._context, self._read, self._partial = self._read, len(self.ids), 0
        self._cut_at_stop()
        return self._take(len(self.text) - (0 if self.stopped else _stop_prefix(self.text, self.stop)))

    def finish(self) -> str:
        """The rest, once the sequence has ended: the held-back tail and the text of tokens
        still incomplete (decoded as they are, U+FFFD included), up to a stop string."""
        if not self.stopped and self._read < len(self.ids):
            self.text += self._window_text()[self._partial :]
            self._context = self._read = len(self.ids)
            self._partial = 0
            self._cut_at_stop()
        return self._take(len(self.text))

    def _window_text(self) -> str:
        """What the tokens after the last certain piece add to the text: the window decoded with
        its context, less the context's own text."""
        known = self.tokenizer.decode(self.ids[self._context : self._read])
        return self.tokenizer.decode(self.ids[self._context :])[len(known) :]

    def _cut_at_stop(self) -> None:
        found = [(at, s) for at, s in ((self.text.find(s), s) for s in self.stop) if at >= 0]
        if found:
            at, self.stop_string = min(found)
            self.text, self.stopped = self.text[:at], True

    def _take(self, end: int) -> str:
        piece = self.text[self.sent : end] if end > self.sent else ""
        self.sent += len(piece)
        return piece


def _stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest tail of `text` that is the start of a stop string (the next
    token may complete it), 0 if none."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def stream_text(tokenizer, tokens: Iterable[int]) -> Iterator[str]:
    """The text of a stream of new tokens, piece by piece, as it becomes certain; the pieces
    join to tokenizer.decode(all tokens)."""
    detokenizer = Detokenizer(tokenizer)
    for token in tokens:
        if piece := detokenizer.add(token):
            yield piece
    if rest := detokenizer.finish():
        yield rest
