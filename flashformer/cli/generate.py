"""`flashformer generate MODEL --prompt TEXT`: continue a prompt, or with
--chat answer it as a chat message, printing the text as it is generated.
--json-schema FILE, --json-object, --regex, --choice or --grammar FILE constrain the new text
(generate.constraints): it then always parses."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from flashformer.cli.arguments import (
    add_chat_arguments,
    add_lora_arguments,
    add_model_arguments,
    add_sampling_arguments,
    chat_from_args,
    load_model,
    sampling_settings,
    stop_ids,
)
from flashformer.generate.constraints import Constraint
from flashformer.text.detokenizer import stream_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_lora_arguments(parser)
    parser.add_argument("--prompt", required=True, help="the text to continue (with --chat: the message)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="answer --prompt as a chat message, through the model's chat template",
    )
    add_chat_arguments(parser)
    add_sampling_arguments(parser, max_new_tokens=200)
    parser.add_argument("--num-beams", type=int, default=1, help="beam search (prints the result at the end)")
    structure = parser.add_mutually_exclusive_group()
    structure.add_argument(
        "--json-schema", metavar="FILE", help="the text is JSON valid under this schema file"
    )
    structure.add_argument("--json-object", action="store_true", help="the text is a JSON object")
    structure.add_argument("--regex", metavar="PATTERN", help="the text matches this regular expression")
    structure.add_argument(
        "--choice", metavar="TEXT", action="append", help="the text is one of these (repeat the flag)"
    )
    structure.add_argument(
        "--grammar", metavar="FILE", help="the text follows this Lark or GBNF grammar file"
    )


def constraint_from_args(args, model, tokenizer) -> Constraint | None:
    """The constraint the structure flags ask for (None: free text)."""
    if args.json_schema:
        try:
            schema = json.loads(Path(args.json_schema).read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"--json-schema {args.json_schema}: not JSON: {error}") from None
        spec = {"json_schema": schema}
    elif args.json_object:
        spec = {"json_object": True}
    elif args.regex:
        spec = {"regex": args.regex}
    elif args.choice:
        spec = {"choice": args.choice}
    elif args.grammar:
        spec = {"grammar": Path(args.grammar).read_text(encoding="utf-8")}
    else:
        return None
    return Constraint.from_spec(spec, tokenizer, model.config.vocab_size)


def main_from_args(args) -> None:
    """Load, encode the prompt, and print the continuation as it is generated."""
    model, tokenizer = load_model(args)
    constraint = constraint_from_args(args, model, tokenizer)
    settings = dict(sampling_settings(args), eos_token_id=stop_ids(model, tokenizer), constraint=constraint)
    if args.chat:
        if args.num_beams != 1:
            raise ValueError("--chat streams its answer: it does not take --num-beams")
        for piece in chat_from_args(args, model, tokenizer, constraint=constraint).send(args.prompt):
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
