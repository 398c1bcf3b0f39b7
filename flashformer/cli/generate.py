"""`flashformer generate MODEL --prompt TEXT`: continue a prompt, or with
--chat answer it as a chat message, printing the text as it is generated."""

from __future__ import annotations

import argparse

import torch

from flashformer.cli.arguments import (
    add_chat_arguments,
    add_model_arguments,
    add_sampling_arguments,
    chat_from_args,
    load_model,
    sampling_settings,
    stop_ids,
)
from flashformer.text.detokenizer import stream_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--prompt", required=True, help="the text to continue (with --chat: the message)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="answer --prompt as a chat message, through the model's chat template",
    )
    add_chat_arguments(parser)
    add_sampling_arguments(parser, max_new_tokens=200)
    parser.add_argument("--num-beams", type=int, default=1, help="beam search (prints the result at the end)")


def main_from_args(args) -> None:
    """Load, encode the prompt, and print the continuation as it is generated."""
    model, tokenizer = load_model(args)
    settings = dict(sampling_settings(args), eos_token_id=stop_ids(model, tokenizer))
    if args.chat:
        if args.num_beams != 1:
            raise ValueError("--chat streams its answer: it does not take --num-beams")
        for piece in chat_from_args(args, model, tokenizer).send(args.prompt):
            print(piece, end="", flush=True)
        print(flush=True)
        return
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise ValueError(f"--prompt {args.prompt!r} encodes to no tokens; give some text")
    input_ids = torch.tensor([ids])
    settings.update(
        num_beams=args.num_beams, seed=args.seed, do_sample=settings["do_sample"] and args.num_beams == 1
    )
    decoder = model.config.arch == "decoder"
    if decoder:
        print(args.prompt, end="", flush=True)
    if args.num_beams > 1:
        out = model.generate(input_ids, **settings)[0]
        new = out[len(ids) :] if decoder else out[1:]
        print(tokenizer.decode(new.tolist()), flush=True)
        return
    for piece in stream_text(tokenizer, (int(t[0]) for t in model.stream(input_ids, **settings))):
        print(piece, end="", flush=True)
    print(flush=True)
