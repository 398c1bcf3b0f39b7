"""Prompt lookup (transformers' prompt_lookup_num_tokens, vLLM's method "ngram"): drafts from the
context itself, the tokens that followed the latest earlier occurrence of its last n tokens. Free,
and right where the answer copies its input (edits of code, quotes, extraction); a row of
proposers.PROPOSERS.
"""

from __future__ import annotations


class PromptLookup:
    """Drafts from the context itself: the tokens that followed the latest earlier occurrence of
    its last n tokens, for the largest n in [min_ngram, max_ngram] that occurs. Each n-gram's latest
    continuation is kept in a dict, updated as tokens arrive: a lookup costs O(max_ngram)."""

    def __init__(self, context: list[int], max_ngram: int, min_ngram: int = 1):
        self.context: list[int] = []
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.after: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]  # [n] gram -> start
        self.extend(context)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            at = len(self.context)  # token's position: it continues the n-grams ending before it
            for n in range(1, min(self.max_ngram, at) + 1):
                self.after[n][tuple(self.context[at - n : at])] = at
            self.context.append(token)

    LONGEST_MATCH = 8  # match() counts matching tokens back to this many

    def match(self, context: list[int]) -> int:
        """How long a run of tokens ending the context (which continues the one seen so far) also
        ends at the place the drafts would come from: 0 when its last min_ngram tokens occur
        nowhere earlier, else the n-gram found, lengthened backwards while the tokens before both
        agree, up to LONGEST_MATCH. A longer match copies more surely (DraftLength counts each
        length's kept drafts apart): at the end of a line of copied code it is long, after a
        common word it is 1."""
        self.extend(context[len(self.context) :])
        context = self.context
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            start = self.after[n].get(tuple(context[-n:]))
            if start is not None:
                length = n
                while (
                    length < self.LONGEST_MATCH
                    and start - length - 1 >= 0
                    and context[start - length - 1] == context[-length - 1]
                ):
                    length += 1
                return length
        return 0

    def propose(self, k: int) -> list[int]:
        """Up to k drafts after the context as extended so far."""
        context = self.context
        for n in range(min(self.max_ngram, len(context)), self.min_ngram - 1, -1):
            start = self.after[n].get(tuple(context[-n:]))
            if start is not None:
                return context[start : start + k]
        return []

    def draft(self, context: list[int], k: int) -> tuple[list[int], None]:
        """The proposers' common call: up to k drafts after `context` (which continues the one seen
        so far), and no distribution (a lookup's draft is a point mass)."""
        self.extend(context[len(self.context) :])
        return self.propose(k), None
