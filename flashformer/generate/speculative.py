"""Speculative decoding: guess several tokens cheaply, then check them all in one forward.

    ids = model.generate(input_ids, max_new_tokens=200, prompt_lookup_num_tokens=10)  # n-gram lookup
    ids = model.generate(input_ids, max_new_tokens=200, assistant_model=draft)        # a draft model
    ids = model.generate(input_ids, max_new_tokens=200, prompt_lookup_num_tokens=10,
                         speculative_method=NAME)              # another row of proposers.PROPOSERS

Batch-1 decoding on a CPU reads every weight once per token. A forward over the last token and
k guesses (drafts) reads them once for k + 1 positions and costs little more than one step; each
position's logits then say what the model itself would choose there, so the drafts are kept up to
the first one it would not have chosen, and that position's own choice is emitted too: 1 to k + 1
tokens per forward (Leviathan et al., 2023; Chen et al., 2023).

The proposers are the rows of proposers.PROPOSERS, with transformers' argument names where it
has them:
- PromptLookup ("ngram": prompt_lookup_num_tokens, max_matching_ngram_size): the last n tokens
  (n from the largest size down to 1) found earlier in the prompt or the text so far; the tokens
  that followed that latest earlier occurrence are the drafts. Free, and right where the answer
  copies its input (edits of code, quotes, extraction).
- DraftModel ("draft_model": assistant_model, num_assistant_tokens): a smaller model with the
  same tokenizer decodes k tokens ahead with its own KV cache, rewound to what the target kept.
- any other row of the table, by its name (speculative_method).

Greedy: every emitted token is the argmax of the same scores a plain step computes at that
position (the chooser of sampling.py: constraint mask, processors, history), so the tokens are
plain greedy's wherever a row of the verify forward has the bits of the single-token step. On the
native decoder they do: each row's products, norms and attention are computed alone, the same
operations whatever the rows around it (the server's batch invariance; the tests compare logits
bit for bit). On the eager modules PyTorch's matmul may block a (k + 1)-row product otherwise than
a 1-row one, so logits can differ in the last bits; the tokens differ only on a near tie.

Sampling: the standard rejection rule. A draft d drawn from q is kept with probability
min(1, p(d) / q(d)), where p is the target's distribution after its processors; on rejection the
token is drawn from max(0, p - q), renormalized; when every draft is kept the next token is drawn
from p. The emitted tokens then follow the target's distribution exactly (a lookup draft is a point
mass: q(d) = 1). They are not the tokens plain sampling gives for the same seed: the draws differ.

How many drafts to check is chosen each round for the most tokens per second: with a the chance
that a draft is kept (counted over the recent rounds) and c what one more row costs a forward
relative to a one-row forward, k drafts give (1 - a^(k+1)) / (1 - a) tokens for 1 + c k of
cost. c is measured once per model and proposer (a few forwards at the first call, kept): on a CPU
a row costs a sizable part of a step (SmolLM2 Q4_1: about 0.2-0.3), so long drafts of doubtful
text cost more than they give, and text that does not copy drafts nothing (an occasional one-token
probe keeps the estimate of a current).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator

import torch
from torch import Tensor

from flashformer.generate.cache import cache_room
from flashformer.generate.draft_model import DraftModel
from flashformer.generate.proposers import ProposerInputs, proposer_kind
from flashformer.generate.sampling import (
    GenerationSettings,
    TokenChooser,
    TokenHistory,
    choose_tokens,
)

# ---- the loop ----


class Counters:
    """What a run drafted and kept, and its verify forwards (bench/speculative.py reports them)."""

    def __init__(self):
        self.forwards = self.drafted = self.accepted = 0


@torch.no_grad()
def speculative_tokens(
    session,
    s: GenerationSettings,
    history: TokenHistory | None,
    generator,
    logits_out: list | None = None,
    counters: Counters | None = None,
) -> Iterator[Tensor]:
    """Yield the next token (1,) at a time, as stream_tokens does, from verify forwards of the
    target `session` (a batch-1 DecoderSession) over the last token and the drafts."""
    if session.input_ids.shape[0] != 1:
        raise ValueError(
            f"speculative decoding runs one sequence at a time (as transformers' assisted generation); "
            f"got a batch of {session.input_ids.shape[0]} prompts"
        )
    counters = counters if counters is not None else Counters()
    device = session.input_ids.device
    chooser = TokenChooser(s, 1, device, history)
    context = session.input_ids[0].tolist()
    kind = proposer_kind(s)  # the table's row
    limit = getattr(s, kind.limit)
    inputs = ProposerInputs(
        session.input_ids,
        s,
        generator,
        s.max_new_tokens + limit,
        s.max_matching_ngram_size,
        1,
        s.assistant_model,
    )
    proposer = kind.make(inputs)
    rows = session.prefill()  # (1, V): one position to choose at, no drafts yet
    # timed after the prefill: the forwards write past what the cache holds (a chat's earlier turns)
    speed = DraftLength(limit, row_cost(session, proposer, limit))
    drafts: list[int] = []
    q: Tensor | None = None
    index = kept = match = 0
    base = None
    try:
        while True:
            # the cache holds base tokens, then this forward's: the last token and the drafts
            base = session.length - rows.shape[0]
            kept = 0
            for i in range(rows.shape[0]):
                logits = rows[i : i + 1]  # (1, V)
                if logits_out is not None:
                    logits_out.append(logits)
                scores = chooser.scores(logits, index)
                draft = drafts[i] if i < len(drafts) else None
                token = _verify(
                    scores, draft, None if q is None or draft is None else q[i], s.do_sample, generator
                )
                token = chooser.commit(torch.tensor([token], device=device), index)
                context.append(int(token[0]))
                index += 1
                if draft is not None and context[-1] == draft:
                    kept += 1  # its keys, in the cache, are the right ones
                yield token
                if chooser.all_ended or index == s.max_new_tokens or context[-1] != draft:
                    break
            # the keys of the rejected drafts are left behind, overwritten by the next forward
            session.rewind(base + 1 + kept)
            counters.accepted += kept
            if chooser.all_ended or index == s.max_new_tokens:
                return
            if drafts:
                speed.observe(len(drafts), kept, match)
            room = s.max_new_tokens - index - 1  # drafts beyond the last token to emit are wasted
            match = proposer.match(context)
            k = min(speed.next(match=match), room)
            drafts, q = proposer.draft(context, k) if k > 0 else ([], None)
            counters.forwards += 1
            counters.drafted += len(drafts)
            rows = session.extend(torch.tensor([[context[-1]] + drafts], device=device))[0]  # (1 + k, V)
    finally:  # also when the caller stops early: the cache then holds no unverified draft
        if base is not None:
            session.rewind(min(session.length, base + 1 + kept))


class DraftLength:
    """The number of drafts to check next (see the module docstring): the k in [0, limit] of the
    most expected tokens per unit of cost, from the acceptance counted over recent rounds
    (forgetting 10 % a round, starting from one kept and one lost) and the cost c of a row.

    Acceptance is counted apart for each match length (the proposer's match(): how much of the
    context's end agrees with where the drafts come from). One rate for all mixes drafts that copy
    a line being reproduced with drafts after a lone common token: SmolLM2 rewriting code kept
    most drafts after matches of 3 and few after matches of 1, and the mixed rate held every draft
    to one token. A length's rate starts from the rate over all of them (worth PRIOR rounds' counts
    of its own), so a short copying answer need not learn each length apart. With no match (0)
    nothing is drafted.

    In a server's step of B sequences a draft row lengthens everyone's step: with s = c / (1 - c)
    a row's cost over the forward's fixed part (the weights read once), a row costs s / (1 + B s)
    of the step, and k drafts pay when (B + expected extra tokens) / (1 + that k) beats B. At B = 1
    this is the rule above; at B = 16 and c = 0.25 a draft pays only where nearly all are kept."""

    PROBE_EVERY = 8  # rounds without drafts between one-draft probes
    PRIOR = 2.0  # drafts' worth of the overall rate in each match length's own

    def __init__(self, limit: int, cost: float):
        self.limit = limit
        self.per_row = cost / (1 - min(cost, 0.99))  # s
        self.kept_all, self.tried_all = 1.0, 2.0  # every round's drafts, recent ones weighed more
        self.kept: dict[int, float] = {}  # match length -> its rounds' drafts kept, and tried
        self.tried: dict[int, float] = {}
        self.idle: dict[int, int] = {}

    def observe(self, drafted: int, kept: int, match: int = 1) -> None:
        """A round checked `drafted` drafts, proposed after a match of `match`, and kept the first
        `kept`: kept + 1 were tried (one lost), or all of them kept."""
        tried = min(drafted, kept + 1)
        self.kept_all, self.tried_all = 0.9 * self.kept_all + kept, 0.9 * self.tried_all + tried
        self.kept[match] = 0.9 * self.kept.get(match, 0.0) + kept
        self.tried[match] = 0.9 * self.tried.get(match, 0.0) + tried

    def rate(self, match: int) -> float:
        """The chance a draft after a match of `match` is kept."""
        overall = self.kept_all / self.tried_all
        return (self.kept.get(match, 0.0) + self.PRIOR * overall) / (self.tried.get(match, 0.0) + self.PRIOR)

    def next(self, batch: int = 1, match: int = 1) -> int:
        """k for a forward of `batch` sequences (this one's drafts the only ones counted), after a
        match of `match` (0: nothing to draft from)."""
        if match <= 0:
            return 0
        a = self.rate(match)
        cost = self.per_row / (1 + batch * self.per_row)
        best, best_rate, tokens, chance = 0, float(batch), float(batch), 1.0
        for k in range(1, self.limit + 1):
            chance *= a
            tokens += chance
            rate = tokens / (1 + cost * k)
            if rate > best_rate:
                best, best_rate = k, rate
        if best == 0:
            self.idle[match] = self.idle.get(match, 0) + 1
            if self.idle[match] % self.PROBE_EVERY == 0:
                return 1
        return best


# model and proposer kind -> c, measured once
_ROW_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def row_cost(session, proposer, limit: int) -> float:
    """What a verify forward's extra row costs relative to a one-row forward (plus, with a draft
    model, its step relative to the target's), timed on `session` at the first call (the best of
    two forwards of 1 and of 1 + limit rows after what the cache holds, rewound) and kept for the
    model."""
    kind = type(proposer).__name__
    known = _ROW_COSTS.setdefault(session.model, {})
    if kind in known:
        return known[kind]
    rows = min(1 + limit, cache_room(session.caches) - session.length)
    if rows < 2:
        return 0.25  # no room to time: a typical CPU figure
    one = _forward_seconds(session, 1)
    many = _forward_seconds(session, rows)
    cost = max(0.0, (many - one) / ((rows - 1) * one))
    if isinstance(proposer, DraftModel):
        draft = proposer.session
        cost += _forward_seconds(draft, 1) / one if cache_room(draft.caches) > draft.length else 0.0
    known[kind] = cost
    return cost


def _forward_seconds(session, rows: int) -> float:
    start = session.length
    tokens = torch.zeros(1, rows, dtype=torch.long, device=session.input_ids.device)
    best = float("inf")
    for _ in range(2):
        began = time.perf_counter()
        session.extend(tokens)
        best = min(best, time.perf_counter() - began)
        session.rewind(start)
    return best


def _verify(scores: Tensor, draft: int | None, q: Tensor | None, do_sample: bool, generator) -> int:
    """The token at one verified position: greedy's choice, or with sampling the rejection rule
    against the draft (kept with probability min(1, p(d) / q(d)), else a draw from the residual)."""
    if not do_sample or draft is None:
        return int(choose_tokens(scores, do_sample, generator)[0])
    p = scores.softmax(dim=-1)[0]  # (V,)
    q_d = 1.0 if q is None else float(q[draft])
    if float(torch.rand((), generator=generator)) * q_d < float(p[draft]):
        return draft
    residual = (
        (p - q).clamp(min=0)
        if q is not None
        else p.index_fill(0, torch.tensor([draft], device=p.device), 0.0)
    )
    total = float(residual.sum())
    if total <= 0:  # p == q (no mass left): p itself
        residual = p
    return int(torch.multinomial(residual, 1, generator=generator)[0])
