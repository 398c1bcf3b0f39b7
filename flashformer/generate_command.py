"""`flashformer generate MODEL --prompt TEXT`: continue a prompt, or with
--chat answer it as a chat message, printing the text as it is generated."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from flashformer.chat import Chat
from flashformer.data import EOS
from flashformer.loading import load
from flashformer.quantize import MODES
from flashformer.tokenizer import stream_text

MODEL_HELP = (
    "a GGUF file, a Hugging Face folder, a run folder of `flashformer train` or one of its checkpoints"
)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """MODEL and how to load it (shared by generate, chat, eval, serve)."""
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument(
        "--quantize",
        choices=MODES,
        help="weight-only quantized layers: int8 / int4 from the float weights, or a GGUF file's own blocks (gguf)",
    )
    parser.add_argument(
        "--activations",
        choices=("int8", "float32"),
        default="int8",
        help="with --quantize: inputs of the quantized layers quantized to int8 per block of 32 (as llama.cpp "
        "does; faster) or kept float32 (exact with respect to the quantized weights)",
    )


def load_model(args):
    """(model, tokenizer) as the model arguments ask."""
    return load(args.model, quantize=args.quantize, activations=args.activations)


def add_sampling_arguments(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """The generation flags `generate` and `chat` share (transformers' names and defaults, but
    sampling with temperature 0.8 and top-k 50 unless --greedy)."""
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=50, help="0 = no top-k filter")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    parser.add_argument("--greedy", action="store_true", help="the most likely token at every step")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step")


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", help="a system message that opens the conversation")
    parser.add_argument(
        "--chat-template",
        type=Path,
        help="a Jinja chat template file, instead of the model's own (or for a model without one)",
    )


def chat_template(args) -> str | None:
    if args.chat_template is None:
        return None
    if not args.chat_template.is_file():
        raise FileNotFoundError(f"--chat-template {args.chat_template} is not a file")
    return args.chat_template.read_text(encoding="utf-8")


def sampling_settings(args) -> dict:
    return dict(
        max_new_tokens=args.max_new_tokens,
        do_sample=not args.greedy,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        compile=args.compile,
    )


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
        chat = Chat(
            model,
            tokenizer,
            system=args.system,
            seed=args.seed,
            chat_template=chat_template(args),
            **settings,
        )
        for piece in chat.send(args.prompt):
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


def stop_ids(model, tokenizer) -> list[int]:
    """The tokens that end generation: a real model's tokenizer names them (its eos and its
    chat format's end of turn); else the model's configured eos ids, else the end-of-text
    token `flashformer train` puts between documents, else none."""
    vocab = model.config.vocab_size
    named = [i for i in getattr(tokenizer, "stop_token_ids", []) if 0 <= i < vocab]
    if named:
        return named
    configured = model.config.eos_token_id
    configured = [configured] if isinstance(configured, int) else list(configured or [])
    usable = [i for i in configured if 0 <= i < vocab]
    if usable:
        return usable
    try:
        eos = tokenizer.token_id(EOS)
    except KeyError:
        return []
    return [eos] if 0 <= eos < vocab else []
