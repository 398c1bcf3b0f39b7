"""Count what the model-free proposers of generate.proposers draft and keep on bench generate's
speculative workloads (docs/benchmarks.md, "Speculative decoding"): greedy, batch 1, no stop token.

    python scripts/speculative_acceptance.py MODEL.gguf [--methods ngram,suffix] [--drafts 8]
        [--costs 0.25,0] [--new-tokens 256]

Counts, not timings: the cost of a row that DraftLength weighs is fixed (--costs; 0.25 is typical
of a CPU, 0 drafts the most every round, the proposer alone), so the figures are the same on any
machine and under any load. Per workload and proposer: the verify forwards after the prompt's,
the drafts checked and kept, and the tokens each forward gave ((new tokens - 1) / forwards: 1.0 is
plain decoding); the tokens are checked against plain greedy decoding.
"""

from __future__ import annotations

import argparse

import torch

import flashformer
from flashformer.bench.speculative import WORKLOADS, prompt_text
from flashformer.generate import speculative
from flashformer.generate.sampling import settings_from
from flashformer.generate.session import DecoderSession


def counts(
    model, ids: torch.Tensor, n: int, method: str, drafts: int
) -> tuple[list[int], speculative.Counters]:
    s = settings_from(
        model, max_new_tokens=n, eos_token_id=[], prompt_lookup_num_tokens=drafts, speculative_method=method
    )
    counters = speculative.Counters()
    session = DecoderSession(model, ids, None, s)
    tokens = [int(t[0]) for t in speculative.speculative_tokens(session, s, None, None, counters=counters)]
    return tokens, counters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--methods", default="ngram,suffix")
    parser.add_argument("--drafts", type=int, default=8)
    parser.add_argument("--costs", default="0.25,0")
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    model, tokenizer = flashformer.load(args.model)
    print(
        "| workload | copies | row cost | proposer | forwards | drafted | kept | kept/drafted | tokens/forward | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, (copies, message, base) in WORKLOADS.items():
        ids = torch.tensor([tokenizer.encode(prompt_text(tokenizer, message, base))])
        plain = model.generate(ids, max_new_tokens=args.new_tokens, eos_token_id=[])[
            0, ids.shape[1] :
        ].tolist()
        for cost in (float(c) for c in args.costs.split(",")):
            speculative._ROW_COSTS[model] = dict.fromkeys(
                ("PromptLookup", "SuffixLookup", "DraftModel"), cost
            )
            for method in args.methods.split(","):
                tokens, c = counts(model, ids, args.new_tokens, method, args.drafts)
                print(
                    f"| {name} | {'yes' if copies else 'no'} | {cost:g} | {method} | {c.forwards} | {c.drafted} | "
                    f"{c.accepted} | {c.accepted / max(1, c.drafted):.2f} | {(len(tokens) - 1) / c.forwards:.2f} | "
                    f"{'yes' if tokens == plain else 'NO'} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
