"""Task heads (task_heads.py): transformers' BertForSequenceClassification and
BertForTokenClassification from small configs with every parameter perturbed, loaded by
flashformer: logits and losses within 1e-4 on a padded batch, for every problem type; saved by
flashformer and loaded back by transformers; a head put on a pretrained encoder as transformers
initializes it; the heads on a non-BERT encoder against the same computation written out."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers import VOCAB, hf_config, perturbed
from transformers import BertForSequenceClassification, BertForTokenClassification, BertModel

import flashformer
from flashformer.model.config import ModelConfig
from flashformer.model.heads import pool

transformers.logging.set_verbosity_error()
TOLERANCE = 1e-4
BATCH, LENGTH = 3, 13


def inputs():
    torch.manual_seed(2)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH))
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, 9:] = 0  # right padding
    mask[2, 4:] = 0
    types = torch.zeros(BATCH, LENGTH, dtype=torch.long)
    types[:, 6:] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def loaded(theirs, tmp_path):
    theirs.save_pretrained(tmp_path / "theirs")
    return flashformer.from_pretrained(tmp_path / "theirs")


LABELS = ["cat", "dog", "eel"]
# (transformers config changes, the labels to score, problem_type expected in the loss)
SEQUENCE_CASES = {
    "single-label": (dict(id2label=dict(enumerate(LABELS))), torch.tensor([2, 0, 1])),
    "multi-label": (
        dict(num_labels=3, problem_type="multi_label_classification"),
        torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]),
    ),
    "multi-label-inferred": (
        dict(num_labels=3),
        torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1, 1]]),
    ),
    "regression": (dict(num_labels=1), torch.tensor([0.5, -1.25, 2.0])),
    "regression-2": (dict(num_labels=2, problem_type="regression"), torch.randn(3, 2)),
}


@pytest.mark.parametrize("case", sorted(SEQUENCE_CASES))
def test_sequence_classification_matches_transformers(case, tmp_path):
    changes, labels = SEQUENCE_CASES[case]
    theirs = perturbed(BertForSequenceClassification(hf_config("bert", **changes)))
    ours = loaded(theirs, tmp_path)
    assert ours.config.task == "sequence-classification" and ours.config.num_labels == theirs.num_labels
    batch = inputs()
    with torch.no_grad():
        expected = theirs(**batch, labels=labels)
        got = ours(**batch, labels=labels)
    assert got.logits.shape == (BATCH, theirs.num_labels)
    assert (got.logits - expected.logits).abs().max() <= TOLERANCE
    assert abs(got.loss.item() - expected.loss.item()) <= TOLERANCE
    if case == "single-label":
        assert ours.config.labels == LABELS


def test_token_classification_matches_transformers(tmp_path):
    theirs = perturbed(BertForTokenClassification(hf_config("bert", num_labels=5)))
    ours = loaded(theirs, tmp_path)
    assert ours.config.task == "token-classification" and ours.pooler is None  # as transformers: no pooler
    batch = inputs()
    labels = torch.randint(0, 5, (BATCH, LENGTH)).masked_fill(batch["attention_mask"] == 0, -100)
    labels[0, 3] = -100  # a later sub-token of a word
    with torch.no_grad():
        expected = theirs(**batch, labels=labels)
        got = ours(**batch, labels=labels)
    assert got.logits.shape == (BATCH, LENGTH, 5)
    real = batch["attention_mask"].bool()
    assert (got.logits[real] - expected.logits[real]).abs().max() <= TOLERANCE
    assert (got.logits - expected.logits).abs().max() <= TOLERANCE  # padded positions too
    assert abs(got.loss.item() - expected.loss.item()) <= TOLERANCE


@pytest.mark.parametrize("kind", ["sequence", "token"])
def test_saved_heads_load_back_into_transformers(kind, tmp_path):
    cls = BertForSequenceClassification if kind == "sequence" else BertForTokenClassification
    theirs = perturbed(cls(hf_config("bert", id2label=dict(enumerate(LABELS)), classifier_dropout=0.2)))
    ours = loaded(theirs, tmp_path)
    ours.save_pretrained(tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["architectures"] == [cls.__name__]
    assert config["id2label"] == {"0": "cat", "1": "dog", "2": "eel"} and config["label2id"]["eel"] == 2
    back = cls.from_pretrained(tmp_path / "ours").eval()
    assert back.config.classifier_dropout == 0.2 and back.config.id2label[1] == "dog"
    batch = inputs()
    with torch.no_grad():
        assert (back(**batch).logits - theirs(**batch).logits).abs().max() <= TOLERANCE


def test_a_head_on_a_pretrained_encoder_is_initialized_as_transformers_does(tmp_path):
    encoder = perturbed(BertModel(hf_config("bert", initializer_range=0.05)))
    encoder.save_pretrained(tmp_path / "encoder")
    torch.manual_seed(0)
    ours = flashformer.add_task_head(
        flashformer.from_pretrained(tmp_path / "encoder"), "sequence-classification", labels=LABELS
    )
    theirs = BertForSequenceClassification.from_pretrained(tmp_path / "encoder", num_labels=3).eval()
    # the encoder (embeddings, blocks, pooler) is kept exactly: the pooled states agree
    batch = inputs()
    with torch.no_grad():
        assert (ours.pooler.dense.weight - theirs.bert.pooler.dense.weight).abs().max() == 0
        hidden = ours(**batch)
    assert hidden.logits.shape == (BATCH, 3) and ours.mlm_head is None
    # the new classifier as transformers initializes it: N(0, initializer_range), bias 0
    for weight, bias in (
        (ours.task_head.classifier.weight, ours.task_head.classifier.bias),
        (theirs.classifier.weight, theirs.classifier.bias),
    ):
        assert torch.equal(bias, torch.zeros(3))
        assert abs(weight.std().item() - 0.05) < 0.015 and abs(weight.mean().item()) < 0.015
    # a token classifier drops the pooler, as BertForTokenClassification has none
    tagger = flashformer.add_task_head(
        flashformer.from_pretrained(tmp_path / "encoder"), "token-classification", num_labels=4
    )
    assert tagger.pooler is None and tagger.config.num_labels == 4


def test_build_with_a_task_decides_the_heads():
    model = flashformer.build("bert-tiny", task="sequence-classification", num_labels=3)
    assert model.mlm_head is None and model.pooler is not None and model.config.labels is None
    model = flashformer.build(
        "bert-tiny", task="sequence-classification", labels=LABELS, classifier_pooling="mean"
    )
    assert model.pooler is None and model.config.num_labels == 3
    with pytest.raises(ValueError, match="ModelConfig.labels must name each of the num_labels=2"):
        flashformer.build("bert-tiny", task="token-classification", num_labels=2, labels=LABELS)
    with pytest.raises(ValueError, match="task='token-classification' needs arch 'encoder'"):
        flashformer.build("gpt2-tiny", task="token-classification")
    with pytest.raises(ValueError, match="classifier_pooling must be one of"):
        flashformer.build("bert-tiny", task="sequence-classification", classifier_pooling="last")


@pytest.mark.parametrize("pooling", ["cls", "mean", "max"])
def test_heads_on_another_encoder_compute_what_they_say(pooling):
    """A pre-norm RoPE / RMSNorm encoder (no HF counterpart): the heads against the base model's
    hidden states pooled, dropped out (eval: not at all) and projected, written out here."""
    base = ModelConfig(
        arch="encoder",
        vocab_size=VOCAB,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=48,
        position="rope",
        norm="rmsnorm",
        mlm_head=False,
        dropout=0.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    encoder = perturbed(flashformer.build(base))
    classifier = flashformer.add_task_head(
        encoder, "sequence-classification", num_labels=3, classifier_pooling=pooling
    )
    tagger = flashformer.add_task_head(encoder, "token-classification", num_labels=4)
    perturbed(classifier.task_head, seed=3), perturbed(tagger.task_head, seed=4)  # the heads only
    batch = inputs()
    del batch["token_type_ids"]
    with torch.no_grad():
        hidden = encoder(**batch).last_hidden_state.double()
        real = batch["attention_mask"].bool()
        if pooling == "cls":
            vector = hidden[:, 0]
        elif pooling == "mean":
            vector = (hidden * real[..., None]).sum(1) / real.sum(1, keepdim=True)
        else:
            vector = torch.stack([hidden[row][real[row]].max(0).values for row in range(BATCH)])
        head = classifier.task_head.classifier
        expected = vector @ head.weight.double().T + head.bias.double()
        got = classifier(**batch).logits.double()
        assert (got - expected).abs().max() <= TOLERANCE
        head = tagger.task_head.classifier
        expected = hidden @ head.weight.double().T + head.bias.double()
        assert (tagger(**batch).logits.double() - expected)[real].abs().max() <= TOLERANCE


def test_pool_ignores_padding_and_matches_sentence_transformers_formulas():
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert torch.allclose(pool(hidden, mask, "mean")[0], hidden[0, :3].mean(0))
    assert torch.allclose(pool(hidden, mask, "mean_sqrt_len")[0], hidden[0, :3].sum(0) / 3**0.5)
    assert torch.equal(pool(hidden, mask, "max")[0], hidden[0, :3].max(0).values)
    assert torch.equal(pool(hidden, mask, "cls"), hidden[:, 0])
    assert torch.allclose(pool(hidden, None, "mean"), hidden.mean(1))
    with pytest.raises(ValueError, match="pooling must be one of"):
        pool(hidden, mask, "first")


def test_bad_labels_and_unsavable_heads_are_refused(tmp_path):
    model = flashformer.build("bert-tiny", task="sequence-classification", num_labels=3, vocab_size=VOCAB)
    batch = inputs()
    with pytest.raises(ValueError, match=r"labels must be in \[0, num_labels=3\); got 3"):
        model(**batch, labels=torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match=r"labels must have shape \(3,\)"):
        model(**batch, labels=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="multi-label labels must have shape"):
        model(**batch, labels=torch.ones(3, 2))
    tagger = flashformer.build("bert-tiny", task="token-classification", num_labels=3, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"labels must be in \[0, num_labels=3\) or -100"):
        tagger(**batch, labels=torch.full((BATCH, LENGTH), 7))
    mean = flashformer.build("bert-tiny", task="sequence-classification", classifier_pooling="mean")
    with pytest.raises(ValueError, match="classifier_pooling='mean' cannot be saved"):
        mean.save_pretrained(tmp_path / "mean")
    # a classifier whose config.json does not say which head it is
    theirs = BertForSequenceClassification(hf_config("bert"))
    theirs.save_pretrained(tmp_path / "unnamed")
    config = json.loads((tmp_path / "unnamed" / "config.json").read_text())
    config["architectures"] = ["BertForMultipleChoice"]
    (tmp_path / "unnamed" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="names none of the heads flashformer has"):
        flashformer.from_pretrained(tmp_path / "unnamed")


def test_sequence_classification_gradients_reach_the_encoder():
    model = flashformer.build("bert-tiny", task="sequence-classification", num_labels=3, vocab_size=VOCAB)
    batch = inputs()
    loss = model(**batch, labels=torch.tensor([0, 1, 2])).loss
    loss.backward()
    assert loss.dtype == torch.float32
    assert all(p.grad is not None for p in model.parameters())  # pooler, blocks, embeddings
