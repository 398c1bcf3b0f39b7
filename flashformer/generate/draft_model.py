"""A draft model (transformers' assistant_model, vLLM's method "draft_model"): a smaller model with
the same tokenizer decodes k tokens ahead with its own KV cache, rewound to what the target kept;
a row of proposers.PROPOSERS.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashformer.generate.sampling import GenerationSettings, choose_tokens
from flashformer.generate.session import DecoderSession


class DraftModel:
    """A smaller model decoding ahead with its own session (KV cache). Greedy: its argmax; sampling:
    draws from its softmax at the target's temperature, returning those distributions q."""

    def __init__(self, model, input_ids: Tensor, s: GenerationSettings, generator, room: int):
        draft_settings = GenerationSettings(max_new_tokens=room, native=s.native)
        self.session = DecoderSession(model, input_ids, None, draft_settings)
        self.cached: list[int] = []  # the tokens whose keys the draft's cache holds
        self.do_sample, self.temperature, self.generator = s.do_sample, s.temperature, generator

    def match(self, context: list[int]) -> int:
        """Every context is alike to a draft model (one class of drafts for DraftLength)."""
        return 1

    def draft(self, context: list[int], k: int) -> tuple[list[int], Tensor | None]:
        """k drafts after `context`, and with sampling their distributions q (k, V)."""
        kept = common_prefix(self.cached, context)
        if kept == len(context):  # always feed at least one token: its logits come next
            kept -= 1
        self.session.rewind(kept)
        feed = context[kept:]
        device = self.session.input_ids.device
        logits = self.session.extend(torch.tensor([feed], device=device))[0, -1:]  # (1, V)
        tokens, dists = [], []
        for i in range(k):
            token, q = self._choose(logits)
            tokens.append(token)
            dists.append(q)
            if i + 1 < k:
                logits = self.session.extend(torch.tensor([[token]], device=device))[0]  # (1, V)
        self.cached = context + tokens[:-1]
        return tokens, torch.cat(dists) if self.do_sample else None

    def _choose(self, logits: Tensor) -> tuple[int, Tensor | None]:
        if not self.do_sample:
            return int(choose_tokens(logits, False, None)[0]), None
        q = (logits / self.temperature).softmax(dim=-1)  # (1, V)
        return int(torch.multinomial(q, 1, generator=self.generator)[0, 0]), q


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens a and b share from the start (a draft's cache; a chat's earlier turns)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
