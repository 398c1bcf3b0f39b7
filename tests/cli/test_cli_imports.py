"""What the `flashformer` command imports, read from a fresh interpreter's sys.modules: a command
imports its own module and the rooms it runs, `--help` no torch, and `generate` on a GGUF file
nothing that compiles (DESIGN.md: nothing is compiled between the command and the first token
beyond the C++ extension) and none of the libraries its path does not use. Not timed: the
figures are docs/benchmarks.md's ("Cold start")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from flashformer.checkpoints.gguf.packaged_models import smollm2_path
from flashformer.cli import commands as cli

ROOT = Path(__file__).resolve().parent.parent.parent


def modules_after_command(argv: list[str]) -> set[str]:
    """The modules a fresh interpreter holds after `flashformer ARGV` (its exit included)."""
    script = (
        "import json, sys\n"
        "from flashformer.cli.commands import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def rooms(modules: set[str]) -> set[str]:
    return {name.split(".")[1] for name in modules if name.startswith("flashformer.")}


def test_help_imports_no_torch_and_no_command():
    loaded = modules_after_command(["--help"])
    assert "torch" not in loaded
    assert rooms(loaded) <= {"cli", "kernels", "startup"}, rooms(loaded)
    assert not [m for m in loaded if m.startswith("flashformer.cli.") and m != "flashformer.cli.commands"]


def test_generate_on_a_gguf_file_imports_what_it_runs_and_compiles_nothing():
    loaded = modules_after_command(
        ["generate", str(smollm2_path()), "--quantize", "gguf", "--prompt", "Hi", "--max-new-tokens", "1"]
    )
    assert "flashformer.kernels.native_decoder" in loaded  # it did run the model
    assert rooms(loaded) <= {
        *("checks", "files", "formatting", "startup"),  # the helpers
        *("kernels", "attention", "text", "generate", "model", "checkpoints", "cli"),
    }, rooms(loaded)
    compilers = {"torch._dynamo", "torch._inductor", "triton"}
    unused = {"gguf", "yaml", "jinja2", "transformers", "matplotlib", "flashformer.checkpoints.gguf.writer"}
    assert not (compilers | unused) & loaded, sorted((compilers | unused) & loaded)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "model.gguf", "--prompt", "Hi", "--greedy", "--max-new-tokens", "3"],
        ["chat", "model.gguf", "--system", "Be brief.", "--temperature", "0.5"],
        ["serve", "model.gguf", "--port", "8001", "--no-webui"],
        ["bench", "generate", "--threads", "2"],
        ["eval", "kld", "model.gguf", "--ctx", "256"],
        ["cost", "--help"],
    ],
)
def test_the_parser_of_the_named_command_parses_as_the_whole_parser(argv):
    """build_parser(argv), which gives arguments to the named command alone, parses argv as the
    parser of every command does."""

    def parsed(parser):
        try:
            return vars(parser.parse_args(argv))
        except SystemExit as stop:  # --help
            return {"exit": stop.code}

    assert parsed(cli.build_parser(argv)) == parsed(cli.build_parser())


def test_the_parser_of_one_command_leaves_the_others_without_arguments():
    parser = cli.build_parser(["generate", "model.gguf"])
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert "--prompt" in commands["generate"].format_help()
    assert [a.dest for a in commands["train"]._actions] == ["help"]
