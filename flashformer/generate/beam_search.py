"""Beam search with transformers' scoring and stopping rules, over a KV cache.

Every prompt keeps num_beams running hypotheses and the num_beams best
finished ones. A step:

1. scores every continuation of every running beam: the beam's summed
   log-probability plus the token's (after the logits processors);
2. keeps the best 2 * num_beams of them per prompt (more with several eos
   ids), so that num_beams remain alive even if the best ones all end;
3. continues the best num_beams that did not end (eos, or max length);
4. offers those that ended, if among the best num_beams, to the finished
   list with score sum_logprob / generated_length ** length_penalty;
5. reorders the KV cache rows to follow the surviving beams.

A prompt is done when its finished list is full and (early_stopping=True)
or no running beam can still beat it: with early_stopping=False the best
running score is judged at the current length, with "never" at the length
that favours it most. These are transformers' rules, so the same model
gives the same beams. Scores that must never win get -1e9 added, the
constant transformers uses (float32 rounding of such sums then agrees too).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import Tensor

from flashformer.generate.constraints import constrain, keep_an_end, matchers_for
from flashformer.generate.sampling import GenerationSettings, LogitsProcessor, TokenHistory

IMPOSSIBLE = -1.0e9


def beam_search(
    session,
    s: GenerationSettings,
    prompt: Tensor,
    real: Tensor | None,
    generator: torch.Generator | None,
    logits_out: list | None,
) -> Tensor:
    """prompt (B, P): the tokens the decoder starts from -> the best hypothesis per prompt (B, P + n),
    shorter ones filled with pad_token_id."""
    batch, prompt_len = prompt.shape
    beams, vocab, device = s.num_beams, session.model.config.vocab_size, prompt.device
    max_length = prompt_len + s.max_new_tokens
    eos = torch.tensor(s.eos_token_id, dtype=torch.long, device=device)
    n_candidates = max(2, 1 + len(eos)) * beams
    among_best = torch.arange(n_candidates, device=device) < beams  # (C,): may join the finished list
    fill = s.pad_token_id if s.pad_token_id is not None else 0
    process = LogitsProcessor(s, device, min_keep=max(2, 1 + len(eos)))

    running = torch.full((batch, beams, max_length), fill, dtype=torch.long, device=device)
    running[:, :, :prompt_len] = prompt[:, None]
    running_scores = torch.zeros(batch, beams, device=device)
    running_scores[:, 1:] = IMPOSSIBLE  # the beams start identical: expand only the first
    finished = running.clone()
    finished_scores = torch.full((batch, beams), IMPOSSIBLE, device=device)
    finished_done = torch.zeros(batch, beams, dtype=torch.bool, device=device)
    finished_lengths = torch.zeros(batch, beams, dtype=torch.long, device=device)  # new tokens of each
    may_improve = torch.ones(batch, 1, dtype=torch.bool, device=device)
    history = TokenHistory.for_settings(s, prompt, real, vocab)
    if history is not None:
        history.expand(beams)
    matchers = matchers_for(s.constraint, batch)  # per prompt, then one per beam
    if matchers is not None:
        matchers = [m if m is None else m.copy() for m in matchers for _ in range(beams)]

    logits = session.prefill().repeat_interleave(beams, dim=0)  # (B*K, V): one prefill per prompt
    session.expand(beams)
    length = prompt_len
    while True:
        if logits_out is not None:
            logits_out.append(logits)
        log_probs = torch.log_softmax(logits, dim=-1)  # (B*K, V)
        if matchers is None:
            log_probs = process(log_probs, history, length - prompt_len)
        else:  # each beam's grammar mask, then the processors (transformers' order)
            masked = constrain(log_probs, matchers, eos)
            log_probs = process(masked, history, length - prompt_len)
            if length - prompt_len < s.min_new_tokens:
                log_probs = keep_an_end(log_probs, masked)
        totals = (log_probs.view(batch, beams, vocab) + running_scores[:, :, None]).view(batch, -1)

        # 2. the best continuations over all beams of a prompt
        if s.do_sample:
            picked = torch.multinomial(totals.softmax(dim=-1), n_candidates, generator=generator)
            scores, order = totals.gather(1, picked).sort(dim=-1, descending=True)
            picked = picked.gather(1, order)
        else:
            scores, picked = torch.topk(totals, n_candidates)  # (B, C)
        parent, token = picked // vocab, picked % vocab  # (B, C)
        candidates = torch.take_along_dim(running, parent[:, :, None], dim=1)  # (B, C, max_length)
        candidates[:, :, length] = token
        ended = torch.isin(token, eos) | (length + 1 >= max_length)  # (B, C)

        # 3. the running beams: the best that did not end
        alive_scores = scores + ended.float() * IMPOSSIBLE
        keep = torch.topk(alive_scores, beams).indices  # (B, K)
        running = torch.take_along_dim(candidates, keep[:, :, None], dim=1)
        running_scores = alive_scores.gather(1, keep)
        running_parent = parent.gather(1, keep)

        # 4. the finished list: the best num_beams of the old list and what just ended
        just_ended = ended & among_best
        final_scores = scores / ((length + 1 - prompt_len) ** s.length_penalty)
        final_scores = (
            final_scores
            + (finished_done.all(dim=1, keepdim=True) & (s.early_stopping is True)).float() * IMPOSSIBLE
        )
        final_scores = final_scores + (~may_improve).float() * IMPOSSIBLE
        final_scores = final_scores + (~just_ended).float() * IMPOSSIBLE
        merged_scores = torch.cat((finished_scores, final_scores), dim=1)  # (B, K + C)
        best = torch.topk(merged_scores, beams).indices  # (B, K)
        finished = torch.take_along_dim(torch.cat((finished, candidates), dim=1), best[:, :, None], dim=1)
        finished_scores = merged_scores.gather(1, best)
        finished_done = torch.cat((finished_done, just_ended), dim=1).gather(1, best)
        new_lengths = torch.full_like(token, length + 1 - prompt_len)
        finished_lengths = torch.cat((finished_lengths, new_lengths), dim=1).gather(1, best)

        length += 1
        may_improve = _may_improve(
            may_improve, running_scores, finished_scores, finished_done, length, max_length, prompt_len, s
        )
        all_full = bool(finished_done.all()) and s.early_stopping is True
        if not bool(may_improve.any()) or all_full or bool(ended.all()):
            break

        # 5. the cache follows the beams
        rows = (torch.arange(batch, device=device)[:, None] * beams + running_parent).view(-1)  # (B*K,)
        session.reorder(rows)
        new_tokens = running[:, :, length - 1].reshape(-1)  # (B*K,)
        if history is not None:
            history.reorder(rows)
            history.add(new_tokens)
        if matchers is not None:
            matchers = _follow(matchers, rows.tolist(), new_tokens.tolist())
        logits = session.step(new_tokens)

    out_length = prompt_len + int(finished_lengths[:, 0].max())
    return finished[:, 0, :out_length]


def _follow(matchers: list, rows: list[int], tokens: list[int]) -> list:
    """The surviving beams' matchers: each takes its parent's state (a copy where two beams share
    a parent) and then its new token."""
    left = Counter(rows)  # the original state is advanced at its parent's last use, copied before
    followed = []
    for row, token in zip(rows, tokens):
        matcher = matchers[row]
        left[row] -= 1
        if matcher is not None:
            matcher = matcher.copy() if left[row] else matcher
            matcher.advance(token)
        followed.append(matcher)
    return followed


def _may_improve(
    may_improve: Tensor,
    running_scores: Tensor,
    finished_scores: Tensor,
    finished_done: Tensor,
    length: int,
    max_length: int,
    prompt_len: int,
    s: GenerationSettings,
) -> Tensor:
    """(B, 1): can the best running beam still beat the worst finished hypothesis?

    Its final score is unknown; it is estimated at the current length, or
    (early_stopping="never" with a positive length_penalty, where longer
    helps) at the maximum length. A prompt whose finished list is not full
    can always improve.
    """
    if s.early_stopping == "never" and s.length_penalty > 0.0:
        best_length = max_length - prompt_len
    else:
        best_length = length - prompt_len
    best_running = running_scores[:, :1] / (best_length**s.length_penalty)  # (B, 1)
    worst_finished = torch.where(
        finished_done, finished_scores.min(dim=1, keepdim=True).values, IMPOSSIBLE
    )  # (B, K)
    return may_improve & (best_running > worst_finished).any(dim=-1, keepdim=True)
