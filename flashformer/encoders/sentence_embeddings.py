"""Sentence embeddings: one vector per text, as sentence-transformers' `encode` gives them.

    encoder = SentenceEncoder.from_pretrained(path)      # a sentence-transformers / HF folder, a run, a checkpoint
    vectors = encoder.encode(["A man is eating food.", ...], batch_size=32)   # (N, d) float32 numpy array
    scores = vectors @ vectors.T                         # cosine similarities when the folder normalizes

How the hidden states become one vector is read from the folder, as sentence-transformers reads
it: modules.json lists the modules (Transformer, Pooling, Normalize), 1_Pooling/config.json the
pooling modes (cls, mean, max, mean_sqrt_len; several are concatenated in that order), and
sentence_bert_config.json the max_seq_length texts are cut to. A folder without modules.json gets
what sentence-transformers gives a plain transformers model: mean pooling, no normalization. A run
of `flashformer finetune --task retrieval` stores its pooling in its checkpoints' config.json
("embedding") and writes the sentence-transformers files into its Hugging Face export.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from flashformer.checkpoints.loading import load, locate
from flashformer.files import write_atomic
from flashformer.model.heads import check_pooling_mode, pool
from flashformer.model.models import EncoderModel, rebuild
from flashformer.text.encoder_inputs import batches_by_length, encode_texts, pad_batch, pad_id_of

# sentence-transformers' pooling flags, in the order its Pooling module concatenates them
ST_POOLING_FLAGS = {
    "cls": "pooling_mode_cls_token",
    "max": "pooling_mode_max_tokens",
    "mean": "pooling_mode_mean_tokens",
    "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens",
}
ST_UNSUPPORTED_FLAGS = ("pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")
ST_MODULE = "sentence_transformers.models."


@dataclass(frozen=True)
class Pooling:
    """How hidden states become a sentence vector.

    modes: pooling modes (pooling.POOLING_MODES), concatenated in sentence-transformers' order;
    normalize: divide each vector by its L2 norm; max_length: tokens a text is cut to, special
    tokens included (sentence-transformers' max_seq_length), None = the model's positions."""

    modes: tuple[str, ...] = ("mean",)
    normalize: bool = False
    max_length: int | None = None

    def __post_init__(self):
        modes = tuple(self.modes)
        if not modes:
            raise ValueError("Pooling.modes must hold at least one mode")
        for mode in modes:
            check_pooling_mode(mode, "Pooling.modes")
        object.__setattr__(self, "modes", tuple(sorted(modes, key=list(ST_POOLING_FLAGS).index)))

    def vectors(self, hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
        """hidden (B, L, d), attention_mask (B, L) -> (B, d * len(modes))."""
        vectors = torch.cat([pool(hidden, attention_mask, mode) for mode in self.modes], dim=-1)
        return F.normalize(vectors, p=2, dim=-1) if self.normalize else vectors

    def to_dict(self) -> dict:
        return dict(asdict(self), modes=list(self.modes))

    @classmethod
    def from_dict(cls, values: dict) -> Pooling:
        return cls(tuple(values["modes"]), bool(values["normalize"]), values.get("max_length"))


def embed(model, batch: dict[str, Tensor], pooling: Pooling) -> Tensor:
    """The sentence vectors (B, d) of a padded batch (input_ids, attention_mask), with gradients
    when they are enabled: the bi-encoder's training step and encode() share it."""
    hidden = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    return pooling.vectors(hidden, batch["attention_mask"])  # (B, d)


# ---- sentence-transformers folders ----


def _json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None


def read_sentence_transformers(folder: str | Path) -> tuple[Path, Pooling] | None:
    """(the folder of the Transformer module, its Pooling) from a sentence-transformers folder's
    modules.json, or None when there is no modules.json. A module flashformer does not
    implement (Dense, a weighted-mean or last-token pooling, ...) is refused by name."""
    folder = Path(folder)
    if not (folder / "modules.json").is_file():
        return None
    modules = _json(folder / "modules.json")
    kinds = {m.get("type", "").removeprefix(ST_MODULE): m for m in modules}
    unsupported = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if unsupported or "Transformer" not in kinds:
        raise ValueError(
            f"{folder / 'modules.json'}: flashformer reads Transformer, Pooling and Normalize modules; "
            f"got {[m.get('type') for m in modules]}"
        )
    transformer = folder / kinds["Transformer"].get("path", "")
    settings = transformer / "sentence_bert_config.json"
    max_length = _json(settings).get("max_seq_length") if settings.is_file() else None
    modes = ("mean",)
    if "Pooling" in kinds:
        config = _json(folder / kinds["Pooling"]["path"] / "config.json")
        used = [flag for flag in ST_UNSUPPORTED_FLAGS if config.get(flag)]
        if used:
            raise ValueError(
                f"{folder}: pooling {used} is not implemented; flashformer pools {list(ST_POOLING_FLAGS)}"
            )
        modes = tuple(mode for mode, flag in ST_POOLING_FLAGS.items() if config.get(flag))
        if not modes:
            raise ValueError(f"{folder / kinds['Pooling']['path'] / 'config.json'} turns on no pooling mode")
    return transformer, Pooling(modes, "Normalize" in kinds, max_length)


def write_sentence_transformers(folder: str | Path, pooling: Pooling, dimension: int) -> None:
    """modules.json, 1_Pooling/config.json, sentence_bert_config.json (and 2_Normalize/) beside a
    model saved with save_pretrained, so that sentence-transformers pools as flashformer does."""
    folder = Path(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": ST_MODULE + "Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": ST_MODULE + "Pooling"},
    ]
    if pooling.normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": ST_MODULE + "Normalize"})
        (folder / "2_Normalize").mkdir(parents=True, exist_ok=True)
    config = {"word_embedding_dimension": dimension}
    config |= {flag: mode in pooling.modes for mode, flag in ST_POOLING_FLAGS.items()}
    config |= dict.fromkeys(ST_UNSUPPORTED_FLAGS, False)
    write_atomic(folder / "modules.json", json.dumps(modules, indent=2) + "\n")
    write_atomic(folder / "1_Pooling" / "config.json", json.dumps(config, indent=2) + "\n")
    settings = {"max_seq_length": pooling.max_length, "do_lower_case": False}
    write_atomic(folder / "sentence_bert_config.json", json.dumps(settings, indent=2) + "\n")


# ---- the encoder ----


class SentenceEncoder:
    """An encoder, its tokenizer and its pooling: texts in, vectors out."""

    def __init__(self, model: EncoderModel, tokenizer, pooling: Pooling):
        if not isinstance(model, EncoderModel):
            raise TypeError(f"sentence embeddings need an encoder (BERT-style); got a {type(model).__name__}")
        config = model.config
        if config.mlm_head or config.pooler or config.task is not None:  # heads the vectors never read
            model = rebuild(model, config.replace(task=None, mlm_head=False, pooler=False))
        self.model, self.tokenizer, self.pooling = model.eval(), tokenizer, pooling
        positions = config.max_seq_len if config.position == "learned" else None
        self.max_length = min(x for x in (pooling.max_length, positions, 1 << 30) if x is not None)

    @classmethod
    def from_pretrained(cls, path: str | Path, pooling: Pooling | None = None) -> SentenceEncoder:
        """From a sentence-transformers or Hugging Face folder (with tokenizer.json), a run of
        `flashformer train` / `finetune`, or one of its checkpoints. pooling: instead of the
        folder's."""
        path, stored = read_pooling(path)
        model, tokenizer = load(path)
        return cls(model, tokenizer, pooling or stored or Pooling())

    @property
    def dimension(self) -> int:
        return self.model.config.d_model * len(self.pooling.modes)

    @torch.no_grad()
    def encode(
        self, texts: list[str], batch_size: int = 32, show_progress: bool = False, chunk: int = 8192
    ) -> np.ndarray:
        """(len(texts), dimension) float32: each text cut to max_length tokens, batched by
        length (chunk texts at a time are sorted, so memory stays flat for a long list)."""
        from tqdm import tqdm

        if isinstance(texts, str):
            raise TypeError("encode() takes a list of texts; got one string (wrap it in a list)")
        out = np.empty((len(texts), self.dimension), dtype=np.float32)
        pad_id = pad_id_of(self.tokenizer)
        device = next(self.model.parameters()).device
        with tqdm(total=len(texts), desc="embed", unit="text", disable=not show_progress) as progress:
            for start in range(0, len(texts), chunk):
                ids = encode_texts(self.tokenizer, list(texts[start : start + chunk]), self.max_length)
                for indices in batches_by_length([len(i) for i in ids], batch_size):
                    batch = pad_batch([ids[i] for i in indices], pad_id)
                    batch = {k: v.to(device) for k, v in batch.items()}
                    vectors = embed(self.model, batch, self.pooling)
                    out[[start + i for i in indices]] = vectors.float().cpu().numpy()
                    progress.update(len(indices))
        return out

    def save_pretrained(self, folder: str | Path) -> None:
        """A folder transformers and sentence-transformers load: the model, the tokenizer, the pooling."""
        self.model.save_pretrained(folder)
        self.tokenizer.save(folder)
        write_sentence_transformers(folder, self.pooling, self.dimension)


def read_pooling(path: str | Path) -> tuple[Path, Pooling | None]:
    """(where the model itself is, the pooling stored with it or None): a sentence-transformers
    folder's (its Transformer module may sit in a subfolder), or the "embedding" entry of a
    flashformer checkpoint's config.json (a retrieval fine-tuning run's)."""
    path = Path(path)
    found = read_sentence_transformers(path) if path.is_dir() else None
    if found is not None:
        return found
    kind, where = locate(path)
    config = where / "config.json"
    if kind == "checkpoint" and config.is_file():
        stored = _json(config).get("embedding")
        if stored is not None:
            return path, Pooling.from_dict(stored)
    return path, None
