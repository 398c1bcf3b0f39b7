"""The three default tasks, built from Python's standard library: no download, on every machine.

    stdlib_classification   which stdlib package a function comes from (sequence classification)
    stdlib_tagging          each token of a few source lines tagged as Python's tokenize sees it
    stdlib_retrieval        a docstring's summary finds its function's code (retrieval)

Every task is split by FILE with a stable hash of the file's name (as data.split_documents
does), so a function never sits in two splits; identical inputs found in two files (a
`__repr__` copied between modules) are kept only in the first split built, in the order
test, validation, train: evaluation sets stay whole and training loses the copy. Examples
come out in the same order on every run of one Python version; sizes are capped so that
each task builds in a few seconds.
"""

from __future__ import annotations

import ast
import hashlib
import io
import keyword
import tokenize
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from flashformer import data
from flashformer.tasks.datasets import PairExample, TaggedExample, TaskData, TextExample

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

# tokenize's types that become tags; a NAME that is a keyword becomes KEYWORD. Soft keywords
# (match, case, _, type) stay NAME: tokenize cannot tell `match x:` from `match = ...`, and
# in the stdlib they are names far more often than statements.
TOKEN_TAGS = ("NAME", "KEYWORD", "OP", "NUMBER", "STRING", "COMMENT")
# Layout tokens, not words: their strings are "\n", indentation or "".
LAYOUT_TOKEN_TYPES = {
    tokenize.NEWLINE,
    tokenize.NL,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
    tokenize.ENCODING,
}
# Python 3.12+ splits an f-string into these parts (3.11 gives one STRING token); the
# parts are tagged STRING, the names and operators inside the braces as themselves.
FSTRING_PART_TYPES = {
    getattr(tokenize, name)
    for name in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
    if hasattr(tokenize, name)
}


def stable_score(key: str, seed: int = 0) -> float:
    """A number in [0, 1) from a string, the same on every machine and run (unlike hash())."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_three_ways(
    documents: list[data.Document], validation_fraction: float, test_fraction: float, seed: int = 0
) -> tuple[list[data.Document], list[data.Document], list[data.Document]]:
    """(train, validation, test) documents by the stable hash of their names.

    data.split_documents twice: test from all, then validation from the rest (its
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
    rest, test = data.split_documents(documents, test_fraction, seed)
    train, validation = data.split_documents(rest, validation_fraction / (1.0 - test_fraction), seed + 1)

    def hashed_order(split):
        return sorted(split, key=lambda doc: stable_score(doc.name, seed))

    return hashed_order(train), hashed_order(validation), hashed_order(test)


def split_by_weight(
    documents: list[data.Document],
    weights: dict[str, int],
    validation_fraction: float,
    test_fraction: float,
    seed: int = 0,
) -> tuple[list[data.Document], list[data.Document], list[data.Document]]:
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


def _read(document: data.Document) -> str:
    # read_text opens in universal-newline mode: lines are separated by "\n" only, as ast counts them
    return data.read_text(document.path)


# ---- functions, found with ast ----


@dataclass(frozen=True)
class FunctionSource:
    """One def (or async def) of a file, as the tasks use it.

    code: the def's exact lines (decorators excluded, the docstring's lines removed),
    dedented by the def line's indentation; docstring: ast.get_docstring's cleaned text, or
    None; body_lines: the non-blank lines from the first statement after the docstring to
    the end (0 when the body is only `pass` or `...`).
    """

    file: str
    name: str  # qualified: Class.method, outer.<locals>.inner
    line: int  # of the def keyword, 1-based
    code: str
    docstring: str | None
    body_lines: int


def functions_in(text: str, file: str = "<text>") -> list[FunctionSource]:
    """Every function of a source text in the order of their def lines; [] if it does not parse.

    A function whose docstring shares a line with other code (`def f(): "doc"; return 1`)
    is left out: removing the docstring would cut a line in two.
    """
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.split("\n")
    functions: list[FunctionSource] = []

    def visit(node, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                function = _function_source(child, lines, file, name)
                if function is not None:
                    functions.append(function)
                visit(child, name + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            elif not isinstance(child, ast.expr):  # a def is a statement: never inside an expression
                visit(child, prefix)

    visit(tree, "")
    return sorted(functions, key=lambda f: f.line)


def _is_docstring(statement) -> bool:
    return (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Constant)
        and isinstance(statement.value.value, str)
    )


def _is_placeholder(statement) -> bool:
    return isinstance(statement, ast.Pass) or (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Constant)
        and statement.value.value is Ellipsis
    )


def _function_source(node, lines: list[str], file: str, name: str) -> FunctionSource | None:
    start, end = node.lineno - 1, node.end_lineno  # lines[start:end] hold the def
    body = node.body
    removed: set[int] = set()  # 0-based line numbers of the docstring
    if _is_docstring(body[0]):
        doc = body[0]
        first, last = lines[doc.lineno - 1], lines[doc.end_lineno - 1]
        before = first.encode()[: doc.col_offset].decode(errors="replace")  # ast's columns are UTF-8 bytes
        after = last.encode()[doc.end_col_offset :].decode(errors="replace").strip()
        if before.strip() or (after and not after.startswith("#")):
            return None
        removed = set(range(doc.lineno - 1, doc.end_lineno))
        body = body[1:]
    statements = [s for s in body if not _is_placeholder(s)]
    body_lines = 0
    if statements:
        body_lines = sum(1 for i in range(body[0].lineno - 1, end) if lines[i].strip() and i not in removed)
    indent = lines[start][: node.col_offset]
    kept = []
    after_docstring = False  # blank lines that followed the docstring go with it
    for i in range(start, end):
        if i in removed:
            after_docstring = True
            continue
        line = lines[i]
        if after_docstring and not line.strip():
            continue
        after_docstring = False
        kept.append(line[len(indent) :] if line.startswith(indent) else line)
    return FunctionSource(
        file=file,
        name=name,
        line=node.lineno,
        code="\n".join(kept),
        docstring=ast.get_docstring(node, clean=True),
        body_lines=body_lines,
    )


# ---- tokens, tagged by tokenize ----


def token_tag(token: tokenize.TokenInfo) -> str | None:
    """A token's tag (one of TOKEN_TAGS), None for a layout token, "ERROR" for an ERRORTOKEN."""
    if token.type in LAYOUT_TOKEN_TYPES:
        return None
    if token.type == tokenize.NAME:
        return "KEYWORD" if keyword.iskeyword(token.string) else "NAME"
    if token.type in FSTRING_PART_TYPES:
        return "STRING"
    tag = tokenize.tok_name[token.type]
    return tag if tag in TOKEN_TAGS else "ERROR"


@dataclass(frozen=True)
class TaggedLine:
    line: int  # 1-based; a token spanning lines (a triple-quoted string) belongs to the line it starts on
    tokens: list[str]
    tags: list[str]


def tagged_lines(text: str) -> list[TaggedLine]:
    """The lines of a source text that hold tokens, each token with its tag.

    The whole text is tokenized at once (a line inside a triple-quoted string or a
    bracket does not tokenize alone), then cut by the line a token starts on. Layout
    tokens are dropped; a line holding an ERRORTOKEN is dropped whole. [] when the text
    does not tokenize.
    """
    rows: dict[int, TaggedLine] = {}
    broken: set[int] = set()
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            tag = token_tag(token)
            if tag is None or not token.string:
                continue
            row = token.start[0]
            if tag == "ERROR":
                broken.add(row)
                continue
            line = rows.setdefault(row, TaggedLine(row, [], []))
            line.tokens.append(token.string)
            line.tags.append(tag)
    except (tokenize.TokenError, SyntaxError):
        return []
    return [rows[row] for row in sorted(rows) if row not in broken]


def line_windows(
    lines: list[TaggedLine], max_lines: int, max_tokens: int, max_chars: int
) -> list[list[TaggedLine]]:
    """Consecutive tagged lines grouped greedily into windows of at most max_lines lines,
    max_tokens tokens and max_chars characters of token text. A line over a limit by
    itself (mostly a long docstring) is left out and ends the window before it."""
    windows: list[list[TaggedLine]] = []
    current: list[TaggedLine] = []
    tokens = chars = 0
    for line in lines:
        line_tokens, line_chars = len(line.tokens), sum(len(t) for t in line.tokens)
        if line_tokens > max_tokens or line_chars > max_chars:
            if current:
                windows.append(current)
            current, tokens, chars = [], 0, 0
            continue
        if current and (
            len(current) == max_lines or tokens + line_tokens > max_tokens or chars + line_chars > max_chars
        ):
            windows.append(current)
            current, tokens, chars = [], 0, 0
        current.append(line)
        tokens += line_tokens
        chars += line_chars
    if current:
        windows.append(current)
    return windows


# ---- building splits ----


def _fill_split(
    documents: Iterable[data.Document],
    candidates: Callable[[data.Document], list],
    key: Callable,
    limit: int,
    per_document: int,
    seen: set,
) -> list:
    """Up to `limit` examples, at most per_document from each document (evenly spread through
    it), skipping any whose key is in `seen` (an earlier split's, or a copy in this one)."""
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
    documents: list[data.Document] | None = None,
) -> TaskData:
    """Sequence classification: the stdlib package (asyncio, email, ...) a function comes from.

    The input is the function's code without its docstring, capped to its first max_lines
    lines and max_chars characters (12 and 480: about 150 WordPiece tokens, inside a small
    encoder's 256). The docstring goes because it is prose that often names its package
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
    documents = data.stdlib_corpus() if documents is None else documents
    by_package: dict[str, list[data.Document]] = {package: [] for package in packages}
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
    max_chars: int = 200,
    windows_per_file: int = 12,
    validation_fraction: float = 0.1,
    test_fraction: float = 0.1,
    seed: int = 0,
    documents: list[data.Document] | None = None,
) -> TaskData:
    """Token classification: each token of a window of source lines tagged NAME, KEYWORD, OP,
    NUMBER, STRING or COMMENT, exactly as tokenize (and keyword.iskeyword) says.

    Tokens are tokenize's exact strings (layout tokens dropped, see tagged_lines); a window
    is up to max_lines consecutive lines, max_tokens tokens and max_chars characters, so it
    fits 128 subword tokens. Tags are plain, one per token: every tokenize token is a whole
    entity, so BIO would write B- before every tag and never I-, and the per-tag token F1
    (metrics.token_scores) is the entity F1. Up to windows_per_file windows are taken from
    each file, spread through it; identical windows are kept once.
    """
    documents = data.stdlib_corpus() if documents is None else documents

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


def docstring_summary(docstring: str, max_chars: int) -> str:
    """The docstring's first paragraph on one line, cut at a word boundary to max_chars."""
    summary = " ".join(docstring.split("\n\n")[0].split())
    if len(summary) > max_chars:
        summary = summary[:max_chars].rsplit(" ", 1)[0]
    return summary


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
    documents: list[data.Document] | None = None,
) -> TaskData:
    """Retrieval: a function's docstring summary (the query) finds the function's code.

    The query is the docstring's first paragraph (what a user searching for the function
    would write; later paragraphs detail arguments), of at least min_query_words words and
    not a doctest. The document is the function's code without the docstring, capped as
    in stdlib_classification; it keeps the def line, as CodeSearchNet does, since a name
    is part of what code offers a search. The body must hold min_body_lines non-blank
    lines after the docstring. A query or a document that repeats one already taken is
    skipped, so in a batch query i has one relevant document, document i.
    """
    documents = data.stdlib_corpus() if documents is None else documents

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

    # one key per pair for both texts: a pair is a copy when its query OR its document was seen
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
