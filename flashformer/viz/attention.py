"""`flashformer viz attention CHECKPOINT --text ...`: a grid of attention maps,
one per layer (rows) and head (columns), tokens on the axes.

CHECKPOINT is a run folder of `flashformer train` (its newest checkpoint is
used), one of its step-* checkpoint folders, or a Hugging Face folder
(config.json with a model_type, weights, tokenizer.json). The maps are the
eager backend's probabilities, from model(..., output_attentions=True).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from flashformer.checkpoints.loading import load as load_model
from flashformer.checkpoints.loading import locate

# byte-level BPE's stand-ins for a leading space and a newline, shown readably
_BYTE_LEVEL_MARKS = {"Ġ": "·", "Ċ": "⏎", "ĉ": "⇥"}


@dataclass
class Tokenized:
    ids: list[int]
    labels: list[str]  # one readable string per token, for the axes
    type_ids: list[int] | None = None


class TextEncoder:
    """Text -> ids and readable tokens for the axes, with the model's tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> Tokenized:
        rust = getattr(self.tokenizer, "backend", None)  # the `tokenizers` object (not the byte tokenizer)
        if rust is not None:
            encoding = rust.encode(text)
            return Tokenized(encoding.ids, [_readable(t) for t in encoding.tokens], encoding.type_ids)
        ids = self.tokenizer.encode(text)  # bytes
        return Tokenized(ids, [_readable(self.tokenizer.decode([i]) or f"<{i}>") for i in ids])


def _readable(token: str) -> str:
    for mark, shown in _BYTE_LEVEL_MARKS.items():
        token = token.replace(mark, shown)
    return token.replace("\n", "⏎")


def load(path: str | Path):
    """(model in eval mode, TextEncoder, a name for titles) from a run,
    checkpoint or Hugging Face folder, through flashformer.load."""
    _, folder = locate(path)
    model, tokenizer = load_model(folder)
    name = folder.name if folder.parent.name == "" else f"{folder.parent.name}/{folder.name}"
    return model, TextEncoder(tokenizer), name


def attention_maps(model, tokens: Tokenized, decoder_tokens: Tokenized | None = None) -> dict[str, tuple]:
    """{"encoder" | "decoder" | "cross": per-layer (H, Lq, Lk) probabilities} of one sequence."""
    ids = torch.tensor([tokens.ids])
    arch = model.config.arch
    kwargs = {}
    if arch == "encoder" and tokens.type_ids is not None and model.config.type_vocab_size:
        kwargs["token_type_ids"] = torch.tensor([tokens.type_ids])
    if arch == "encoder-decoder":  # without decoder text, the start token alone: the encoder's maps only
        start = model.config.decoder_start_token_id or 0
        kwargs["decoder_input_ids"] = torch.tensor([decoder_tokens.ids if decoder_tokens else [start]])
    with torch.no_grad():
        out = model(ids, output_attentions=True, **kwargs)
    if arch == "encoder":
        return {"encoder": tuple(m[0] for m in out.attentions)}
    if arch == "decoder":
        return {"decoder": tuple(m[0] for m in out.attentions)}
    maps = {"encoder": tuple(m[0] for m in out.encoder_attentions)}
    if decoder_tokens is not None:
        maps["decoder"] = tuple(m[0] for m in out.attentions)
        maps["cross"] = tuple(m[0] for m in out.cross_attentions)
    return maps


def plot_grid(maps, query_labels, key_labels, path: Path, title: str, layers=None, heads=None) -> None:
    """Rows = layers, columns = heads; each cell a (query, key) heat map with
    the tokens on the axes (labels on the first column and the last row)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(range(len(maps))) if layers is None else layers
    heads = list(range(maps[0].shape[0])) if heads is None else heads
    for name, chosen, limit in (("layer", layers, len(maps)), ("head", heads, maps[0].shape[0])):
        bad = [i for i in chosen if not 0 <= i < limit]
        if bad:
            raise ValueError(f"--{name}s: {bad} out of range; the model has {limit} {name}s (0..{limit - 1})")
    n_q, n_k = len(query_labels), len(key_labels)
    cell = max(1.3, 0.12 * max(n_q, n_k))
    fig, axes = plt.subplots(
        len(layers), len(heads), figsize=(cell * len(heads) + 1, cell * len(layers) + 0.8), squeeze=False
    )
    fontsize = max(3.5, min(7.0, 260 / max(n_q, n_k) / max(1, len(heads) / 4)))
    for row, layer in enumerate(layers):
        for col, head in enumerate(heads):
            ax = axes[row][col]
            ax.imshow(maps[layer][head].float().numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
            ax.set_xticks(range(n_k))
            ax.set_yticks(range(n_q))
            ax.set_xticklabels(key_labels if row == len(layers) - 1 else [], rotation=90, fontsize=fontsize)
            ax.set_yticklabels(query_labels if col == 0 else [], fontsize=fontsize)
            ax.tick_params(length=0)
            if row == 0:
                ax.set_title(f"head {head}", fontsize=8)
            if col == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _indices(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a run folder, a checkpoint folder, or a Hugging Face folder")
    parser.add_argument("--text", required=True, help="the text whose attention to draw")
    parser.add_argument("--decoder-text", help="T5: the decoder's input text (its self- and cross-attention)")
    parser.add_argument("--layers", type=_indices, help="comma-separated layers (default: all)")
    parser.add_argument("--heads", type=_indices, help="comma-separated heads (default: all)")
    parser.add_argument(
        "--max-tokens", type=int, default=48, help="refuse longer texts (the grid gets unreadable)"
    )
    parser.add_argument("--out", type=Path, default=Path("attention-maps.png"), help="PNG to write")


def main_from_args(args: argparse.Namespace) -> list[Path]:
    model, encode, name = load(args.checkpoint)
    tokens = encode(args.text)
    decoder_tokens = encode(args.decoder_text) if args.decoder_text is not None else None
    for what, tok in (("--text", tokens), ("--decoder-text", decoder_tokens)):
        if tok is not None and not 1 <= len(tok.ids) <= args.max_tokens:
            raise ValueError(f"{what} has {len(tok.ids)} tokens; give 1 to --max-tokens={args.max_tokens}")
    maps = attention_maps(model, tokens, decoder_tokens)
    written = []
    # a T5 decoder reads --decoder-text; every other stack (and T5's cross-attention keys) --text
    target = decoder_tokens if model.config.arch == "encoder-decoder" else tokens
    for kind, per_layer in maps.items():
        queries = tokens if kind == "encoder" else target
        keys = target if kind == "decoder" else tokens
        path = args.out if len(maps) == 1 else args.out.with_name(f"{args.out.stem}-{kind}{args.out.suffix}")
        title = f"{name}: {kind} attention (rows: layers, columns: heads; y: queries, x: keys)"
        plot_grid(per_layer, queries.labels, keys.labels, path, title, args.layers, args.heads)
        written.append(path)
    print(f"wrote {', '.join(str(p) for p in written)}")
    return written
