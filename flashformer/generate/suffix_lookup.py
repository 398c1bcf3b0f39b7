"""Longest-match lookup (vLLM's method "suffix"): drafts what followed the longest run of tokens
ending the context that also occurred earlier in it, the prompt and the answer so far.

Prompt lookup (prompt_lookup.py) matches at most max_ngram tokens (4) and takes the latest earlier
occurrence of that n-gram, which in a text that repeats short phrases is often the wrong place to
copy from; here the match runs back as far as the two places agree (up to max_match tokens), so a
line being copied is continued from the line it copies. Exact for greedy as every proposer is:
the drafts only decide which rows a verify forward checks, never which token is chosen.
"""

from __future__ import annotations


class SuffixLookup:
    """Drafts after the longest suffix of the context found earlier in it (at least min_match
    tokens, counted up to max_match; among equally long ones the latest). Each token's earlier
    positions are indexed as tokens arrive; a lookup tries each earlier position of the last
    token, first checking the one token that could make it longer than the best so far."""

    LONGEST_MATCH = 8  # match() reports lengths up to this many (DraftLength's classes)

    def __init__(self, context: list[int], max_match: int = 64, min_match: int = 1):
        self.context: list[int] = []
        self.max_match, self.min_match = max_match, min_match
        self.positions: dict[int, list[int]] = {}  # token -> where it occurred, in order
        self.found: tuple[int, int, int] = (-1, 0, -1)  # (context length, match length, its end)
        self.extend(context)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.positions.setdefault(token, []).append(len(self.context))
            self.context.append(token)

    def longest(self, context: list[int]) -> tuple[int, int]:
        """(length, end): the longest suffix of `context` (which continues the one seen so far)
        that ends earlier at position `end` too; (0, -1) when none of min_match tokens does."""
        self.extend(context[len(self.context) :])
        context, last = self.context, len(self.context) - 1
        if self.found[0] == len(context):
            return self.found[1], self.found[2]
        best, best_end = 0, -1
        for end in reversed(self.positions[context[last]][:-1]):  # the latest first: ties keep it
            if end < best or (best and context[end - best] != context[last - best]):
                continue  # too early to be longer, or differs where it would have to agree
            length = 1
            while (
                length < self.max_match and length <= end and context[end - length] == context[last - length]
            ):
                length += 1
            if length > best:
                best, best_end = length, end
                if best == self.max_match:
                    break
        if best < self.min_match:
            best, best_end = 0, -1
        self.found = (len(context), best, best_end)
        return best, best_end

    def match(self, context: list[int]) -> int:
        """How long the matched run is, up to LONGEST_MATCH (0: nothing to draft from)."""
        return min(self.longest(context)[0], self.LONGEST_MATCH)

    def draft(self, context: list[int], k: int) -> tuple[list[int], None]:
        """Up to k drafts: what followed the match's earlier end, and no distribution (a point mass)."""
        length, end = self.longest(context)
        return (self.context[end + 1 : end + 1 + k] if length else []), None
