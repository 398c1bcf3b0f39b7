"""The `flashformer` command: one table of commands, each a module with
`add_arguments(parser)` and `main_from_args(args)`.

A command's module is imported only when its parser is built or it runs: `flashformer CMD`
imports CMD's module alone (torch, the model and what CMD uses) and `flashformer --help` none,
so that a command's start costs only what it runs (docs/benchmarks.md, "Cold start").
"""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import sys
from dataclasses import dataclass

from flashformer.kernels.huge_pages import use_huge_pages
from flashformer.startup import paused_gc


@dataclass(frozen=True)
class Command:
    """One command (or sub-command): the module that implements it and its help texts."""

    module: str
    help: str
    description: str | None = None


# name -> a Command, or a group: (its help, {sub-name -> Command})
COMMANDS: dict[str, Command | tuple[str, dict[str, Command]]] = {
    "train": Command(
        "flashformer.cli.train",
        "train a model (default: a small GPT on Python's standard library)",
        "Extra --model.FIELD VALUE and --train.FIELD VALUE arguments override any config field.",
    ),
    "finetune": Command(
        "flashformer.cli.finetune",
        "fine-tune an encoder on a task (classification, tagging, retrieval) and report the task's metrics",
        "MODEL: a Hugging Face or sentence-transformers folder (MiniLM), a run of `flashformer train --preset "
        "bert-tiny` or a checkpoint. Without --train-file, the default task of --task built from Python's "
        "standard library, split by file. The trainer of `flashformer train` (checkpoints, --resume, "
        "torchrun); extra --train.FIELD VALUE and --model.FIELD VALUE arguments override any config field.",
    ),
    "generate": Command(
        "flashformer.cli.generate",
        "continue a prompt with a trained or converted model, printing text as it comes",
        "MODEL: a GGUF file, a Hugging Face folder with tokenizer.json, a run folder of `flashformer train` "
        "(its newest checkpoint) or one checkpoint folder. Samples with temperature 0.8 and top-k 50 unless "
        "--greedy or --num-beams is given; --chat answers the prompt through the model's chat template.",
    ),
    "chat": Command(
        "flashformer.cli.chat",
        "talk with a model in the terminal, through its chat template",
        "MODEL as for generate. Answers stream as they come; Ctrl-C stops an answer, Ctrl-D ends the chat.",
    ),
    "embed": Command(
        "flashformer.cli.embed",
        "sentence vectors of texts (NumPy .npy or JSON lines), as sentence-transformers' encode gives them",
        "MODEL: a sentence-transformers or Hugging Face folder (pooling and normalization read from its "
        "modules.json and 1_Pooling/config.json; without them mean pooling), a run or a checkpoint. Texts are "
        "cut to the folder's max_seq_length and batched by length.",
    ),
    "bench": (
        "run a benchmark (JSON + PNG)",
        {
            "attention": Command(
                "flashformer.bench.attention", "time and memory of the attention backends against n"
            ),
            "model": Command(
                "flashformer.bench.model",
                "tokens/s of flashformer against transformers, forward and training",
            ),
            "generate": Command(
                "flashformer.bench.generate", "tokens/s of generation against transformers' generate"
            ),
            "train": Command(
                "flashformer.bench.train", "training tokens/s and MFU against transformers (gpt2-small shape)"
            ),
            "quality": Command(
                "flashformer.bench.quality",
                "perplexity of a GGUF model in float32, int8, int4 and its own blocks, against llama.cpp",
            ),
            "serve": Command(
                "flashformer.bench.serve",
                "a server under load (openai client): tokens/s, time to first token, inter-token latency",
            ),
        },
    ),
    "export": Command(
        "flashformer.cli.export",
        "write a trained or Hugging Face model as a GGUF file, for llama.cpp and ollama",
        "MODEL: a run folder of `flashformer train` (its newest checkpoint), one checkpoint folder or a Hugging "
        "Face folder of the llama or gpt2 family, with its tokenizer (byte-level BPE). --type f16 and q8_0 as "
        "llama.cpp's convert_hf_to_gguf.py writes them; q4_k_m as llama-quantize's Q4_K_M mix (Q4_K, with "
        "Q6_K for the head and for attn_v / ffn_down on some layers).",
    ),
    "serve": Command(
        "flashformer.cli.serve",
        "serve a model over OpenAI's API (continuous batching, paged KV cache)",
        "MODEL as for generate. POST /v1/chat/completions, /v1/completions, /v1/responses and Anthropic's "
        "/v1/messages (streamed or not), GET /v1/models, /health and /metrics.",
    ),
    "eval": (
        "evaluate a model",
        {
            "perplexity": Command(
                "flashformer.cli.eval",
                "perplexity and bits per byte of a causal LM on text files (sliding windows)",
                "transformers' sliding-window convention: windows of --context tokens, --stride apart; each "
                "token scored once, with the window's earlier tokens as its context.",
            ),
            "kld": Command(
                "flashformer.cli.kld",
                "KL divergence of a model from a base model's log-probabilities, as llama-perplexity measures it",
                "--save-base FILE --data TEXT writes MODEL's log-probabilities in llama-perplexity's "
                "--kl-divergence-base format; --base FILE (ours or llama-perplexity's) runs MODEL on the file's "
                "tokens and prints PPL(Q)/PPL(base), the KLD's mean and percentiles, Δp and the same-top rate. "
                "llama-perplexity's chunks: --ctx tokens each (default 512), BOS first where the model adds one, "
                "the second half of each chunk scored. MODEL may be a base file too (llama-perplexity's "
                "--kl-divergence-base of a quantized model): its log-probabilities measured by the same statistic.",
            ),
        },
    ),
    "cost": Command(
        "flashformer.costs.report",
        "FLOPs, memory, KV cache and memory traffic from the formulas (table, JSON, PNG)",
        "Per-component FLOPs and bytes of a model, and a plot of how each part grows with n.",
    ),
    "study": (
        "run a study: models trained and measured alike (JSON + PNG + Markdown)",
        {
            "alternatives": Command(
                "flashformer.cli.study",
                "the Transformer against its alternatives at matched parameters: bits/byte, long-range "
                "tasks, speed and memory against n",
                "Every family trained by the same trainer on the same tokens (Python's stdlib and the synthetic "
                "recall, copying and selective-copying tasks), then timed in fresh processes; about an hour on 2 "
                "CPU cores, --quick in minutes. docs/alternatives.md shows the stored run.",
            ),
        },
    ),
    "viz": (
        "draw attention maps or the positional encodings (PNG)",
        {
            "attention": Command(
                "flashformer.viz.attention",
                "per-layer, per-head attention maps of a text",
                "A grid of attention maps (rows: layers, columns: heads) from a run, checkpoint or HF folder.",
            ),
            "positional": Command(
                "flashformer.viz.positional",
                "sinusoidal and RoPE similarity against distance, T5 buckets, ALiBi biases",
            ),
        },
    ),
}


def user_errors() -> tuple[type[Exception], ...]:
    """What a command raises for bad input: reported as "flashformer NAME: error: ..." with exit
    code 2. Read when an error comes (CheckpointError's module imports torch)."""
    from flashformer.checkpoints.checkpoint import CheckpointError

    return (ValueError, TypeError, FileNotFoundError, FileExistsError, CheckpointError)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command. With argv, only the command it names gets its arguments
    (its module imported): the others are listed with their help, as `flashformer --help` shows
    them, without importing what they run."""
    parser = argparse.ArgumentParser(prog="flashformer", description="The Transformer, exact and measured.")
    commands = parser.add_subparsers(dest="command", required=True)

    def named(*path: str) -> bool:
        return argv is None or tuple(argv[: len(path)]) == path

    for name, entry in COMMANDS.items():
        if isinstance(entry, Command):
            _add(commands, name, entry, (name,), with_arguments=named(name))
            continue
        group_help, members = entry
        group = commands.add_parser(name, help=group_help).add_subparsers(dest="subcommand", required=True)
        for sub_name, command in members.items():
            _add(group, sub_name, command, (name, sub_name), with_arguments=named(name, sub_name))
    return parser


def _add(subparsers, name: str, command: Command, path: tuple[str, ...], with_arguments: bool) -> None:
    parser = subparsers.add_parser(name, help=command.help, description=command.description)
    if with_arguments:
        importlib.import_module(command.module).add_arguments(parser)
    parser.set_defaults(command_path=path, command_module=command.module)


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Pull `--model.FIELD VALUE` / `--train.FIELD=VALUE` pairs out of argv,
    so that argparse never mistakes an override's value for a positional."""
    rest, overrides = [], []
    items = list(argv)
    while items:
        item = items.pop(0)
        if item.startswith(("--model.", "--train.")):
            overrides.append(item)
            if "=" not in item and items:
                overrides.append(items.pop(0))
        else:
            rest.append(item)
    return rest, overrides


def main(argv: list[str] | None = None) -> int:
    use_huge_pages()  # before any tensor is allocated (PyTorch reads it once)
    argv, overrides = split_overrides(sys.argv[1:] if argv is None else argv)
    with paused_gc(freeze=True):  # the command's module imports torch and the rooms it uses
        parser = build_parser(argv)
        args = parser.parse_args(argv)
    if overrides and args.command not in ("train", "finetune"):
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    args.overrides = overrides
    try:
        importlib.import_module(args.command_module).main_from_args(args)
    except user_errors() as error:
        parser.exit(2, f"flashformer {' '.join(args.command_path)}: error: {error}\n")
    return 0


def reference() -> str:
    """`flashformer ... --help` of every command, from the parser itself (docs/cli.md)."""

    def walk(parser: argparse.ArgumentParser, prefix: str):
        # the terminal's width would change the text: the page is written as an 80-column terminal shows it
        parser.formatter_class = functools.partial(argparse.HelpFormatter, width=78)
        yield prefix, parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, f"{prefix} {name}")

    parts = []
    for command, text in walk(build_parser(), "flashformer"):
        if command == "flashformer":
            continue
        text = re.sub(r"^usage: .*?(flashformer|cli\.py|pytest)", "usage: flashformer", text)
        parts.append(f"### `{command}`\n\n```\n{text.rstrip()}\n```")
    return "\n\n".join(parts)
