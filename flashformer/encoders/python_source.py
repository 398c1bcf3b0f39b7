"""Python source read as the default tasks need it: functions with ast, tokens with tokenize.

    functions_in        every def of a source text: its exact code without the docstring, and
                        the docstring
    docstring_summary   a docstring's first paragraph, on one line
    tagged_lines        every line's tokens, each tagged NAME, KEYWORD, OP, NUMBER, STRING or COMMENT
    line_windows        consecutive tagged lines grouped into windows a small encoder sees whole

They read a source text, not a file, so that a test can hand them a few lines.
"""

from __future__ import annotations

import ast
import io
import keyword
import tokenize
from dataclasses import dataclass

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
    """Tagged lines, in order, grouped greedily into windows of at most max_lines lines,
    max_tokens tokens and max_chars characters of token text (blank lines hold no tokens,
    so a window runs across them). A line over a limit by itself (mostly a long docstring)
    is left out and ends the window before it."""
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


def docstring_summary(docstring: str, max_chars: int) -> str:
    """The docstring's first paragraph on one line, cut at a word boundary to max_chars."""
    summary = " ".join(docstring.split("\n\n")[0].split())
    if len(summary) > max_chars:
        summary = summary[:max_chars].rsplit(" ", 1)[0]
    return summary
