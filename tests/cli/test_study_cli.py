"""`flashformer study alternatives`: its flags become the study's settings, a wrong family is
refused before any training, and (slow) the --quick study writes its JSON, PNG and tables."""

from __future__ import annotations

import json

import pytest

from flashformer.bench import alternatives
from flashformer.cli import commands as cli
from flashformer.cli import study


def parse(*argv: str):
    return cli.build_parser().parse_args(["study", "alternatives", *argv])


def test_flags_become_the_study_settings():
    config = study.study_config(
        parse("--quick", "--families", "transformer,lstm", "--seeds", "3,4", "--threads", "1")
    )
    assert config.families == ("transformer", "lstm") and config.seeds == (3, 4) and config.threads == 1
    assert config.corpus_steps == alternatives.QUICK.corpus_steps
    default = study.study_config(parse("--decode-ns", "512,1024"))
    assert default.decode_ns == (512, 1024) and default.corpus_steps == alternatives.DEFAULT.corpus_steps
    assert default.family_names() == tuple(alternatives.FAMILIES)


def test_an_unknown_family_is_refused_before_any_training(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["study", "alternatives", "--families", "transformer,rwkv", "--work", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "unknown families ['rwkv']" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_quick_study_writes_its_json_png_and_tables(tmp_path):
    out = tmp_path / "out"
    cli.main(["study", "alternatives", "--quick", "--work", str(tmp_path / "work"), "--out", str(out)])
    payload = json.loads((out / "alternatives.json").read_text())
    assert set(payload["families"]) == set(alternatives.FAMILIES)
    assert (out / "alternatives.png").stat().st_size > 0
    assert "| **transformer** |" in (out / "alternatives.md").read_text()
