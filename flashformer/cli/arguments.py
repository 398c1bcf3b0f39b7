"""What several commands share: the MODEL argument and how it loads, the sampling and chat
flags of `generate` and `chat`, the tokens that end generation, and the conversion of
`--model.FIELD` / `--train.FIELD` strings to typed config values (`train`, `finetune`)."""

from __future__ import annotations

import argparse
import typing
from pathlib import Path

from flashformer.checkpoints.loading import AUTO, QUANTIZE_CHOICES, load, load_draft_model
from flashformer.generate.chat import Chat
from flashformer.generate.proposers import PROPOSERS
from flashformer.generate.sampling_options import CLI_OPTIONS
from flashformer.kernels import kv_blocks
from flashformer.model.quantize import ACTIVATION_SCHEMES, DEFAULT_ACTIVATIONS
from flashformer.startup import paused_gc
from flashformer.text.bpe import EOS

MODEL_HELP = (
    "a GGUF file, a Hugging Face folder, a run folder of `flashformer train` or one of its checkpoints"
)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """MODEL and how to load it (shared by generate, chat, eval, serve)."""
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    add_quantize_arguments(parser)


QUANTIZE_HELP = (
    "auto (default): a GGUF file runs on its own quantized blocks, as llama.cpp runs it, and a folder as "
    "stored; none: float32 weights (a GGUF file dequantized, as transformers reads it); int8 / int4: a float "
    "model quantized at load; gguf: a GGUF file's own blocks"
)


def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    """--quantize and --activations: how MODEL loads."""
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=AUTO, help=QUANTIZE_HELP)
    parser.add_argument(
        "--activations",
        choices=tuple(ACTIVATION_SCHEMES),
        default=DEFAULT_ACTIVATIONS,
        help="what a quantized layer does with its input: int8: quantized per block of 32, as llama.cpp "
        "does; float32: kept as is (exact with respect to the quantized weights, about half the speed); "
        "int8-float32-head: int8 but the output head's input; int8-int8x2-head (default): int8 but the "
        "head's input as int8 plus its rounding error in int8 (~15 bits, at int8's speed)",
    )


def add_cache_type_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV cache's element types (generate, chat, serve), llama.cpp's flags and names."""
    for which, what in (("k", "keys"), ("v", "values")):
        parser.add_argument(
            f"--cache-type-{which}",
            choices=kv_blocks.TYPES,
            help=f"the KV cache's {what}: f32, f16, or q8_0 / q4_0 blocks (0.53x / 0.28x f16's bytes; read "
            f"by the native decoder). Default: the model's (f16 for GGUF blocks, else its float type)",
        )


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    """--lora: adapters loaded beside MODEL's projections (generate, chat, eval, export)."""
    parser.add_argument(
        "--lora",
        action="append",
        metavar="[NAME=]PATH",
        help="a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) added beside "
        "MODEL's projections, quantized or float (repeat the flag for several, all applied)",
    )


def lora_from_args(args) -> dict[str, str] | None:
    """--lora's values as load(adapters=...) takes them: {name: folder} (a bare PATH is named by
    its folder's name)."""
    values = getattr(args, "lora", None)
    if not values:
        return None
    adapters = {}
    for value in values:
        name, _, path = value.partition("=") if "=" in value and not Path(value).exists() else ("", "", value)
        name = name or Path(path).resolve().name
        if name in adapters:
            raise ValueError(f"--lora {value}: the name {name!r} is given twice; use NAME=PATH")
        adapters[name] = path
    return adapters


def load_model(args):
    """(model, tokenizer) as the model arguments ask; what the load leaves alive is frozen out of
    the garbage collector's later walks (flashformer.startup.paused_gc)."""
    with paused_gc(freeze=True):
        return load(
            args.model, quantize=args.quantize, activations=args.activations, adapters=lora_from_args(args)
        )


def add_sampling_arguments(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    """The generation flags `generate` and `chat` share: the sampling options with a flag
    (generate.sampling_options.CLI_OPTIONS: transformers' names and defaults, but sampling with
    temperature 0.8 and top-k 50 unless --greedy), and these."""
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    for option in CLI_OPTIONS:
        default = option.default if option.cli_default is None else option.cli_default
        parser.add_argument(
            f"--{option.name.replace('_', '-')}", type=option.type, default=default, help=option.help
        )
    parser.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    parser.add_argument("--greedy", action="store_true", help="the most likely token at every step")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    add_cache_type_arguments(parser)
    speculation = parser.add_mutually_exclusive_group()
    speculation.add_argument(
        "--prompt-lookup",
        type=int,
        metavar="N",
        help="speculative decoding: draft up to N tokens from n-grams of the prompt and the text so far",
    )
    speculation.add_argument(
        "--draft",
        metavar="MODEL",
        help="speculative decoding: a smaller model with the same tokenizer drafts for this one",
    )
    parser.add_argument(
        "--speculative-method",
        choices=sorted(PROPOSERS),
        help="speculative decoding: which proposer drafts ("
        + "; ".join(f"{kind.method}: {kind.summary}" for kind in PROPOSERS.values())
        + "). Default: ngram with --prompt-lookup N (another lookup drafts up to N too), draft_model with --draft",
    )
    parser.add_argument(
        "--draft-tokens", type=int, default=5, help="with --draft: the most tokens it drafts ahead (5)"
    )
    parser.add_argument(
        "--draft-quantize",
        choices=QUANTIZE_CHOICES,
        help="with --draft: how it loads (default: as --quantize; a float model's own GGUF file with "
        "--draft-quantize gguf drafts for it)",
    )


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
        **{option.name: getattr(args, option.name) for option in CLI_OPTIONS},
        compile=args.compile,
        prompt_lookup_num_tokens=args.prompt_lookup,
        assistant_model=None
        if args.draft is None
        else load_draft_model(args.draft, args.draft_quantize or args.quantize, args.activations),
        num_assistant_tokens=args.draft_tokens,
        speculative_method=args.speculative_method,
        cache_type_k=args.cache_type_k,
        cache_type_v=args.cache_type_v,
    )


def chat_from_args(args, model, tokenizer, **options) -> Chat:
    """The conversation `chat` and `generate --chat` hold: the chat and sampling flags, the
    model's stop tokens, and any option of the command's own (chat's --context)."""
    return Chat(
        model,
        tokenizer,
        system=args.system,
        seed=args.seed,
        chat_template=chat_template(args),
        eos_token_id=stop_ids(model, tokenizer),
        **sampling_settings(args),
        **options,
    )


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


def convert(value, hint, name: str):
    """A YAML value or a command-line string as the field's declared type."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        hint = next(a for a in args if a is not type(None))
        return convert(value, hint, name)
    if origin is list:
        items = value if isinstance(value, list) else [v for v in str(value).split(",") if v]
        return [convert(v, args[0] if args else str, name) for v in items]
    if hint is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name} must be true or false; got {value!r}")
    if hint in (int, float, str):
        try:
            return hint(value)
        except ValueError:
            raise ValueError(f"{name} must be {hint.__name__}; got {value!r}") from None
    return value


def parse_dotted(extra: list[str]) -> dict[str, dict[str, str]]:
    """['--train.lr', '3e-4', '--model.n_layers=6'] -> {'train': {'lr': '3e-4'}, 'model': {...}}."""
    result: dict[str, dict[str, str]] = {"model": {}, "train": {}}
    items = list(extra)
    while items:
        flag = items.pop(0)
        if not flag.startswith("--") or "." not in flag:
            raise ValueError(
                f"unexpected argument {flag!r}; overrides look like --train.lr 3e-4 or --model.n_layers 6"
            )
        key, _, value = flag[2:].partition("=")
        if not value:
            if not items:
                raise ValueError(f"{flag} needs a value")
            value = items.pop(0)
        section, _, name = key.partition(".")
        if section not in result:
            raise ValueError(f"unknown section in {flag!r}; use --model.FIELD or --train.FIELD")
        result[section][name.replace("-", "_")] = value
    return result
