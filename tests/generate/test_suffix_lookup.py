"""generate/suffix_lookup.py, the longest-match proposer: its drafts on hand-made token sequences,
checked against a brute-force search written here (every earlier end position, every length);
greedy tokens with it are plain greedy's (tests/generate/test_proposers.py)."""

from __future__ import annotations

import random

from flashformer.generate.prompt_lookup import PromptLookup
from flashformer.generate.suffix_lookup import SuffixLookup


def brute_force(context: list[int], max_match: int) -> tuple[int, int]:
    """(length, end) of the longest suffix that also ends at an earlier position, the latest
    among equally long ones; (0, -1) when the last token occurred nowhere before."""
    best, best_end = 0, -1
    last = len(context) - 1
    for end in range(last):
        length = 0
        while length < max_match and length <= end and context[end - length] == context[last - length]:
            length += 1
        if length and length >= best:  # ties: the later end wins
            best, best_end = length, end
    return best, best_end


def test_it_drafts_after_the_longest_match_where_prompt_lookup_takes_the_latest_ngram():
    line = [10, 11, 12, 13, 14, 15, 16]
    # the line, then a later place where its last 4 tokens recur with something else after them
    context = line + [1, 2] + [13, 14, 15, 16, 99, 98] + [3] + line[:6]  # copying the line again
    # suffix: 10 11 12 13 14 15 (6 tokens) matches the first line: 16 follows; then 1 2
    assert SuffixLookup(context).draft(context, 3)[0] == [16, 1, 2]
    assert SuffixLookup(context).match(context) == 6
    # prompt lookup matches the last 4 tokens (12 13 14 15 occurs only in the line: the same here)
    assert PromptLookup(context, max_ngram=4).draft(context, 3)[0] == [16, 1, 2]
    copy = context + [16]  # now the suffix ... 13 14 15 16 occurs twice: the line is longer
    assert SuffixLookup(copy).draft(copy, 2)[0] == [1, 2]
    assert PromptLookup(copy, max_ngram=4).draft(copy, 2)[0] == [99, 98]  # the latest 4-gram


def test_nothing_to_draft_and_the_latest_of_equal_matches():
    assert SuffixLookup([1, 2, 3]).draft([1, 2, 3], 4) == ([], None)
    assert SuffixLookup([1, 2, 3]).match([1, 2, 3]) == 0
    assert SuffixLookup([5, 7, 5, 8, 5]).draft([5, 7, 5, 8, 5], 2)[0] == [8, 5]  # (5,) at 2, not 0
    assert SuffixLookup([4, 4, 4]).draft([4, 4, 4], 5)[0] == [4]  # (4, 4) ends at 1
    lookup = SuffixLookup([1, 2, 3, 1, 2], min_match=3)
    assert lookup.draft([1, 2, 3, 1, 2], 2)[0] == []  # a match of 2 is too short


def test_it_follows_a_growing_context_as_a_search_of_every_position_does():
    rng = random.Random(0)
    for max_match in (3, 64):
        context = [rng.randrange(6) for _ in range(10)]
        lookup = SuffixLookup(context[:4], max_match=max_match)
        for _ in range(300):
            context.append(rng.randrange(6) if rng.random() < 0.5 else context[rng.randrange(len(context))])
            length, end = brute_force(context, max_match)
            assert lookup.longest(context) == (length, end), context
            drafts = lookup.draft(context, 5)[0]
            assert drafts == (context[end + 1 : end + 6] if length else [])
            assert lookup.match(context) == min(length, SuffixLookup.LONGEST_MATCH)
