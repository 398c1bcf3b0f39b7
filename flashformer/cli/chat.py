"""`flashformer chat MODEL`: a conversation in the terminal.

Each answer is streamed as it is generated; Ctrl-C stops the answer (what
was said stays in the history), Ctrl-D (end of input) ends the chat. The
history is rendered through the model's chat template every turn and the KV
cache of the earlier turns is reused (flashformer.generate.chat).
"""

from __future__ import annotations

import argparse
import sys

from flashformer.cli.arguments import (
    add_chat_arguments,
    add_lora_arguments,
    add_model_arguments,
    add_sampling_arguments,
    chat_from_args,
    load_model,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_lora_arguments(parser)
    add_chat_arguments(parser)
    parser.add_argument("--context", type=int, default=4096, help="tokens of conversation the KV cache holds")
    add_sampling_arguments(parser, max_new_tokens=512)


def main_from_args(args, input_line=input) -> None:
    model, tokenizer = load_model(args)
    chat = chat_from_args(args, model, tokenizer, context=args.context)
    if sys.stdin.isatty():
        import readline  # noqa: F401  (line editing and history for input())

        print(f"chatting with {args.model} (Ctrl-C stops an answer, Ctrl-D ends the chat)", flush=True)
    while True:
        try:
            text = input_line("> ")
        except EOFError:
            print(flush=True)
            return
        except KeyboardInterrupt:
            print(flush=True)
            continue
        if not text.strip():
            continue
        try:
            for piece in chat.send(text):
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print(" [stopped]", end="")
        print(flush=True)
