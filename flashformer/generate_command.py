"""`flashformer generate CHECKPOINT --prompt TEXT`: continue a prompt with a
trained or converted model, printing the text as it is generated."""

from __future__ import annotations

import argparse

import torch

from flashformer.data import EOS
from flashformer.loading import load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="run folder, checkpoint folder or Hugging Face folder")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=50, help="0 = no top-k filter")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    parser.add_argument("--greedy", action="store_true", help="the most likely token at every step")
    parser.add_argument("--num-beams", type=int, default=1, help="beam search (prints the result at the end)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step")


def main_from_args(args) -> None:
    """Load, encode the prompt, and print the continuation as it is generated."""
    model, tokenizer = load(args.checkpoint)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise ValueError(f"--prompt {args.prompt!r} encodes to no tokens; give some text")
    input_ids = torch.tensor([ids])
    settings = dict(
        max_new_tokens=args.max_new_tokens,
        do_sample=not args.greedy and args.num_beams == 1,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        num_beams=args.num_beams,
        seed=args.seed,
        compile=args.compile,
        eos_token_id=_eos_ids(model, tokenizer, EOS),
    )
    decoder = model.config.arch == "decoder"
    if decoder:
        print(args.prompt, end="", flush=True)
    if args.num_beams > 1:
        out = model.generate(input_ids, **settings)[0]
        new = out[len(ids) :] if decoder else out[1:]
        print(tokenizer.decode(new.tolist()), flush=True)
        return
    new, shown = [], ""
    for tokens in model.stream(input_ids, **settings):
        new.append(int(tokens[0]))
        text = tokenizer.decode(new)
        if not text.endswith("\ufffd"):  # hold back a character whose UTF-8 bytes are still coming
            print(text[len(shown) :], end="", flush=True)
            shown = text
    print(tokenizer.decode(new)[len(shown) :], flush=True)


def _eos_ids(model, tokenizer, eos_token: str) -> list[int]:
    """The model's eos ids if its config has usable ones, else the tokenizer's
    end-of-text token (what `flashformer train` puts between documents), else none."""
    configured = model.config.eos_token_id
    configured = [configured] if isinstance(configured, int) else list(configured or [])
    usable = [i for i in configured if 0 <= i < model.config.vocab_size]
    if usable:
        return usable
    try:
        eos = tokenizer.token_id(eos_token)
    except KeyError:
        return []
    return [eos] if 0 <= eos < model.config.vocab_size else []
