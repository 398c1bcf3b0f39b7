"""The three default tasks, built from Python's standard library: no download, on every machine.

    stdlib_classification   which stdlib package a function comes from (sequence classification)
    stdlib_tagging          each token of a few source lines tagged as Python's tokenize sees it
    stdlib_retrieval        a docstring's summary finds its function's code (retrieval)

Every task is split by FILE, so a function never sits in two splits: tagging and retrieval
by a stable hash of the file's name (as corpus.split_documents does), classification by the
files' weight within each package (split_by_weight). Identical inputs found in two files (a
`__repr__` copied between modules) are kept only in the first split built, in the order
test, validation, train: evaluation sets stay whole and training loses the copy. Examples
come out in the same order on every run of one Python version; sizes are capped so that
each task builds in a few seconds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

from flashformer.encoders.datasets import PairExample, TaggedExample, TaskData, TextExample
from flashformer.encoders.python_source import (
    TOKEN_TAGS,
    docstring_summary,
    functions_in,
    line_windows,
    tagged_lines,
)
from flashformer.train import corpus

# Packages of 200+ functions that every CPython 3.11+ ships (including distributions that
# split tkinter/idlelib off), each a distinct domain: the class is learnable from the code's
# vocabulary, and the list is the same on every machine. Left out: json, html, re, csv
# (under 100 functions), encodings (codec boilerplate, near-identical across files),
# concurrent (97 functions in 3 files), tkinter/idlelib (not always installed),
# distutils/lib2to3 (removed in 3.12/3.13).
CLASSIFICATION_PACKAGES = (
    "asyncio",
    "email",
    "http",
    "importlib",
    "logging",
    "multiprocessing",
    "unittest",
    "urllib",
    "xml",
)


# Left out of the tagging and retrieval corpus: the codecs of encodings/ are 122 files
# generated from one template (cp437.py and cp850.py differ in their tables' numbers); they
# would make a tenth of a sample and put near-copies of one file in every split.
GENERATED_PACKAGES = ("encodings",)


def default_corpus() -> list[corpus.Document]:
    """The standard library's sources (corpus.stdlib_corpus) less GENERATED_PACKAGES."""
    return [doc for doc in corpus.stdlib_corpus() if doc.name.split("/")[0] not in GENERATED_PACKAGES]


def stable_score(key: str, seed: int = 0) -> float:
    """A number in [0, 1) from a string, the same on every machine and run (unlike hash())."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_three_ways(
    documents: list[corpus.Document], validation_fraction: float, test_fraction: float, seed: int = 0
) -> tuple[list[corpus.Document], list[corpus.Document], list[corpus.Document]]:
    """(train, validation, test) documents by the stable hash of their names.

    corpus.split_documents twice: test from all, then validation from the rest (its
    fraction rescaled), with seeds seed and seed + 1. A document's side depends only on its
    name, and each side gets one document when there are three or more. Each split comes
    back in the order of its documents' hashes: a stable shuffle, so capped splits sample
    files from the whole library rather than its alphabetical start.
    """
    if not (
        validation_fraction >= 0.0 and test_fraction >= 0.0 and validation_fraction + test_fraction < 1.0
    ):
        raise ValueError(
            f"validation_fraction and test_fraction must be >= 0 with a sum < 1; "
            f"got {validation_fraction} and {test_fraction}"
        )
    rest, test = corpus.split_documents(documents, test_fraction, seed)
    train, validation = corpus.split_documents(rest, validation_fraction / (1.0 - test_fraction), seed + 1)

    def hashed_order(split):
        return sorted(split, key=lambda doc: stable_score(doc.name, seed))

    return hashed_order(train), hashed_order(validation), hashed_order(test)


def split_by_weight(
    documents: list[corpus.Document],
    weights: dict[str, int],
    validation_fraction: float,
    test_fraction: float,
    seed: int = 0,
) -> tuple[list[corpus.Document], list[corpus.Document], list[corpus.Document]]:
    """(train, validation, test) documents holding about their fractions of the total weight.

    For a package of a few files of very different sizes (logging: 147, 69 and 41
    functions) a hash split gives one split most of the functions and another almost none;
    here the files, heaviest first (ties in hash order), each go to the split furthest below
    its share of the weight (ties to test, then validation), except that the last files go
    to splits still empty: each split with a share gets a file when there are enough.
    Deterministic, but unlike a hash split a file's side depends on the other files.
    weights: document name -> weight (its number of examples).
    """
    shares = (1.0 - validation_fraction - test_fraction, validation_fraction, test_fraction)
    if min(shares) < 0.0 or shares[0] <= 0.0:
        raise ValueError(
            f"validation_fraction and test_fraction must be >= 0 with a sum < 1; "
            f"got {validation_fraction} and {test_fraction}"
        )
    total = sum(weights[doc.name] for doc in documents)
    splits: tuple[list, list, list] = ([], [], [])
    held = [0, 0, 0]
    ordered = sorted(documents, key=lambda doc: (-weights[doc.name], stable_score(doc.name, seed)))
    for position, doc in enumerate(ordered):
        sides = [2, 1, 0]  # ties go to the first: test, then validation
        empty = [i for i in sides if not splits[i] and shares[i] > 0]
        if len(ordered) - position <= len(empty):  # the rest are needed to give each split a file
            sides = empty
        side = max(sides, key=lambda i: shares[i] * total - held[i])
        splits[side].append(doc)
        held[side] += weights[doc.name]
    return splits


def spread(items: list, count: int) -> list:
    """At most `count` items evenly spaced through the list (all of them if it is short)."""
    if len(items) <= count:
        return list(items)
    return [items[i * len(items) // count] for i in range(count)]


def round_robin(queues: list[list]):
    """The lists' items one from each in turn: a[0], b[0], a[1], b[1], ..."""
    for position in range(max((len(queue) for queue in queues), default=0)):
        for queue in queues:
            if position < len(queue):
                yield queue[position]


def capped(text: str, max_lines: int, max_chars: int) -> str:
    """The first whole lines of text within max_lines and max_chars (the first line is cut at
    max_chars if it alone is longer): an input a small encoder sees whole."""
    lines = text.split("\n")
    kept = [lines[0][:max_chars]]
    size = len(kept[0])
    for line in lines[1:max_lines]:
        size += 1 + len(line)
        if size > max_chars:
            break
        kept.append(line)
    return "\n".join(kept)


def _read(document: corpus.Document) -> str:
    # read_text opens in universal-newline mode: lines are separated by "\n" only, as ast counts them
    return corpus.read_text(document.path)


# ---- building splits ----


def _fill_split(
    documents: Iterable[corpus.Document],
    candidates: Callable[[corpus.Document], list],
    key: Callable,
    limit: int,
    per_document: int,
    seen: set,
) -> list:
    """Up to `limit` examples, at most per_document from each document (evenly spread through
    it), skipping any whose key is in `seen` (an earlier split's, or a copy in this one).
    Every candidate of a document read joins `seen`, taken or not: a copy elsewhere of an
    evaluation file's example is left out of training even if the cap left out the example."""
    examples = []
    for document in documents:
        if len(examples) >= limit:
            break
        fresh = []
        for example in candidates(document):
            if key(example) not in seen:
                seen.add(key(example))
                fresh.append(example)
        examples += spread(fresh, min(per_document, limit - len(examples)))
    return examples


def _build_splits(documents, fractions, seed, limits, candidates, key, per_document):
    """Test, then validation, then train, so a copy across splits stays in the evaluation side."""
    train_docs, validation_docs, test_docs = split_three_ways(documents, *fractions, seed=seed)
    seen: set = set()
    test = _fill_split(test_docs, candidates, key, limits[2], per_document, seen)
    validation = _fill_split(validation_docs, candidates, key, limits[1], per_document, seen)
    train = _fill_split(train_docs, candidates, key, limits[0], per_document, seen)
    return train, validation, test


# ---- the three tasks ----


def stdlib_classification(
    *,
    max_train: int = 3600,
    max_validation: int = 900,
    max_test: int = 900,
    packages: tuple[str, ...] = CLASSIFICATION_PACKAGES,
    max_lines: int = 12,
    max_chars: int = 480,
    validation_fraction: float = 0.15,
    test_fraction: float = 0.15,
    seed: int = 0,
    documents: list[corpus.Document] | None = None,
) -> TaskData:
    """Sequence classification: the stdlib package (asyncio, email, ...) a function comes from.

    The input is the function's code without its docstring, capped to its first max_lines
    lines and max_chars characters (12 and 480: at most about 210 WordPiece pieces of an
    uncased BERT vocabulary, median 61, inside a small encoder's 256). The docstring goes because it is prose that often names its package
    ("Return the email message ...") or a sibling module; without it the class must be read
    from the code, and the cap keeps more code. Functions whose body is only pass or ...
    are left out.

    Files are split per package by split_by_weight (each package's functions divided about
    70/15/15 at file granularity), so the test set holds functions from files never seen
    in training, and each class is in every split. Each split takes up to
    max_<split> // len(packages) functions per package, one from each of its files in
    turn (so a 3000-line module does not make up the class), which balances the classes.
    documents: another corpus (a package is the first folder of a document's name).
    """
    documents = corpus.stdlib_corpus() if documents is None else documents
    by_package: dict[str, list[corpus.Document]] = {package: [] for package in packages}
    for document in documents:
        top = document.name.split("/")[0]
        if "/" in document.name and top in by_package:
            by_package[top].append(document)
    empty = [package for package, files in by_package.items() if not files]
    if empty:
        raise ValueError(f"packages {empty} have no files in the corpus; expected each of {list(packages)}")

    def candidates(document):
        found = [f for f in functions_in(_read(document), document.name) if f.body_lines > 0]
        return sorted(found, key=lambda f: stable_score(f"{f.file}:{f.name}:{f.line}", seed))

    functions = {doc.name: candidates(doc) for files in by_package.values() for doc in files}
    weights = {name: len(found) for name, found in functions.items()}
    per_split = {
        package: split_by_weight(files, weights, validation_fraction, test_fraction, seed)
        for package, files in by_package.items()
    }

    seen: set[str] = set()
    splits = {}
    for index, split in ((2, "test"), (1, "validation"), (0, "train")):
        per_class = (max_train, max_validation, max_test)[index] // len(packages)
        examples = []
        for package in packages:
            queues = [functions[document.name] for document in per_split[package][index]]
            taken = 0
            for function in round_robin(queues):
                if taken == per_class:
                    break
                text = capped(function.code, max_lines, max_chars)
                if text not in seen:
                    seen.add(text)
                    examples.append(TextExample(text, package, f"{function.file}:{function.line}"))
                    taken += 1
        splits[split] = examples
    return TaskData(
        "stdlib-classification",
        "classification",
        splits["train"],
        splits["validation"],
        splits["test"],
        labels=sorted(packages),
        description="Which standard-library package a function's code (docstring removed) comes from.",
    )


def stdlib_tagging(
    *,
    max_train: int = 2000,
    max_validation: int = 400,
    max_test: int = 400,
    max_lines: int = 3,
    max_tokens: int = 48,
    max_chars: int = 160,
    windows_per_file: int = 12,
    validation_fraction: float = 0.1,
    test_fraction: float = 0.1,
    seed: int = 0,
    documents: list[corpus.Document] | None = None,
) -> TaskData:
    """Token classification: each token of a window of source lines tagged NAME, KEYWORD, OP,
    NUMBER, STRING or COMMENT, exactly as tokenize (and keyword.iskeyword) says.

    Tokens are tokenize's exact strings (layout tokens dropped, see tagged_lines); a window
    is up to max_lines consecutive lines that hold tokens, max_tokens tokens and max_chars
    characters (3, 48, 160: at most 109 WordPiece pieces of an uncased BERT vocabulary with
    [CLS] and [SEP], median 35), so it fits 128. Tags are plain, one per token: every tokenize token is a whole
    entity, so BIO would write B- before every tag and never I-, and the per-tag token F1
    (metrics.token_scores) is the entity F1. Up to windows_per_file windows are taken from
    each file, spread through it; identical windows are kept once. documents: another
    corpus (default: default_corpus()).
    """
    documents = default_corpus() if documents is None else documents

    def candidates(document):
        name = document.name
        windows = line_windows(tagged_lines(_read(document)), max_lines, max_tokens, max_chars)
        return [
            TaggedExample(
                [t for line in window for t in line.tokens],
                [t for line in window for t in line.tags],
                f"{name}:{window[0].line}",
            )
            for window in windows
        ]

    train, validation, test = _build_splits(
        documents,
        (validation_fraction, test_fraction),
        seed,
        (max_train, max_validation, max_test),
        candidates,
        key=lambda example: tuple(example.tokens),
        per_document=windows_per_file,
    )
    return TaskData(
        "stdlib-tagging",
        "tagging",
        train,
        validation,
        test,
        labels=list(TOKEN_TAGS),
        tag_scheme="plain",
        description="Each token of a few lines of Python tagged as tokenize and keyword.iskeyword say.",
    )


def stdlib_retrieval(
    *,
    max_train: int = 1500,
    max_validation: int = 300,
    max_test: int = 300,
    min_query_words: int = 4,
    max_query_chars: int = 300,
    min_body_lines: int = 2,
    max_lines: int = 12,
    max_chars: int = 480,
    functions_per_file: int = 25,
    validation_fraction: float = 0.1,
    test_fraction: float = 0.1,
    seed: int = 0,
    documents: list[corpus.Document] | None = None,
) -> TaskData:
    """Retrieval: a function's docstring summary (the query) finds the function's code.

    The query is the docstring's first paragraph (what a user searching for the function
    would write; later paragraphs detail arguments), of at least min_query_words words and
    not a doctest. The document is the function's code without the docstring, capped as
    in stdlib_classification; it keeps the def line, as CodeSearchNet does, since a name
    is part of what code offers a search. The body must hold min_body_lines non-blank
    lines after the docstring. A query or a document that repeats one already taken is
    skipped, so in a batch query i has one relevant document, document i. documents:
    another corpus (default: default_corpus()).
    """
    documents = default_corpus() if documents is None else documents

    def candidates(document):
        pairs = []
        for function in functions_in(_read(document), document.name):
            if function.docstring is None or function.body_lines < min_body_lines:
                continue
            query = docstring_summary(function.docstring, max_query_chars)
            if len(query.split()) < min_query_words or query.startswith(">>>"):
                continue
            code = capped(function.code, max_lines, max_chars)
            pairs.append(PairExample(query, code, f"{function.file}:{function.line}"))
        return pairs

    # A pair is a copy when its query or its document was seen (in this split or an earlier
    # one): two functions sharing a summary would each be the other's "wrong" answer.
    seen_queries: set[str] = set()
    seen_documents: set[str] = set()

    def fresh(document):
        pairs = []
        for pair in candidates(document):
            if pair.query not in seen_queries and pair.document not in seen_documents:
                seen_queries.add(pair.query)
                seen_documents.add(pair.document)
                pairs.append(pair)
        return pairs

    train, validation, test = _build_splits(
        documents,
        (validation_fraction, test_fraction),
        seed,
        (max_train, max_validation, max_test),
        fresh,
        key=lambda pair: (pair.query, pair.document),
        per_document=functions_per_file,
    )
    return TaskData(
        "stdlib-retrieval",
        "retrieval",
        train,
        validation,
        test,
        description="A docstring's first paragraph finds its function's code (docstring removed).",
    )


DEFAULT_TASKS = {
    "classification": stdlib_classification,
    "tagging": stdlib_tagging,
    "retrieval": stdlib_retrieval,
}
