"""scripts/docs.py, the maintainer's command that regenerates docs/: the
generated sections of the Markdown files, the tables each module makes of
its data, and (slow) the whole command on a copy of docs/."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
from helpers import alternatives_payload, study_payload

from flashformer.cli import commands as cli
from flashformer.model import hf
from flashformer.model.hf import FAMILIES

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
_spec = importlib.util.spec_from_file_location("docs_script", ROOT / "scripts" / "docs.py")
docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs)


def test_generated_sections_replace_only_between_their_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- generated: t -->\nold\n<!-- end: t -->\noutro\n")
    docs.replace_generated(page, "t", "new table\n")
    assert page.read_text() == "intro\n<!-- generated: t -->\nnew table\n<!-- end: t -->\noutro\n"
    with pytest.raises(ValueError, match="no '<!-- generated: other -->'"):
        docs.replace_generated(page, "other", "x")


def test_every_docs_page_has_the_markers_the_command_fills():
    for page, name in (
        ("benchmarks.md", "attention-table"),
        ("benchmarks.md", "measured-runs"),
        ("benchmarks.md", "native-decoder-turns"),
        ("benchmarks.md", "kv-cache-kld"),
        ("costs.md", "preset-costs"),
        ("costs.md", "memory-agreement"),
        ("models.md", "hf-names"),
        ("cli.md", "cli-reference"),
        ("encoders.md", "encoder-study"),
        ("alternatives.md", "alternatives-study"),
        ("../README.md", "headline"),
    ):
        text = (DOCS / page).read_text()
        assert f"<!-- generated: {name} -->" in text and f"<!-- end: {name} -->" in text, (page, name)


def generated_blocks(page: Path) -> dict[str, str]:
    """Every `<!-- generated: NAME -->` ... `<!-- end: NAME -->` block of a page, by name."""
    return dict(re.findall(r"<!-- generated: ([\w.-]+) -->\n(.*?)<!-- end: \1 -->", page.read_text(), re.S))


def test_every_generated_table_is_its_stored_json():
    """Each generated block of README.md and docs/ equals the table `scripts/docs.py --tables-only`
    draws from the JSON under docs/figures (regenerated here in memory: no benchmark, no figure), so
    a figure edited by hand, or a JSON changed without its page, fails."""
    expected = docs.tables(DOCS)
    differ = [
        f"{page.name}: {marker}"
        for (page, marker), text in expected.items()
        if generated_blocks(page).get(marker, "").strip() != text.strip()
    ]
    assert not differ, f"tables that differ from their JSON (python scripts/docs.py --tables-only): {differ}"
    for page in (ROOT / "README.md", DOCS / "benchmarks.md"):
        unknown = set(generated_blocks(page)) - {marker for p, marker in expected if p == page}
        assert not unknown, f"{page.name} has generated blocks nothing fills: {unknown}"


def test_a_transcribed_table_keeps_its_cells_and_says_whence():
    table = docs.doc_tables.transcribed_table({"header": ["", "cold"], "rows": [["before", ""]]})
    assert table == "| | cold |\n|---|---|\n| before | |"
    for relative in docs.doc_tables.TRANSCRIBED.values():
        assert "transcribed on" in docs.stored(DOCS, relative)["provenance"], relative


def test_a_table_edited_by_hand_is_found(tmp_path):
    copy = tmp_path / "docs"
    shutil.copytree(DOCS, copy, ignore=shutil.ignore_patterns("*.png"))
    (tmp_path / "README.md").write_text((ROOT / "README.md").read_text())
    page = copy / "benchmarks.md"
    block = generated_blocks(page)["kv-cache-smollm2"]
    page.write_text(page.read_text().replace(block, block.replace("| q8_0 | 12240 |", "| q8_0 | 12241 |")))
    tables = docs.tables(copy)
    assert generated_blocks(page)["kv-cache-smollm2"].strip() != tables[page, "kv-cache-smollm2"].strip()
    docs.fill_tables(copy)
    assert generated_blocks(page)["kv-cache-smollm2"].strip() == tables[page, "kv-cache-smollm2"].strip()


def test_readme_is_a_front_door_with_the_two_commands():
    """README.md stays short, and its test command is the one .ci/run runs verbatim."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    commands = [line.strip() for line in readme.splitlines() if line.startswith("    python3 -m venv .venv")]
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert len(commands) == 2 and commands[1] == ci, (commands, ci)
    assert commands[0].endswith('flashformer train && flashformer generate runs/gpt-mini --prompt "def "')


def command_names() -> list[str]:
    """Every command and sub-command of the table the parser is built from."""
    names = []
    for name, entry in cli.COMMANDS.items():
        if isinstance(entry, cli.Command):
            names.append(name)
        else:
            names += [f"{name} {sub}" for sub in entry[1]]
    return names


def test_cli_reference_holds_every_command():
    reference = cli.reference()
    names = command_names()
    assert len(names) >= 16 and "bench serve" in names and "eval perplexity" in names
    for command in names:
        assert f"### `flashformer {command}`" in reference, command


def test_docs_cli_md_is_the_parser_of_today():
    """docs/cli.md's reference is regenerated with every flag change (python scripts/docs.py)."""
    text = (DOCS / "cli.md").read_text()
    section = text.split("<!-- generated: cli-reference -->\n", 1)[1].split("<!-- end: cli-reference -->", 1)[
        0
    ]
    assert section.strip() == cli.reference().strip()


def test_every_path_the_docs_name_exists():
    """A file or folder of the repository that README.md or docs/ names in code (`flashformer/...`,
    `tests/...`, `scripts/...`) is there: a move updates the page or fails here."""
    missing = []
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for path in re.findall(r"`((?:flashformer|tests|scripts)/[\w/.-]*)`", page.read_text()):
            if not (ROOT / path.rstrip("/")).exists():
                missing.append(f"{page.name}: {path}")
    assert not missing, missing


def test_the_readme_has_no_placeholder_left():
    """A word in capitals with underscores (SOME_SUMMARY) is a generator's marker left unfilled;
    command-line metavariables and environment variables are written in code."""
    prose = re.sub(r"`[^`]*`", "", (ROOT / "README.md").read_text())
    prose = "\n".join(line for line in prose.splitlines() if not line.startswith("    "))
    left = re.findall(r"\b[A-Z]+(?:_[A-Z]+)+\b", prose)
    assert not left, f"README.md holds placeholders: {left}"


def test_measured_section_tabulates_the_stored_runs(tmp_path):
    machine = {"cpu": "test CPU", "threads": 2, "torch": "2.13.0"}
    measured = tmp_path / "figures" / "measured"
    measured.mkdir(parents=True)
    train_point = dict(time_s=2.0, tokens_per_s=512.0, achieved_gflops=10.0, mfu=0.25, dtype="float32")
    (measured / "train.json").write_text(
        json.dumps(
            {
                "machine": machine,
                "batch": 4,
                "length": 256,
                "matmul_gflops": {"float32": {"float32": 40.0, "bfloat16": 5.0, "peak": 40.0}},
                "ratios": {"float32": 1.25},
                "points": [
                    dict(train_point, contender="flashformer", layers=12),
                    dict(train_point, contender="transformers", tokens_per_s=409.6, mfu=0.2, layers=12),
                ],
            }
        )
    )
    rates = {"transformers": 10.0, "flashformer": 15.0, "flashformer+compile": 25.0}
    (measured / "generate.json").write_text(
        json.dumps(
            {
                "machine": machine,
                "config": {"prompt_len": 32, "new_tokens": 256},
                "points": [{"batch": 1, "dtype": "float32", "tokens_per_s": rates, "same_tokens": True}],
            }
        )
    )
    section = docs.measured_section(tmp_path)
    assert (
        "### `flashformer bench train`" in section
        and "| float32 | flashformer | 512.0 | 2.00 | 10.0 | 25.0 % |" in section
    )
    assert "| 1 | float32 | 10.0 | 15.0 | 25.0 | 2.50x | yes |" in section
    assert (measured / "train.png").stat().st_size > 0 and (measured / "generate.png").stat().st_size > 0


def test_hf_names_table_lists_every_rule():
    table = hf.names_table()
    for family in FAMILIES.values():
        assert f"**{family.model_type}**" in table
    assert "`transformer.h.0.attn.c_attn.weight`" in table and "`decoder.blocks.0.attn.qkv.weight`" in table


def test_every_figure_the_docs_show_exists_and_is_small():
    for page in DOCS.glob("*.md"):
        for line in page.read_text().splitlines():
            if line.startswith("![") and "](figures/" in line:
                figure = DOCS / line.split("](", 1)[1].rstrip(")")
                assert figure.is_file(), f"{page.name} shows {figure}, which is missing"
                assert figure.stat().st_size < 300_000, f"{figure} is {figure.stat().st_size} bytes"


@pytest.mark.slow
def test_docs_figures_regenerates_a_copy_of_docs(tmp_path):
    copy = tmp_path / "docs"
    shutil.copytree(DOCS, copy)
    docs.main(["--docs", str(copy), "--skip-bench"])
    for name in ("cost-gpt2.png", "positional.png", "flash-tiles.png", "attention-memory-formula.png"):
        assert (copy / "figures" / name).stat().st_size > 0
    assert "| eager | 1024 |" in (copy / "costs.md").read_text()


def test_encoder_study_section_comes_from_the_stored_json(tmp_path):
    assert "No stored study" in docs.encoder_study_section(tmp_path)
    measured = tmp_path / "figures" / "measured"
    measured.mkdir(parents=True)
    (measured / "encoder-study.json").write_text(json.dumps(study_payload()))
    section = docs.encoder_study_section(tmp_path)
    assert "| classification | accuracy | 0.110 |" in section and "classification accuracy +0.300" in section
    assert (measured / "encoder-study.png").stat().st_size > 0


def test_alternatives_sections_come_from_the_stored_json(tmp_path):
    """docs/alternatives.md's section and README.md's headline table are drawn from the study's
    stored JSON (a small payload of the shape bench/alternatives.py writes)."""
    assert "No stored study" in docs.alternatives_section(tmp_path)
    measured = tmp_path / "figures" / "measured"
    measured.mkdir(parents=True)
    (measured / "alternatives.json").write_text(json.dumps(alternatives_payload()))
    section = docs.alternatives_section(tmp_path)
    assert (
        "| **transformer** | 128 / 128 | 659k / 413k | 1.500 (1.400-1.600) | 0.900 (0.800-1.000) |" in section
    )
    assert "| decode tokens/s | lstm vs transformer | 1,024 | 512-2048 | transformer | lstm |" in section
    assert (measured / "alternatives.png").stat().st_size > 0
    assert docs.alternatives_headline(tmp_path) in section.replace(
        "\n\nWidth and parameters: corpus / tasks (the vocabularies differ). Accuracy: on the answer tokens only.",
        "",
    )


# A ratio as the generated tables print it ("2.09x", "**1.33**") and as prose would retype it.
RATIO = re.compile(r"(?<![\w.*])(\d+\.\d+)x(?!\w)|\*\*(\d+(?:\.\d+)?)x?\*\*")

# Sentences that hold a ratio one of their page's tables also shows, but of another run: the
# same value by chance, each typed once. (page, the words around it, why it stays)
RATIOS_OF_OTHER_RUNS = (
    (
        "benchmarks.md",
        "the same measurement then: 353-354 MB, 1.40x",
        "Gemma's RSS before text.sentencepiece",
    ),
    ("benchmarks.md", "846 MB before (1.05x the file)", "the memory-mapped weights' before/after probe"),
    ("benchmarks.md", "43.1 and 44.3 (0.86x and 1.14x", "an EPYC run's compiled decode against llama-bench"),
    ("benchmarks.md", "Gemma's AVX2 decode from 1.31x", "the AVX2 turns before the prefetch"),
    (
        "benchmarks.md",
        "edit-code 1.06x, quote 1.58x, poem 1.80x, explain 0.97x",
        "5 December's lookup run, not stored",
    ),
    ("benchmarks.md", "the step from 5 December's 1.06x", "5 December's lookup run, not stored"),
    ("benchmarks.md", "below the 1.5x target", "a target, not a measurement"),
    ("benchmarks.md", "short of the 1.5x", "a target, not a measurement"),
    (
        "benchmarks.md",
        "gets 1.77x on edit-code at c = 0.15, 1.62x at 0.25; one rate for every draft 1.40x at 0.15 "
        "(1.25x at 0.25), the rate per match length kept here 1.42x (1.23x)",
        "scripts/speculative_replay.py's cost model",
    ),
    (
        "benchmarks.md",
        "two branches of 4 and 2 drafts 0.93x, of 6 and 2 0.83x",
        "scripts/speculative_replay.py's trees of drafts",
    ),
    (
        "benchmarks.md",
        "measured 1.34x, 0.93x, 0.84x, 0.91x and 1.05x",
        "the served run before the batch weighed",
    ),
    ("benchmarks.md", "gave 1.48x, 1.42x, 1.25x and 1.55x", "the EPYC 16-client runs' one-client passes"),
    ("benchmarks.md", "p99 between tokens 1.02x, 0.87x, 0.95x and 0.66x", "the same passes"),
    ("benchmarks.md", "one such pass at 1.09x", "the first EPYC campaign"),
    ("benchmarks.md", "one-client run: 1.37x, p99 0.76x", "the first EPYC campaign"),
    ("benchmarks.md", "reached 1.39x", "the AVX2-only EPYC campaign before"),
    ("benchmarks.md", "went from 0.76-0.94x", "the server before the step moved to the main thread"),
    ("serving.md", "54.6 with (1.76x", "one draft-model request"),
    ("benchmarks.md", "with its tokenizer 317-318 MB, 1.25-1.26x", "Gemma's RSS after text.sentencepiece"),
    ("benchmarks.md", "after the first token 895 MB (1.11x", "the 1B-shape file's RSS, not a speed ratio"),
    (
        "benchmarks.md",
        "12.4 tokens/s (0.91x) with THP_MEM_ALLOC_ENABLE=0, 0.95-0.98x",
        "the 8B-shape file's huge-page probe against llama-bench",
    ),
)


def test_prose_does_not_retype_its_tables_ratios():
    """A ratio a generated table shows is not typed again in the prose of its page: the prose names
    the table or row and says what it shows, so a rerun that regenerates the table leaves no sentence
    stale (issue 52: every figure typed once). Repeats of another run's value are listed above."""
    retyped, stale = [], []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = page.read_text()
        shown = {a or b for body in generated_blocks(page).values() for a, b in RATIO.findall(body)}
        prose = " ".join(
            re.sub(r"<!-- generated: ([\w.-]+) -->\n.*?<!-- end: \1 -->", " ", text, flags=re.S).split()
        )
        for name, words, _ in RATIOS_OF_OTHER_RUNS:
            if name == page.name:
                if words not in prose:
                    stale.append(f"{name}: {words}")
                prose = prose.replace(words, " ")
        for match in RATIO.finditer(prose):
            if (match.group(1) or match.group(2)) in shown:
                retyped.append(f"{page.name}: ...{prose[max(0, match.start() - 60) : match.end()]}")
    assert not stale, f"RATIOS_OF_OTHER_RUNS names words no page holds any more: {stale}"
    assert not retyped, f"prose retypes a ratio its page's generated table shows: {retyped}"
