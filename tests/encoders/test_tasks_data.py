"""Task datasets: the JSON-lines readers and their errors, and the three stdlib tasks
(labels as ast and tokenize give them, no leak across splits, the same on every run)."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import keyword
import os
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

import pytest

from flashformer.encoders import datasets, python_source, stdlib_tasks
from flashformer.encoders.datasets import PairExample, TaggedExample, TextExample
from flashformer.train import corpus

# ---- readers ----


def write_lines(path: Path, lines: list) -> Path:
    """Each entry a JSON-encoded record, or a raw string written as it is."""
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_text_reader_reads_labels_of_each_kind(tmp_path):
    path = write_lines(
        tmp_path / "t.jsonl", [{"text": "a b", "label": "pos", "id": 7}, "", {"text": "c", "label": "neg"}]
    )
    assert datasets.read_text_examples(path) == [TextExample("a b", "pos"), TextExample("c", "neg")]
    assert datasets.read_text_examples(path)[1].source == "t.jsonl:3"  # the blank line still counts
    ints = write_lines(tmp_path / "i.jsonl", [{"text": "x", "label": 2}, {"text": "y", "label": 0}])
    assert [e.label for e in datasets.read_text_examples(ints)] == [2, 0]
    multi = write_lines(
        tmp_path / "m.jsonl", [{"text": "x", "label": ["b", "a"]}, {"text": "y", "label": []}]
    )
    assert [e.label for e in datasets.read_text_examples(multi)] == [("b", "a"), ()]


def test_read_task_takes_labels_from_training_in_sorted_order(tmp_path):
    train = write_lines(
        tmp_path / "train.jsonl", [{"text": f"t{i}", "label": label} for i, label in enumerate("cab")]
    )
    test = write_lines(tmp_path / "test.jsonl", [{"text": "u", "label": "b"}])
    task = datasets.read_task("classification", train, test=test)
    assert task.kind == "classification" and task.labels == ["a", "b", "c"] and task.label_ids["c"] == 2
    assert task.validation == [] and task.test == [TextExample("u", "b")]
    ints = write_lines(tmp_path / "ints.jsonl", [{"text": "x", "label": 10}, {"text": "y", "label": 9}])
    assert datasets.read_task("classification", ints).labels == [9, 10]  # numerically, not "10" < "9"
    multi = write_lines(
        tmp_path / "multi.jsonl", [{"text": "x", "label": ["z", "y"]}, {"text": "w", "label": ["y"]}]
    )
    task = datasets.read_task("classification", multi)
    assert (
        task.kind == "multilabel"
        and task.labels == ["y", "z"]
        and task.label_counts("train") == {"y": 2, "z": 1}
    )


def test_read_task_for_tags_and_pairs(tmp_path):
    bio = write_lines(
        tmp_path / "ner.jsonl",
        [
            {"tokens": ["Ada", "Lovelace", "wrote"], "tags": ["B-PER", "I-PER", "O"]},
            {"tokens": ["Rome"], "tags": ["B-LOC"]},
        ],
    )
    task = datasets.read_task("tagging", bio, validation=bio)
    assert task.tag_scheme == "bio" and task.labels == ["O", "B-LOC", "B-PER", "I-PER"]
    assert task.train[0] == TaggedExample(["Ada", "Lovelace", "wrote"], ["B-PER", "I-PER", "O"])
    plain = write_lines(tmp_path / "pos.jsonl", [{"tokens": ["x", "="], "tags": ["NAME", "OP"]}])
    assert datasets.read_task("tagging", plain).tag_scheme == "plain"
    pairs = write_lines(tmp_path / "pairs.jsonl", [{"query": "q", "document": "d"}])
    task = datasets.read_task("retrieval", pairs)
    assert task.train == [PairExample("q", "d")] and task.labels == []


@pytest.mark.parametrize(
    "reader, lines, bad_line, message",
    [
        ("text", [{"text": "a", "label": "x"}, '{"text": "b", "label": '], 2, "invalid JSON"),
        ("text", [{"text": "a", "label": "x"}, '["text", "label"]'], 2, "a JSON array"),
        ("text", [{"text": "a", "label": "x"}, {"txt": "b", "label": "x"}], 2, "missing key 'text'"),
        ("text", [{"text": "   ", "label": "x"}], 1, "'text' is empty"),
        ("text", [{"text": 3, "label": "x"}], 1, "'text' is a JSON integer"),
        ("text", [{"text": "a"}], 1, "missing key 'label'"),
        ("text", [{"text": "a", "label": True}], 1, "'label' is a JSON boolean"),
        ("text", [{"text": "a", "label": 1.5}], 1, "'label' is a JSON number"),
        ("text", [{"text": "a", "label": "x"}, {"text": "b", "label": 1}], 2, "a JSON string on line 1"),
        ("text", [{"text": "a", "label": ["x"]}, {"text": "b", "label": "x"}], 2, "an array on line 1"),
        ("text", [{"text": "a", "label": ["x", "x"]}], 1, "repeats a label"),
        ("text", [{"text": "a", "label": ["x", 2]}], 1, "'label'[1] is a JSON integer"),
        (
            "tags",
            [{"tokens": ["a", "b"], "tags": ["O", "O"]}, {"tokens": ["a", "b"], "tags": ["O"]}],
            2,
            "2 tokens but 1 tags",
        ),
        ("tags", [{"tokens": [], "tags": []}], 1, "'tokens' is an empty array"),
        ("tags", [{"tokens": "a b", "tags": ["O"]}], 1, "'tokens' is a JSON string"),
        ("tags", [{"tokens": ["a", " "], "tags": ["O", "O"]}], 1, "'tokens'[1] is empty or only whitespace"),
        ("tags", [{"tokens": ["a"], "tags": [None]}], 1, "'tags'[0] is a JSON null"),
        ("pairs", [{"query": "q", "document": "d"}, {"query": "q"}], 2, "missing key 'document'"),
    ],
)
def test_reader_errors_name_file_line_and_expectation(tmp_path, reader, lines, bad_line, message):
    path = write_lines(tmp_path / "bad.jsonl", lines)
    read = {
        "text": datasets.read_text_examples,
        "tags": datasets.read_tagged_examples,
        "pairs": datasets.read_pair_examples,
    }[reader]
    with pytest.raises(ValueError) as error:
        read(path)
    text = str(error.value)
    assert text.startswith(f"{path}, line {bad_line}:") and message in text and "expected" in text


def test_evaluation_files_are_read_against_the_training_labels(tmp_path):
    train = write_lines(tmp_path / "train.jsonl", [{"text": "a", "label": "x"}, {"text": "b", "label": "y"}])
    test = write_lines(tmp_path / "test.jsonl", [{"text": "a", "label": "x"}, {"text": "c", "label": "z"}])
    with pytest.raises(
        ValueError, match=r"test.jsonl, line 2: label \"z\" is not among the training labels \['x', 'y'\]"
    ):
        datasets.read_task("classification", train, test=test)
    multi = write_lines(tmp_path / "multi.jsonl", [{"text": "a", "label": ["x"]}])
    with pytest.raises(ValueError, match=r"test.jsonl, line 1: .*expected an array of labels"):
        datasets.read_task("classification", multi, test=test)
    tags_train = write_lines(tmp_path / "tt.jsonl", [{"tokens": ["a"], "tags": ["B-PER"]}])
    tags_test = write_lines(tmp_path / "tv.jsonl", [{"tokens": ["a", "b"], "tags": ["B-PER", "B-ORG"]}])
    with pytest.raises(ValueError, match=r"tv.jsonl, line 1: tag 'B-ORG' \(of token 1, 'b'\) is not among"):
        datasets.read_task("tagging", tags_train, validation=tags_test)


def test_reader_rejects_bytes_that_are_not_utf8_and_empty_files(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"text": "ok", "label": "x"}\n{"text": "caf\xe9", "label": "x"}\n')
    with pytest.raises(ValueError, match=r"latin.jsonl, line 2: not UTF-8"):
        datasets.read_text_examples(path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="holds no examples"):
        datasets.read_pair_examples(empty)
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        datasets.read_text_examples(tmp_path / "nowhere.jsonl")
    with pytest.raises(ValueError, match="kind must be one of"):
        datasets.read_task("ner", path)


def test_tag_schemes_and_their_order():
    assert datasets.tag_scheme(["O", "B-LOC", "I-LOC"]) == "bio"
    assert datasets.tag_scheme(["O", "LOC", "B-LOC"]) == "plain"
    assert datasets.tag_scheme(["O"]) == "plain"
    assert datasets.sorted_tags(["I-PER", "O", "B-PER", "B-LOC"]) == ["O", "B-LOC", "B-PER", "I-PER"]
    assert datasets.sorted_tags(["OP", "NAME", "O"]) == ["O", "NAME", "OP"]


# ---- functions found with ast ----

SOURCE = '''\
import functools


@functools.cache
def plain(x):
    return x + 1


class Box:
    """A box."""

    def method(self, y):
        """Add y to the box.

        More words.
        """

        total = self.value + y  # a comment
        return total

    async def fetch(self):
        await self.ready()

    def placeholder(self):
        """Nothing yet."""
        ...


def outer():
    def inner():
        return "é"
    return inner


def squeezed(): "doc on the def line"; return 2
'''


def test_functions_in_gives_exact_code_without_the_docstring(tmp_path):
    functions = {f.name: f for f in python_source.functions_in(SOURCE, "m.py")}
    assert list(functions) == [
        "plain",
        "Box.method",
        "Box.fetch",
        "Box.placeholder",
        "outer",
        "outer.<locals>.inner",
    ]
    assert functions["plain"].code == "def plain(x):\n    return x + 1"  # the decorator is not part of it
    assert functions["plain"].line == 5 and functions["plain"].docstring is None
    assert functions["Box.method"].code == (
        "def method(self, y):\n    total = self.value + y  # a comment\n    return total"
    )
    assert functions["Box.method"].docstring == "Add y to the box.\n\nMore words."
    assert functions["Box.method"].body_lines == 2
    assert functions["Box.fetch"].code == "async def fetch(self):\n    await self.ready()"
    assert functions["Box.placeholder"].body_lines == 0
    assert functions["outer.<locals>.inner"].code == 'def inner():\n    return "é"'
    assert python_source.functions_in("def broken(:\n") == []


@pytest.mark.parametrize("name", ["json/decoder.py", "email/utils.py", "asyncio/locks.py"])
def test_functions_in_agrees_with_ast_on_stdlib_files(name):
    """Against ast directly: a function without a docstring is ast.get_source_segment's text;
    with one, the code parses back to the same statements minus the docstring."""
    document = next(d for d in corpus.stdlib_corpus() if d.name == name)
    text = corpus.read_text(document.path)
    nodes = {
        node.lineno: node
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    functions = python_source.functions_in(text, name)
    assert len(functions) == len(nodes) > 5
    for function in functions:
        node = nodes[function.line]
        assert function.docstring == ast.get_docstring(node)
        if function.docstring is None:
            assert function.code == textwrap.dedent(ast.get_source_segment(text, node, padded=True))
        else:
            reparsed = ast.parse(function.code).body[0]
            assert [ast.dump(s) for s in reparsed.body] == [ast.dump(s) for s in node.body[1:]]


def test_capped_keeps_whole_lines_within_both_limits():
    text = "\n".join(f"line {i:02d}" for i in range(20))  # 7 characters a line
    assert stdlib_tasks.capped(text, max_lines=3, max_chars=1000) == "line 00\nline 01\nline 02"
    assert stdlib_tasks.capped(text, max_lines=100, max_chars=23) == "line 00\nline 01\nline 02"
    assert stdlib_tasks.capped(text, max_lines=100, max_chars=22) == "line 00\nline 01"
    assert stdlib_tasks.capped("x" * 50, max_lines=5, max_chars=10) == "x" * 10


# ---- tokens tagged by tokenize ----

TOKENS_SOURCE = '''\
x = 1_000 + 0x1f  # count
if x is not None and match:
    s = """two
lines""" + f"{x!r}"
match = lambda _: [1.5,
    2j]
'''


if sys.version_info >= (3, 12):  # f-strings tokenize in parts: the parts are STRING, the rest as itself
    FSTRING_TOKENS = [
        ('f"', "STRING"),
        ("{", "OP"),
        ("x", "NAME"),
        ("!", "OP"),
        ("r", "NAME"),
        ("}", "OP"),
        ('"', "STRING"),
    ]
else:
    FSTRING_TOKENS = [('f"{x!r}"', "STRING")]


def test_tagged_lines_are_tokenize_and_keyword_verbatim():
    lines = python_source.tagged_lines(TOKENS_SOURCE)
    got = [(line.line, list(zip(line.tokens, line.tags))) for line in lines]
    assert got == [
        (
            1,
            [
                ("x", "NAME"),
                ("=", "OP"),
                ("1_000", "NUMBER"),
                ("+", "OP"),
                ("0x1f", "NUMBER"),
                ("# count", "COMMENT"),
            ],
        ),
        (
            2,
            [
                ("if", "KEYWORD"),
                ("x", "NAME"),
                ("is", "KEYWORD"),
                ("not", "KEYWORD"),
                ("None", "KEYWORD"),
                ("and", "KEYWORD"),
                ("match", "NAME"),
                (":", "OP"),
            ],
        ),
        # a string over two lines belongs to the line it starts on; what follows it, to the line it ends on
        (3, [("s", "NAME"), ("=", "OP"), ('"""two\nlines"""', "STRING")]),
        (4, [("+", "OP")] + FSTRING_TOKENS),
        (
            5,
            [
                ("match", "NAME"),
                ("=", "OP"),
                ("lambda", "KEYWORD"),
                ("_", "NAME"),
                (":", "OP"),
                ("[", "OP"),
                ("1.5", "NUMBER"),
                (",", "OP"),
            ],
        ),
        (6, [("2j", "NUMBER"), ("]", "OP")]),
    ]


def test_tagged_lines_drop_lines_with_error_tokens_and_untokenizable_text():
    if sys.version_info < (3, 12):  # from 3.12 tokenize calls "$" an OP
        lines = python_source.tagged_lines("a = 1\nb = $\nc = 2\n")
        assert [line.line for line in lines] == [1, 3]
    assert python_source.tagged_lines('s = """never closed\n') == []


@pytest.mark.parametrize("name", ["json/decoder.py", "email/_header_value_parser.py"])
def test_tagged_lines_hold_every_word_token_of_a_stdlib_file(name):
    text = corpus.read_text(next(d for d in corpus.stdlib_corpus() if d.name == name).path)
    layout = {"NEWLINE", "NL", "INDENT", "DEDENT", "ENDMARKER"}
    expected = [
        (
            t.start[0],
            t.string,
            "KEYWORD"
            if t.type == tokenize.NAME and t.string in keyword.kwlist
            else tokenize.tok_name[t.type],
        )
        for t in tokenize.generate_tokens(io.StringIO(text).readline)
        if tokenize.tok_name[t.type] not in layout
    ]
    got = [
        (line.line, token, tag)
        for line in python_source.tagged_lines(text)
        for token, tag in zip(line.tokens, line.tags)
    ]
    assert got == expected and {tag for _, _, tag in got} == set(python_source.TOKEN_TAGS)


def test_line_windows_respect_every_limit():
    lines = [python_source.TaggedLine(i, ["t"] * (i % 5 + 1), ["NAME"] * (i % 5 + 1)) for i in range(1, 40)]
    lines.append(python_source.TaggedLine(40, ["x" * 500], ["STRING"]))
    windows = python_source.line_windows(lines, max_lines=3, max_tokens=8, max_chars=7)
    assert all(len(w) <= 3 and sum(len(line.tokens) for line in w) <= 7 for w in windows)
    kept = [line.line for w in windows for line in w]
    assert kept == list(range(1, 40))  # every line that fits, in order; the 500-character one left out


# ---- splits ----


def documents(names: list[str]) -> list[corpus.Document]:
    return [corpus.Document(Path(name), name) for name in names]


def test_three_way_split_is_disjoint_stable_and_covers_all():
    docs = documents([f"pkg/m{i}.py" for i in range(300)])
    train, validation, test = stdlib_tasks.split_three_ways(docs, 0.1, 0.2, seed=1)
    names = [{d.name for d in split} for split in (train, validation, test)]
    assert sum(map(len, names)) == 300 and set.union(*names) == {d.name for d in docs}
    assert not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2])
    assert 15 <= len(validation) <= 50 and 40 <= len(test) <= 85
    again = stdlib_tasks.split_three_ways(list(reversed(docs)), 0.1, 0.2, seed=1)
    assert [[d.name for d in split] for split in again] == [
        [d.name for d in s] for s in (train, validation, test)
    ]
    with pytest.raises(ValueError, match="sum < 1"):
        stdlib_tasks.split_three_ways(docs, 0.5, 0.5)


def test_weighted_split_gives_each_split_its_share_of_the_weight():
    docs = documents(["a.py", "b.py", "c.py"])
    train, validation, test = stdlib_tasks.split_by_weight(
        docs, {"a.py": 147, "b.py": 69, "c.py": 41}, 0.15, 0.15
    )
    assert [d.name for d in train] == ["a.py"] and len(validation) == len(test) == 1
    docs = documents([f"m{i}.py" for i in range(40)])
    weights = {d.name: 1 + (i * 7) % 13 for i, d in enumerate(docs)}
    splits = stdlib_tasks.split_by_weight(docs, weights, 0.2, 0.1)
    total = sum(weights.values())
    shares = [sum(weights[d.name] for d in split) / total for split in splits]
    assert abs(shares[0] - 0.7) < 0.05 and abs(shares[1] - 0.2) < 0.05 and abs(shares[2] - 0.1) < 0.05


def test_classification_on_a_small_corpus(tmp_path):
    docs = []
    for package in ("alpha", "beta"):
        for i in range(4):
            path = tmp_path / package / f"m{i}.py"
            path.parent.mkdir(exist_ok=True)
            body = "\n\n".join(
                f"def {package}_{i}_{j}(x):\n    '''Doc.'''\n    return x * {j}" for j in range(5)
            )
            path.write_text(body + "\n")
            docs.append(corpus.Document(path, f"{package}/m{i}.py"))
    docs.append(corpus.Document(tmp_path / "top.py", "top.py"))  # a module outside a package: not used
    task = stdlib_tasks.stdlib_classification(packages=("alpha", "beta"), documents=docs, max_train=100)
    assert task.labels == ["alpha", "beta"]
    everything = task.train + task.validation + task.test
    assert len(everything) == 40 and all(e.text.startswith(f"def {e.label}_") for e in everything)
    assert all("Doc." not in e.text for e in everything)
    assert all(task.label_counts(split)["alpha"] > 0 for split in task.splits)
    with pytest.raises(ValueError, match=r"packages \['gamma'\] have no files"):
        stdlib_tasks.stdlib_classification(packages=("alpha", "gamma"), documents=docs)


def small_corpus(tmp_path, count: int = 6) -> list[corpus.Document]:
    docs = []
    for i in range(count):
        path = tmp_path / f"m{i}.py"
        path.write_text(
            f"def add_{i}(a, b):\n"
            f'    """Add two numbers\n    together, {i} times.\n\n    Returns their sum.\n    """\n'
            f"    total = a + b  # sum\n"
            f"    return total * {i}\n"
        )
        docs.append(corpus.Document(path, path.name))
    return docs


def test_tagging_and_retrieval_on_small_files(tmp_path):
    docs = small_corpus(tmp_path)
    tagging = stdlib_tasks.stdlib_tagging(documents=docs)
    windows = {e.source: e for split in tagging.splits.values() for e in split}
    assert len(windows) == 6 * 2 and all(split for split in tagging.splits.values())
    assert list(zip(windows["m3.py:1"].tokens, windows["m3.py:1"].tags)) == [
        ("def", "KEYWORD"),
        ("add_3", "NAME"),
        ("(", "OP"),
        ("a", "NAME"),
        (",", "OP"),
        ("b", "NAME"),
        (")", "OP"),
        (":", "OP"),
        ('"""Add two numbers\n    together, 3 times.\n\n    Returns their sum.\n    """', "STRING"),
        ("total", "NAME"),
        ("=", "OP"),
        ("a", "NAME"),
        ("+", "OP"),
        ("b", "NAME"),
        ("# sum", "COMMENT"),
    ]  # the 3-line window (def, docstring, total) ends; "return total * 3" starts the next
    assert windows["m3.py:8"].tags == ["KEYWORD", "NAME", "OP", "NUMBER"]
    retrieval = stdlib_tasks.stdlib_retrieval(documents=docs)
    pairs = {p.source: p for split in retrieval.splits.values() for p in split}
    assert len(pairs) == 6 and all(split for split in retrieval.splits.values())
    assert pairs["m3.py:1"] == PairExample(
        "Add two numbers together, 3 times.",
        "def add_3(a, b):\n    total = a + b  # sum\n    return total * 3",
    )
    # a summary too short, or one that repeats another, is not a query
    assert not any(stdlib_tasks.stdlib_retrieval(documents=docs, min_query_words=7).splits.values())
    copies = [corpus.Document(doc.path, f"copy/{doc.name}") for doc in docs]
    with_copies = stdlib_tasks.stdlib_retrieval(documents=docs + copies)
    assert sorted(p.query for split in with_copies.splits.values() for p in split) == sorted(
        p.query for p in pairs.values()
    )


# ---- the default tasks, built from the standard library ----


@pytest.fixture(scope="module")
def default_tasks():
    return {kind: build() for kind, build in stdlib_tasks.DEFAULT_TASKS.items()}


def source_file(example) -> str:
    return example.source.rsplit(":", 1)[0]


def example_key(example):
    if isinstance(example, TextExample):
        return example.text
    if isinstance(example, TaggedExample):
        return tuple(example.tokens)
    return example.query, example.document


@pytest.mark.parametrize("kind", ["classification", "tagging", "retrieval"])
def test_default_task_splits_share_no_file_and_no_input(default_tasks, kind):
    task = default_tasks[kind]
    splits = list(task.splits.values())
    assert all(splits)
    files = [{source_file(e) for e in split} for split in splits]
    inputs = [{example_key(e) for e in split} for split in splits]
    for a in range(3):
        for b in range(a + 1, 3):
            assert not files[a] & files[b]
            assert not inputs[a] & inputs[b]
    if kind != "classification":  # the generated codec tables are left out
        assert not any(f.startswith("encodings/") for split_files in files for f in split_files)
    if kind == "retrieval":  # neither half of a pair repeats, so in a batch query i has one answer
        queries = [p.query for split in splits for p in split]
        documents_ = [p.document for split in splits for p in split]
        assert len(set(queries)) == len(queries) and len(set(documents_)) == len(documents_)


def test_default_classification_is_the_functions_source(default_tasks):
    task = default_tasks["classification"]
    assert task.labels == sorted(stdlib_tasks.CLASSIFICATION_PACKAGES)
    assert len(task.train) > 2000 and len(task.test) > 500
    assert all(count > 0 for split in task.splits for count in task.label_counts(split).values())
    documents = {d.name: d for d in corpus.stdlib_corpus()}
    for example in task.test[::25]:
        file, line = example.source.rsplit(":", 1)
        assert example.label == file.split("/")[0]
        assert len(example.text) <= 480 and example.text.count("\n") < 12
        lines = corpus.read_text(documents[file].path).split("\n")
        def_line = lines[int(line) - 1]
        assert example.text.split("\n")[0] == def_line.strip()[:480]
        node = next(
            n
            for n in ast.walk(ast.parse("\n".join(lines)))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.lineno == int(line)
        )
        docstring = ast.get_docstring(node, clean=False)
        assert docstring is None or docstring not in example.text


def test_default_tagging_labels_are_tokenize_verbatim(default_tasks):
    task = default_tasks["tagging"]
    assert task.labels == list(python_source.TOKEN_TAGS) and task.tag_scheme == "plain"
    assert len(task.train) == 2000 and len(task.validation) == len(task.test) == 400
    assert all(task.label_counts(split)[tag] > 0 for split in task.splits for tag in task.labels)
    documents = {d.name: d for d in corpus.stdlib_corpus()}
    for example in task.test[::40]:
        file, line = example.source.rsplit(":", 1)
        tokens = [
            t
            for t in tokenize.generate_tokens(io.StringIO(corpus.read_text(documents[file].path)).readline)
            if t.start[0] >= int(line)
            and tokenize.tok_name[t.type] not in {"NEWLINE", "NL", "INDENT", "DEDENT"}
        ][: len(example.tokens)]
        assert example.tokens == [t.string for t in tokens]
        assert example.tags == [
            "KEYWORD"
            if keyword.iskeyword(t.string) and t.type == tokenize.NAME
            else tokenize.tok_name[t.type]
            for t in tokens
        ]


def test_default_retrieval_pairs_a_docstring_with_its_code(default_tasks):
    task = default_tasks["retrieval"]
    assert (len(task.train), len(task.validation), len(task.test)) == (1500, 300, 300)
    for pair in task.test[::20]:
        assert pair.document.startswith(("def ", "async def ")) and len(pair.query.split()) >= 4
        assert pair.query not in pair.document


DIGEST_SCRIPT = """
import hashlib, json
from flashformer.encoders import stdlib_tasks
small = {"max_train": 90, "max_validation": 27, "max_test": 27}
tasks = [
    stdlib_tasks.stdlib_classification(**small, packages=("http", "logging", "urllib")),
    stdlib_tasks.stdlib_tagging(**small),
    stdlib_tasks.stdlib_retrieval(**small),
]
records = [[task.labels] + [[repr(e), e.source] for split in task.splits.values() for e in split] for task in tasks]
print(hashlib.sha256(json.dumps(records).encode()).hexdigest())
"""


def test_default_tasks_are_the_same_on_every_run():
    """This process and another with its own hash seed (so set and dict orders differ) build
    the same examples in the same order."""
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(Path(__file__).parents[2]))
    run = subprocess.run(
        [sys.executable, "-c", DIGEST_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    here = io.StringIO()
    with contextlib.redirect_stdout(here):
        exec(DIGEST_SCRIPT, {})
    assert run.stdout.strip() == here.getvalue().strip() and len(here.getvalue().strip()) == 64
