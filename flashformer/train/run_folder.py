"""What a run folder of `flashformer train` holds besides its checkpoints:
the tokenizer and token files of its corpus (made once, reused while the
corpus and tokenizer settings stay the same), and the earlier runs moved
aside when a fresh run starts in the same folder.

    runs/gpt-mini/
      data/         fingerprint.json, tokenizer.json, train.bin, val.bin, stats.json
      step-*/       checkpoints (checkpoint.py)
      previous-N/   an earlier run's checkpoints, metrics, plot and export
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from flashformer.checkpoints import checkpoint as ckpt
from flashformer.checkpoints.loading import load_tokenizer
from flashformer.files import write_json
from flashformer.text import bpe
from flashformer.train import corpus


@dataclass
class RunData:
    tokenizer: object
    train: corpus.PackedSequences
    val: corpus.PackedSequences
    val_bytes_per_token: float
    unigram_bits_per_byte: float


def prepare_data(config, data_dir: Path, is_main: bool, show_progress: bool) -> RunData:
    """Tokenizer and token files of a run (config: its train.TrainConfig), made once and reused.

    Rank 0 builds them (the others wait at a barrier); a fingerprint of the
    corpus and the tokenizer settings decides whether what is on disk is
    still the right thing, so a changed --data never reuses stale tokens.
    """
    documents = corpus.resolve_corpus(config.data)
    train_docs, val_docs = corpus.split_documents(documents, config.val_fraction, config.seed)
    if not val_docs:
        raise ValueError(f"the corpus has {len(documents)} document(s): too few for a validation split")
    fingerprint = {
        "documents": [d.name for d in documents],
        "sizes": [d.path.stat().st_size for d in documents],
        "tokenizer": config.base or config.tokenizer,  # a LoRA run's tokenizer is its base's
        "vocab_size": config.vocab_size if config.tokenizer == "bpe" and not config.base else None,
        "val_fraction": config.val_fraction,
        "seed": config.seed,
    }
    stamp = data_dir / "fingerprint.json"
    if is_main:
        fresh = not stamp.is_file() or json.loads(stamp.read_text()) != fingerprint
        if fresh:
            data_dir.mkdir(parents=True, exist_ok=True)
            stamp.unlink(missing_ok=True)
            if config.base:
                tokenizer = load_tokenizer(config.base)
            elif config.tokenizer == "bpe":
                print(
                    f"training a byte-level BPE tokenizer ({config.vocab_size} tokens) "
                    f"on {len(train_docs)} files",
                    flush=True,
                )
                tokenizer = bpe.train_bpe(
                    (corpus.read_text(d.path) for d in train_docs),
                    config.vocab_size,
                    show_progress,
                    len(train_docs),
                )
            else:
                tokenizer = bpe.ByteTokenizer()
            tokenizer.save(data_dir)
            corpus.write_token_file(train_docs, tokenizer, data_dir / "train.bin", show_progress)
            corpus.write_token_file(val_docs, tokenizer, data_dir / "val.bin", show_progress)
            val_bytes = sum(len(corpus.read_text(d.path).encode("utf-8")) for d in val_docs)
            entropy = unigram_bits_per_byte(val_docs)
            write_json(data_dir / "stats.json", {"val_bytes": val_bytes, "unigram_bits_per_byte": entropy})
            write_json(stamp, fingerprint)  # last: its presence says the rest is complete
    if dist.is_initialized():
        dist.barrier()
    tokenizer = bpe.read_saved_tokenizer(data_dir)
    stats = json.loads((data_dir / "stats.json").read_text())
    val_tokens = corpus.open_token_file(data_dir / "val.bin")
    return RunData(
        tokenizer=tokenizer,
        train=corpus.PackedSequences(corpus.open_token_file(data_dir / "train.bin"), config.seq_len),
        val=corpus.PackedSequences(val_tokens, config.seq_len),
        val_bytes_per_token=stats["val_bytes"] / len(val_tokens),
        unigram_bits_per_byte=stats["unigram_bits_per_byte"],
    )


def unigram_bits_per_byte(documents: list[corpus.Document]) -> float:
    """The entropy of the corpus' byte frequencies: what a model that knows
    only how often each byte occurs would pay per byte. A model that learned
    anything about context must end well below it."""
    counts = torch.zeros(256, dtype=torch.float64)
    for doc in documents:
        raw = torch.frombuffer(bytearray(doc.path.read_bytes()), dtype=torch.uint8)
        counts += torch.bincount(raw.long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log2()).sum())


def archive_previous_run(out_dir: Path) -> Path | None:
    """A fresh run in a folder that holds an earlier run's checkpoints moves
    them (with its metrics, plot, summary and export) into previous-N/, so that the
    newest checkpoint in the folder is always this run's and nothing is lost.
    The token files are kept and reused."""
    out_dir = Path(out_dir)
    names = [p.name for p in ckpt.list_checkpoints(out_dir)]
    names += [
        n for n in ("metrics.jsonl", "loss.png", "summary.json", "hf", "peft") if (out_dir / n).exists()
    ]
    if not names:
        return None
    index = 1
    while (out_dir / f"previous-{index}").exists():
        index += 1
    archive = out_dir / f"previous-{index}"
    archive.mkdir()
    for name in names:
        os.replace(out_dir / name, archive / name)
    print(f"{out_dir} held an earlier run: moved its {', '.join(names)} to {archive}", flush=True)
    return archive
