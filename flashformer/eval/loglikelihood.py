"""The log-probability of every token of a text under a causal LM, with its top alternatives:
what a benchmark that scores continuations reads (lm-evaluation-harness' loglikelihood), and
what the server's `echo` with `logprobs` answers.

    scored = token_logprobs(model, ids, top=5)
    scored[0] is None                    # the first token has nothing to be predicted from
    scored[i].logprob                    # log P(ids[i] | ids[:i]), natural log, float32 softmax
    scored[i].top                        # [(token id, log-probability)] the 5 likeliest, best first

One forward over the whole text without a cache (a batch of one: the same
numbers however the caller batches its requests), and the vocabulary's
log-softmax taken `chunk` positions at a time, so a long text never holds
all its logits at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ScoredToken:
    token: int
    logprob: float  # log P(token | the tokens before it)
    top: list[tuple[int, float]]  # the `top` likeliest tokens at its position, best first


@torch.no_grad()
def token_logprobs(model, ids: list[int], top: int = 0, chunk: int = 256) -> list[ScoredToken | None]:
    """Each token's log-probability given the tokens before it (None for the first) and the
    `top` likeliest tokens at its position. ids: one text's token ids, at most the model's
    max_seq_len; chunk: positions whose logits are computed together."""
    if not ids:
        raise ValueError("ids is empty: give at least one token")
    limit = model.config.max_seq_len
    if len(ids) > limit:
        raise ValueError(f"ids holds {len(ids)} tokens; this model reads at most {limit}")
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"top must be an int >= 0; got {top!r}")
    device = next(model.parameters()).device
    tokens = torch.tensor([ids], device=device)  # (1, L)
    hidden = model(tokens, logits_to_keep=1).last_hidden_state[0]  # (L, d_model)
    scored: list[ScoredToken | None] = [None]
    targets = tokens[0, 1:]  # (L - 1,): position p predicts token p + 1
    for begin in range(0, len(ids) - 1, chunk):
        end = min(begin + chunk, len(ids) - 1)
        logits = model.project(hidden[None, begin:end])[0].float()  # (C, V)
        log_probs = F.log_softmax(logits, dim=-1)
        chosen = log_probs.gather(1, targets[begin:end, None])[:, 0].tolist()  # (C,)
        if top:
            best = torch.topk(log_probs, min(top, log_probs.shape[-1]))
            alternatives = [list(zip(i, v)) for i, v in zip(best.indices.tolist(), best.values.tolist())]
        else:
            alternatives = [[] for _ in chosen]
        for offset, (logprob, alts) in enumerate(zip(chosen, alternatives)):
            scored.append(ScoredToken(int(targets[begin + offset]), logprob, alts))
    return scored
