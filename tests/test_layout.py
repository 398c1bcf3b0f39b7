"""The package's shape: rooms importing one way, and the sub-rooms inside a room too (no two
importing each other), no cycles, small modules, and a module map that names every module.

The room order and the module map are read from docs/architecture.md, so the page and the
code cannot drift apart. The import graph is read from the source with `ast`, imports inside
functions included: a function-level import that closes a cycle or reaches into a later room
is still one (it only moves the failure from import time to call time).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "flashformer"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_LINES = 600


def modules() -> dict[str, Path]:
    """flashformer.x.y -> its file (a package by its __init__.py)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The flashformer modules a file imports anywhere in it: `from a.b import c`
    counts as a.b.c when that is a module, else as a.b."""
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                targets.add(submodule if submodule in known else node.module)
    return {t for t in targets if t in known}


def import_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(path, set(found)) - {name} for name, path in found.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


# ---- rooms ----


def room_order() -> list[str]:
    """The rooms in import order, from the page's `Room order:` line."""
    match = re.search(r"^Room order: (.+)$", ARCHITECTURE.read_text(), re.M)
    assert match, f"{ARCHITECTURE} has no 'Room order:' line"
    return [room.strip() for room in match.group(1).split("→")]


def is_reexport(path: Path) -> bool:
    """A module that only re-exports: a docstring, imports and __all__."""
    for node in ast.parse(path.read_text()).body:
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        names = isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
        if not (docstring or names or isinstance(node, ast.Import | ast.ImportFrom)):
            return False
    return True


def top_level() -> tuple[set[str], set[str]]:
    """(helpers, re-exports): the top-level modules besides the package itself."""
    helpers, reexports = set(), set()
    for path in PACKAGE.glob("*.py"):
        if path.name != "__init__.py":
            (reexports if is_reexport(path) else helpers).add(f"flashformer.{path.stem}")
    return helpers, reexports


def room_of(module: str, helpers: set[str]) -> str:
    if module in helpers:
        return "helpers"
    return module.split(".")[1]


def test_every_room_is_in_the_order_and_every_folder_is_a_room():
    order = room_order()
    assert order[0] == "helpers" and len(set(order)) == len(order), order
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(order[1:]), f"rooms on the page {order[1:]}, folders {sorted(folders)}"


def wrong_imports(graph: dict[str, set[str]], order: list[str], helpers: set[str], reexports: set[str]):
    """Every import of the graph that goes against the room order, as sentences."""
    # the package's own __init__ re-exports from several rooms: it stands after the last of them
    package_rank = max(order.index(room_of(m, helpers)) for m in graph["flashformer"])
    wrong = []
    for module, targets in sorted(graph.items()):
        if module == "flashformer" or module in reexports:
            continue
        rank = order.index(room_of(module, helpers))
        for target in sorted(targets):
            if target in reexports:
                wrong.append(f"{module} imports {target}, a re-export kept for old code")
            elif target == "flashformer":
                if package_rank > rank:
                    wrong.append(f"{module} imports flashformer, which re-exports later rooms")
            elif order.index(room_of(target, helpers)) > rank:
                wrong.append(f"{module} ({room_of(module, helpers)}) imports {target}, a later room")
    return wrong


def test_a_room_imports_only_the_rooms_before_it():
    wrong = wrong_imports(import_graph(), room_order(), *top_level())
    assert not wrong, "\n".join(wrong)


def test_the_room_checker_finds_what_goes_against_the_order(tmp_path):
    reexport = tmp_path / "old_path.py"
    reexport.write_text(
        '"""The old path."""\n\nfrom flashformer.files import write_atomic\n\n__all__ = ["write_atomic"]\n'
    )
    assert is_reexport(reexport) and not is_reexport(PACKAGE / "files.py")
    order = ["helpers", "text", "model", "cli"]
    graph = {
        "flashformer": {"flashformer.model.m"},
        "flashformer.files": set(),
        "flashformer.old": {"flashformer.model.m"},
        "flashformer.text.t": {"flashformer.files"},
        "flashformer.model.m": {"flashformer.text.t", "flashformer.cli.c"},  # a later room
        "flashformer.cli.c": {"flashformer", "flashformer.model.m", "flashformer.old"},  # a re-export
        "flashformer.text.u": {"flashformer"},  # the package re-exports the model room
    }
    assert wrong_imports(graph, order, {"flashformer.files"}, {"flashformer.old"}) == [
        "flashformer.cli.c imports flashformer.old, a re-export kept for old code",
        "flashformer.model.m (model) imports flashformer.cli.c, a later room",
        "flashformer.text.u imports flashformer, which re-exports later rooms",
    ]


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert find_cycle(graph) is None, "import cycle: " + " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


# ---- sub-rooms ----


def sub_room_of(module: str) -> str | None:
    """A module's sub-room inside its room: the folder it sits in (flashformer.serve.http for
    flashformer.serve.http.chat), or itself for a module at the room's top
    (flashformer.serve.engine). None for the package, a room's __init__ and the helpers."""
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) >= 3 else None


def sub_room_arrows(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(sub-room, sub-room of the same room) -> the imports from the first into the second."""
    arrows: dict[tuple[str, str], list[str]] = {}
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            ours, theirs = sub_room_of(module), sub_room_of(target)
            if ours and theirs and ours != theirs and ours.split(".")[1] == theirs.split(".")[1]:
                arrows.setdefault((ours, theirs), []).append(f"{module} imports {target}")
    return arrows


def sub_room_back_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Sub-rooms of one room that import each other (directly, or round a longer circle), as
    sentences naming the imports: inside a room, too, one direction is down."""
    arrows = sub_room_arrows(graph)
    wrong = [
        f"{a} and {b} import each other: " + "; ".join(arrows[a, b] + arrows[b, a])
        for a, b in sorted(arrows)
        if a < b and (b, a) in arrows
    ]
    if not wrong:
        rooms = {room for pair in arrows for room in pair}
        circle = find_cycle({room: {b for a, b in arrows if a == room} for room in rooms})
        if circle:
            steps = [arrows[a, b][0] for a, b in zip(circle, circle[1:])]
            wrong.append("sub-rooms import in a circle " + " -> ".join(circle) + ": " + "; ".join(steps))
    return wrong


def test_no_two_sub_rooms_import_each_other():
    """Inside a room, its folders (serve/http/, serve/openai/, serve/anthropic/, serve/cluster/,
    model/hf/, ...) and its top-level modules import one way too: shared helpers go in a sub-room
    both import, never in one of the two (docs/architecture.md, serve/'s order)."""
    wrong = sub_room_back_arrows(import_graph())
    assert not wrong, (
        "sub-rooms importing each other (give what both need a sub-room of its own):\n" + "\n".join(wrong)
    )


def test_the_sub_room_checker_finds_back_arrows():
    # what serve/ was: the app in openai/ mounting anthropic/'s routes, which took openai/'s chat path
    graph = {
        "flashformer.serve": set(),
        "flashformer.serve.engine": set(),
        "flashformer.serve.openai.app": {"flashformer.serve.anthropic.messages", "flashformer.serve.engine"},
        "flashformer.serve.openai.chat": {"flashformer.serve.engine"},
        "flashformer.serve.anthropic.messages": {"flashformer.serve.openai.chat"},
        "flashformer.model.hf.llama": {"flashformer.serve.openai.chat"},  # another room: not a sub-room arrow
    }
    assert sub_room_back_arrows(graph) == [
        "flashformer.serve.anthropic and flashformer.serve.openai import each other: "
        "flashformer.serve.anthropic.messages imports flashformer.serve.openai.chat; "
        "flashformer.serve.openai.app imports flashformer.serve.anthropic.messages"
    ]
    # what it is: the core below both APIs, the app above them
    graph = {
        "flashformer.serve.engine": set(),
        "flashformer.serve.http.chat": {"flashformer.serve.engine"},
        "flashformer.serve.openai.bodies": {"flashformer.serve.http.chat"},
        "flashformer.serve.anthropic.messages": {"flashformer.serve.http.chat"},
        "flashformer.serve.app": {"flashformer.serve.openai.bodies", "flashformer.serve.anthropic.messages"},
    }
    assert sub_room_back_arrows(graph) == []
    # a longer circle: the core importing an API that imports the app
    graph["flashformer.serve.http.chat"] = {"flashformer.serve.openai.bodies"}
    graph["flashformer.serve.openai.bodies"] = {"flashformer.serve.app"}
    graph["flashformer.serve.app"] = {"flashformer.serve.http.chat"}
    assert sub_room_back_arrows(graph) == [
        "sub-rooms import in a circle flashformer.serve.http -> flashformer.serve.openai -> "
        "flashformer.serve.app -> flashformer.serve.http: "
        "flashformer.serve.http.chat imports flashformer.serve.openai.bodies; "
        "flashformer.serve.openai.bodies imports flashformer.serve.app; "
        "flashformer.serve.app imports flashformer.serve.http.chat"
    ]


def test_no_module_passes_the_line_limit():
    long = {
        name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules past {MAX_LINES} lines (split them by idea): {long}"


def test_an_init_holds_no_function_or_class():
    """A package's __init__.py says what the room holds and re-exports; what it would define
    belongs in a module named for it, where the module map lists it."""
    defined = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
        for path in sorted(PACKAGE.rglob("__init__.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    ]
    assert not defined, "__init__.py files defining functions or classes: " + ", ".join(defined)


# ---- the module map ----

ENTRY = re.compile(r"^( *)([\w.]+(?:\.\w+|/))(?:\s|$)")


def mapped_paths(text: str) -> set[str]:
    """The files and folders the page's module map lists, as paths under flashformer/.

    The map is the code block that starts with `flashformer/`: an entry is a name ending in
    `.py`, another suffix or `/` at the indentation of its depth (2 spaces a level), followed by
    its description; deeper-indented lines continue a description."""
    block = re.search(r"```\nflashformer/\n(.*?)```", text, re.S)
    assert block, "no module map (a code block starting with 'flashformer/')"
    paths, stack = set(), []
    for line in block.group(1).splitlines():
        match = ENTRY.match(line)
        if not match or len(match.group(1)) % 2 or len(match.group(1)) // 2 - 1 > len(stack):
            continue
        depth = len(match.group(1)) // 2 - 1
        stack[depth:] = [match.group(2).rstrip("/")]
        paths.add("/".join(stack))
        for extra in line.split()[1:]:  # several files of one folder on one line: "a.py  b.py  desc"
            if not re.fullmatch(r"\w+\.(py|cpp|inc|h|html|js|css)", extra):
                break
            paths.add("/".join([*stack[:-1], extra]))
    return paths


def test_the_map_parser_reads_depth_and_continuations():
    text = "```\nflashformer/\n  a.py  b.py   two files\n  room/\n    c.py       c, with a long\n                 text.py continuing\n    sub/       d\n      e.py     e\n  f.py\n```\n"
    assert mapped_paths(text) == {"a.py", "b.py", "room", "room/c.py", "room/sub", "room/sub/e.py", "f.py"}


def test_the_module_map_names_every_module_and_nothing_else():
    listed = mapped_paths(ARCHITECTURE.read_text())
    actual = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    actual |= {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*")
        if p.is_dir() and p.name != "__pycache__"
    }
    assert not actual - listed, f"modules missing from docs/architecture.md's map: {sorted(actual - listed)}"
    stale = {p for p in listed if not (PACKAGE / p).exists()}
    assert not stale, f"docs/architecture.md's map lists what does not exist: {sorted(stale)}"


def test_no_cpp_file_passes_the_line_limit():
    """The C++ sources (kernels/csrc) keep the modules' limit too."""
    csrc = PACKAGE / "kernels" / "csrc"
    long = {
        path.name: n
        for path in sorted(csrc.iterdir())
        if path.suffix in (".cpp", ".h", ".inc") and (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"C++ files past {MAX_LINES} lines (split them by idea): {long}"
