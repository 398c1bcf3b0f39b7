"""Replay a model's greedy answers to bench generate's speculative workloads under draft-length rules,
with a cost model instead of a clock: how far prompt lookup could go on each answer, and how close a
rule comes (docs/benchmarks.md, "Speculative decoding").

    python scripts/speculative_replay.py MODEL.gguf [--costs 0.1,0.15,0.25]

Each workload's plain greedy answer (128 tokens) is computed once. A round feeds the last token and
k drafts and costs 1 + c * k one-row forwards (c: what a row adds, as DraftLength measures it);
it emits the drafts kept and one more token. "perfect" drafts exactly the lookup's tokens that will
be kept (no row wasted): no causal rule can beat it with this proposer. The ratio is the tokens
emitted after the first over the cost (plain decoding: one forward a token), the speedup a rule
would have if rows cost exactly c and nothing else did. First, per answer, how often its next
token is among the first 1, 2 or 3 distinct continuations of its longest match (what a tree of
drafts, several candidates checked in one forward, could add); last, trees of drafts from those
continuations: the bound for 1-8 branches (a tree that drafted only what it keeps) and a few fixed
trees.
"""

from __future__ import annotations

import argparse

import torch

import flashformer
from flashformer.bench.speculative import WORKLOADS, prompt_text
from flashformer.generate import speculative
from flashformer.generate.prompt_lookup import PromptLookup
from flashformer.generate.sampling import GenerationSettings


def replay(prompt: list[int], answer: list[int], cost: float, rule) -> float:
    """rule(lookup, context, room) -> drafts, and afterwards rule.observe(drafted, kept); or None:
    the perfect draft length."""
    lookup = PromptLookup(prompt, GenerationSettings.max_matching_ngram_size)
    speed = speculative.DraftLength(10, cost)
    at, spent = 0, 0.0  # answer[at] is the newest token; answer[0] came from the prompt's forward
    while at < len(answer) - 1:
        context = prompt + answer[: at + 1]
        room = len(answer) - 2 - at
        if rule == "perfect":
            drafts = lookup.draft(context, room)[0]
        else:
            match = lookup.match(context) if rule == "per match" else min(1, lookup.match(context))
            k = min(speed.next(match=match), room)
            drafts = lookup.draft(context, k)[0] if k > 0 else []
        kept = agreeing(drafts, answer, at)
        if rule == "perfect":
            drafts = drafts[:kept]
        elif drafts:
            speed.observe(len(drafts), kept, match)
        spent += 1 + cost * len(drafts)
        at += kept + 1
    return (len(answer) - 1) / spent


def agreeing(drafts: list[int], answer: list[int], at: int) -> int:
    """How many drafts, from the first, are the answer's tokens after answer[at] (a verify keeps)."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == answer[at + 1 + kept]:
        kept += 1
    return kept


def continuation_starts(context: list[int], max_ngram: int, count: int) -> list[int]:
    """Where the first continuations of the context's last n tokens start, the longest n first and
    the latest occurrence first, up to `count` with distinct first tokens: what a tree of drafts
    could offer for the next token where a lookup offers one."""
    found: list[int] = []
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == tail and context[start + n] not in [context[f] for f in found]:
                found.append(start + n)
                if len(found) == count:
                    return found
    return found


def continuations(context: list[int], max_ngram: int, count: int) -> list[int]:
    """The first tokens of continuation_starts' continuations."""
    return [context[start] for start in continuation_starts(context, max_ngram, count)]


def replay_tree(prompt: list[int], answer: list[int], cost: float, depths: list[int], oracle: bool) -> float:
    """A tree of drafts: each round checks len(depths) branches, the i-th the copy of depths[i]
    tokens after the i-th continuation (continuation_starts), and keeps the longest that agrees.
    It costs 1 + c x (every branch's drafts), or with oracle 1 + c x (the kept ones): a tree rule
    that wasted no row, a bound for any tree over these branches."""
    at, spent = 0, 0.0
    while at < len(answer) - 1:
        context = prompt + answer[: at + 1]
        room = len(answer) - 2 - at
        best, drafted = 0, 0
        starts = continuation_starts(context, GenerationSettings.max_matching_ngram_size, len(depths))
        for start, depth in zip(starts, depths):
            source = context[start:]
            branch: list[int] = []
            while len(branch) < min(depth, room):  # a copy that reaches the end runs into itself
                i = len(branch)
                branch.append(source[i] if i < len(source) else branch[i - len(source)])
            kept = agreeing(branch, answer, at)
            best, drafted = max(best, kept), drafted + len(branch)
        spent += 1 + cost * (best if oracle else drafted)
        at += best + 1
    return (len(answer) - 1) / spent


def candidate_hits(prompt: list[int], answer: list[int], counts=(1, 2, 3)) -> dict[int, float]:
    """Over the answer's positions with any match: how often its next token is among the first k
    continuations, for each k in counts."""
    hits, positions = dict.fromkeys(counts, 0), 0
    for at in range(len(answer) - 1):
        found = continuations(
            prompt + answer[: at + 1], GenerationSettings.max_matching_ngram_size, max(counts)
        )
        if found:
            positions += 1
            for k in counts:
                hits[k] += answer[at + 1] in found[:k]
    return {k: hits[k] / max(positions, 1) for k in counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--costs", default="0.1,0.15,0.25")
    args = parser.parse_args()
    model, tokenizer = flashformer.load(args.model, quantize="gguf")
    answers = {}
    for name, (_, message, base) in WORKLOADS.items():
        prompt = tokenizer.encode(prompt_text(tokenizer, message, base))
        out = model.generate(torch.tensor([prompt]), max_new_tokens=128, do_sample=False, eos_token_id=[])
        answers[name] = (prompt, out[0, len(prompt) :].tolist())
    for name, (p, a) in answers.items():
        hits = candidate_hits(p, a)
        print(
            f"{name}: next token among the first k continuations "
            + ", ".join(f"k={k} {h:.2f}" for k, h in hits.items())
        )
    for cost in (float(c) for c in args.costs.split(",")):
        for rule in ("perfect", "one rate", "per match"):
            ratios = {name: replay(p, a, cost, rule) for name, (p, a) in answers.items()}
            print(f"c={cost:<5} {rule:10s} " + "  ".join(f"{n} {r:.2f}x" for n, r in ratios.items()))
        for depths, oracle in TREES:
            ratios = {name: replay_tree(p, a, cost, depths, oracle) for name, (p, a) in answers.items()}
            label = f"tree {'perfect ' if oracle else ''}{depths}"
            print(f"c={cost:<5} {label:10s} " + "  ".join(f"{n} {r:.2f}x" for n, r in ratios.items()))


# (each branch's depth, perfect): bounds for trees of 1-8 branches, then fixed trees a rule might use
TREES = (
    ([10], True),
    ([10] * 2, True),
    ([10] * 3, True),
    ([10] * 8, True),
    ([2], False),
    ([4, 2], False),
    ([6, 2], False),
    ([4, 2, 1], False),
)


if __name__ == "__main__":
    main()
