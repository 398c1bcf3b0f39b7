"""`flashformer embed`: sentence vectors of texts, written as NumPy .npy or JSON lines.

    flashformer embed MODEL --text "A man is eating food." --text "A man is eating bread."
    flashformer embed MODEL --file texts.txt --out vectors.npy       # one text per line; a progress bar

MODEL: a sentence-transformers or Hugging Face folder (its pooling and normalization as
sentence-transformers reads them), a run of `flashformer finetune --task retrieval` or
`flashformer train` (mean pooling), or a checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from flashformer.encoders.sentence_embeddings import Pooling, SentenceEncoder
from flashformer.files import atomic_writer
from flashformer.model.heads import POOLING_MODES


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a sentence-transformers / Hugging Face folder, a run or a checkpoint")
    parser.add_argument("--text", action="append", default=[], help="a text to embed (repeat for more)")
    parser.add_argument("--file", type=Path, help="a UTF-8 file of texts, one per line")
    parser.add_argument(
        "--out",
        type=Path,
        help="where to write: NAME.npy (float32, one row per text) or NAME.jsonl "
        "(default: JSON lines on stdout)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="texts per forward pass (default 32)")
    parser.add_argument(
        "--pooling",
        choices=POOLING_MODES,
        help="instead of the model's pooling (default: the folder's, or mean)",
    )
    parser.add_argument(
        "--normalize",
        action="store_true",
        default=None,
        help="L2-normalize the vectors (default: as the folder says)",
    )
    parser.add_argument("--no-normalize", dest="normalize", action="store_false", help="do not normalize")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def read_texts(path: Path) -> list[str]:
    """One text per line; an empty line is an error naming it (it would embed nothing)."""
    if not path.is_file():
        raise FileNotFoundError(f"--file {path} does not exist")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise ValueError(f"--file {path} is not UTF-8 text ({error.reason} at byte {error.start})") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            raise ValueError(f"{path}, line {number}: an empty line; expected one text per line")
    return lines


def main_from_args(args) -> np.ndarray:
    texts = list(args.text) + (read_texts(args.file) if args.file else [])
    if not texts:
        raise ValueError("nothing to embed: give --text TEXT (repeatable) or --file FILE")
    if args.out is not None and args.out.suffix not in (".npy", ".jsonl"):
        raise ValueError(f"--out must end in .npy or .jsonl; got {args.out}")
    encoder = SentenceEncoder.from_pretrained(args.model)
    if args.pooling is not None or args.normalize is not None:
        stored = encoder.pooling
        encoder.pooling = Pooling(
            (args.pooling,) if args.pooling else stored.modes,
            stored.normalize if args.normalize is None else args.normalize,
            stored.max_length,
        )
    vectors = encoder.encode(texts, batch_size=args.batch_size, show_progress=not args.no_progress)
    if args.out is not None and args.out.suffix == ".npy":
        with atomic_writer(args.out, "wb") as f:
            np.save(f, vectors)
    elif args.out is not None:
        with atomic_writer(args.out) as f:
            _write_json_lines(f, texts, vectors)
    else:
        _write_json_lines(sys.stdout, texts, vectors)
    if args.out is not None:
        print(
            f"{len(texts)} vectors of {vectors.shape[1]} dimensions ({_describe(encoder.pooling)}): {args.out}"
        )
    return vectors


def _write_json_lines(f, texts: list[str], vectors: np.ndarray) -> None:
    for text, vector in zip(texts, vectors):
        f.write(json.dumps({"text": text, "embedding": [float(f"{x:.9g}") for x in vector]}) + "\n")


def _describe(pooling: Pooling) -> str:
    return "+".join(pooling.modes) + " pooling" + (", normalized" if pooling.normalize else "")
