"""Fine-tuning tasks' examples, and readers of users' JSON-lines files.

Three kinds of task, one record each:

    TextExample(text, label)            sequence classification (label: str, int, or a tuple of
                                        str for multi-label)
    TaggedExample(tokens, tags)         token classification: one tag per word-level token
    PairExample(query, document)        retrieval: a query and the one document it should find

A `TaskData` holds the three splits and the label list, whose positions are the label ids
the model's head predicts. The readers check every line and fail on the first bad one
with the file, the line number, what was found and what was expected: a typo found at
step 0 costs less than a model fine-tuned on a silently dropped class.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("classification", "multilabel", "tagging", "retrieval")
TAG_SCHEMES = ("bio", "plain")


# `source` says where an example came from ("file:line"), for error analysis and the
# split-leak checks; it takes no part in equality.


@dataclass(frozen=True)
class TextExample:
    text: str
    label: str | int | tuple[str, ...]  # a tuple of labels in a multi-label task (may be empty)
    source: str = field(default="", compare=False)


@dataclass(frozen=True)
class TaggedExample:
    tokens: list[str]
    tags: list[str]  # tags[i] labels tokens[i]
    source: str = field(default="", compare=False)


@dataclass(frozen=True)
class PairExample:
    query: str
    document: str
    source: str = field(default="", compare=False)


@dataclass
class TaskData:
    """The splits of one task, and its labels in id order.

    kind: "classification" (one label per text), "multilabel" (a set per text), "tagging"
    (one tag per token) or "retrieval" (query/document pairs; no labels).
    tag_scheme, for tagging: "bio" (B-TYPE / I-TYPE / O: entities are spans; score them
    with metrics.entity_scores) or "plain" (one tag per token; score with
    metrics.token_scores, or entity_scores(scheme="io") where a run of one tag is one entity).
    """

    name: str
    kind: str
    train: list
    validation: list
    test: list
    labels: list = field(default_factory=list)
    tag_scheme: str | None = None
    description: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}; got {self.kind!r}")
        if self.kind == "tagging" and self.tag_scheme not in TAG_SCHEMES:
            raise ValueError(f"a tagging task needs tag_scheme in {TAG_SCHEMES}; got {self.tag_scheme!r}")
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"labels repeat an entry: {self.labels}")

    @property
    def label_ids(self) -> dict:
        """label -> id (its position in `labels`)."""
        return {label: index for index, label in enumerate(self.labels)}

    @property
    def splits(self) -> dict[str, list]:
        return {"train": self.train, "validation": self.validation, "test": self.test}

    def label_counts(self, split: str) -> dict:
        """How often each label (each tag, for tagging) occurs in one split, in label order."""
        counts = dict.fromkeys(self.labels, 0)
        for example in self.splits[split]:
            if isinstance(example, TaggedExample):
                values = example.tags
            elif isinstance(example, TextExample):
                values = example.label if self.kind == "multilabel" else [example.label]
            else:
                return {}
            for value in values:
                counts[value] += 1
        return counts


# ---- label order ----


def sorted_labels(labels) -> list:
    """The stable id order: integers by value, strings alphabetically."""
    return sorted(set(labels))


def tag_scheme(tags) -> str:
    """The scheme of a tag set: "bio" when every tag is O, B-TYPE or I-TYPE (and one is not O),
    "plain" otherwise."""
    tags = set(tags)
    entity_tags = tags - {"O"}
    if entity_tags and all(t[:2] in ("B-", "I-") and len(t) > 2 for t in entity_tags):
        return "bio"
    return "plain"


def sorted_tags(tags) -> list[str]:
    """O first, then by entity type with B before I (BIO), or alphabetically (plain)."""
    tags = set(tags)
    rest = tags - {"O"}
    if tag_scheme(tags) == "bio":
        ordered = sorted(rest, key=lambda t: (t[2:], t[0]))
    else:
        ordered = sorted(rest)
    return (["O"] if "O" in tags else []) + ordered


# ---- JSON lines ----


def _json_type(value) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {str: "string", int: "integer", float: "number", list: "array", dict: "object"}.get(
        type(value), type(value).__name__
    )


def _shown(value, limit: int = 60) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _Line:
    """One record of a JSON-lines file, and the errors that point at it."""

    def __init__(self, path: Path, number: int, record: dict):
        self.path, self.number, self.record = path, number, record

    @property
    def source(self) -> str:
        return f"{self.path.name}:{self.number}"

    def fail(self, message: str):
        raise ValueError(f"{self.path}, line {self.number}: {message}")

    def get(self, key: str, expected: str):
        if key not in self.record:
            self.fail(f"missing key {key!r}; expected {expected}; the line has keys {sorted(self.record)}")
        return self.record[key]

    def nonempty_string(self, key: str):
        value = self.get(key, f"{key!r}: a non-empty string")
        if not isinstance(value, str):
            self.fail(f"{key!r} is a JSON {_json_type(value)} ({_shown(value)}); expected a string")
        if not value.strip():
            self.fail(f"{key!r} is empty or only whitespace ({_shown(value)}); expected some text")
        return value

    def string_list(self, key: str, what: str) -> list[str]:
        value = self.get(key, f"{key!r}: an array of strings")
        if not isinstance(value, list):
            self.fail(
                f"{key!r} is a JSON {_json_type(value)} ({_shown(value)}); expected an array of strings"
            )
        if not value:
            self.fail(f"{key!r} is an empty array; expected at least one {what}")
        for index, item in enumerate(value):
            if not isinstance(item, str):
                self.fail(
                    f"{key!r}[{index}] is a JSON {_json_type(item)} ({_shown(item)}); expected a string"
                )
            if not item.strip():
                # a subword tokenizer gives no piece for whitespace, so its tag would have no token
                self.fail(f"{key!r}[{index}] is empty or only whitespace ({_shown(item)}); expected a {what}")
        return value


def _json_lines(path, expected_keys: str):
    """(line, record) for each non-blank line; blank lines are skipped, extra keys ignored."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no file {path}")
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"{path}, line {number}: not UTF-8 ({error.reason} at byte {error.start}); "
                    "expected UTF-8 text"
                ) from None
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}, line {number}: invalid JSON ({error.msg} at column {error.colno}); "
                    f"expected one JSON object per line, like {expected_keys}"
                ) from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path}, line {number}: a JSON {_json_type(record)} ({_shown(record)}); "
                    f"expected an object like {expected_keys}"
                )
            yield _Line(path, number, record)


def _label_value(line: _Line, multi_label: bool | None, first: dict):
    """A label checked against the file's first label: all str or all int, all lists or none."""
    value = line.get("label", "'label': a string, an integer, or an array of strings (multi-label)")
    is_list = isinstance(value, list)
    if is_list:
        for index, item in enumerate(value):
            if not isinstance(item, str) or not item:
                line.fail(
                    f"'label'[{index}] is a JSON {_json_type(item)} ({_shown(item)}); "
                    "expected a non-empty string (a multi-label label is an array of strings)"
                )
        if len(set(value)) != len(value):
            line.fail(f"'label' {_shown(value)} repeats a label; expected each label once")
        value = tuple(value)
    elif isinstance(value, str):
        if not value:
            line.fail("'label' is an empty string; expected a label name")
    elif not isinstance(value, int) or isinstance(value, bool):
        line.fail(
            f"'label' is a JSON {_json_type(value)} ({_shown(value)}); "
            "expected a string, an integer, or an array of strings"
        )
    if multi_label is not None and is_list != multi_label:
        expected = "an array of labels (the training file is multi-label)" if multi_label else "one label"
        line.fail(f"'label' is {_shown(line.record['label'])}; expected {expected}")
    if not first:
        first.update(line=line.number, is_list=is_list, type=type(value), json_type=_json_type(value))
    elif is_list != first["is_list"]:
        line.fail(
            f"'label' is {'an array' if is_list else 'a single label'} here but "
            f"{'an array' if first['is_list'] else 'a single label'} on line {first['line']}; "
            "expected every line of a file to be multi-label, or none"
        )
    elif not is_list and type(value) is not first["type"]:
        line.fail(
            f"'label' is a JSON {_json_type(value)} here but a JSON {first['json_type']} on "
            f"line {first['line']}; expected all labels of a file to be strings, or all integers"
        )
    return value


def read_text_examples(path, labels=None, multi_label: bool | None = None) -> list[TextExample]:
    """{"text": ..., "label": ...} per line; the label a string, an integer, or (multi-label)
    an array of strings.

    labels: the allowed labels (a validation or test file read against the training
    labels), or None to accept any. multi_label: require arrays (True) or single labels
    (False); None accepts either, the same on every line.
    """
    allowed = None if labels is None else set(labels)
    first: dict = {}
    examples = []
    for line in _json_lines(path, '{"text": "...", "label": "..."}'):
        text = line.nonempty_string("text")
        label = _label_value(line, multi_label, first)
        if allowed is not None:
            for value in label if isinstance(label, tuple) else (label,):
                if value not in allowed:
                    line.fail(
                        f"label {_shown(value)} is not among the training labels {sorted_labels(allowed)}"
                    )
        examples.append(TextExample(text, label, line.source))
    if not examples:
        raise ValueError(f"{path} holds no examples; expected JSON lines like {{'text': ..., 'label': ...}}")
    return examples


def read_tagged_examples(path, tags=None) -> list[TaggedExample]:
    """{"tokens": [...], "tags": [...]} per line, one tag per token (BIO or plain tags).

    tags: the allowed tags (a validation or test file read against the training tags),
    or None to accept any.
    """
    allowed = None if tags is None else set(tags)
    examples = []
    for line in _json_lines(path, '{"tokens": ["..."], "tags": ["..."]}'):
        tokens = line.string_list("tokens", "token")
        line_tags = line.string_list("tags", "tag")
        if len(tokens) != len(line_tags):
            line.fail(f"{len(tokens)} tokens but {len(line_tags)} tags; expected one tag per token")
        if allowed is not None:
            for index, tag in enumerate(line_tags):
                if tag not in allowed:
                    line.fail(
                        f"tag {tag!r} (of token {index}, {tokens[index]!r}) is not among the training "
                        f"tags {sorted_tags(allowed)}"
                    )
        examples.append(TaggedExample(tokens, line_tags, line.source))
    if not examples:
        raise ValueError(
            f"{path} holds no examples; expected JSON lines like {{'tokens': [...], 'tags': [...]}}"
        )
    return examples


def read_pair_examples(path) -> list[PairExample]:
    """{"query": ..., "document": ...} per line: the document is the one the query should find."""
    examples = []
    for line in _json_lines(path, '{"query": "...", "document": "..."}'):
        query, document = line.nonempty_string("query"), line.nonempty_string("document")
        examples.append(PairExample(query, document, line.source))
    if not examples:
        raise ValueError(
            f"{path} holds no examples; expected JSON lines like {{'query': ..., 'document': ...}}"
        )
    return examples


def read_task(kind: str, train, validation=None, test=None, name: str | None = None) -> TaskData:
    """A task from users' JSON-lines files. Labels (tags) come from the training file, in
    sorted order; the validation and test files are read against them, so a label the
    model was never trained on is an error, not a silent zero. Missing splits are empty.

    kind: "classification" (single- or multi-label, as the training file says), "tagging"
    or "retrieval".
    """
    readers = ("classification", "tagging", "retrieval")
    if kind not in readers:
        raise ValueError(f"kind must be one of {readers}; got {kind!r}")
    name = name or Path(train).stem
    if kind == "retrieval":
        return TaskData(
            name,
            kind,
            read_pair_examples(train),
            read_pair_examples(validation) if validation else [],
            read_pair_examples(test) if test else [],
        )
    if kind == "tagging":
        train_examples = read_tagged_examples(train)
        tags = sorted_tags(t for example in train_examples for t in example.tags)
        return TaskData(
            name,
            kind,
            train_examples,
            read_tagged_examples(validation, tags) if validation else [],
            read_tagged_examples(test, tags) if test else [],
            labels=tags,
            tag_scheme=tag_scheme(tags),
        )
    train_examples = read_text_examples(train)
    multi_label = isinstance(train_examples[0].label, tuple)
    if multi_label:
        labels = sorted_labels(value for example in train_examples for value in example.label)
    else:
        labels = sorted_labels(example.label for example in train_examples)
    return TaskData(
        name,
        "multilabel" if multi_label else "classification",
        train_examples,
        read_text_examples(validation, labels, multi_label) if validation else [],
        read_text_examples(test, labels, multi_label) if test else [],
        labels=labels,
    )
