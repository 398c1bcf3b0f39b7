"""`flashformer eval kld`: --save-base then --base on tiny GGUF models, its errors, and (where a
llama.cpp build has llama-perplexity) each side reading the other's base file."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch
from helpers.gguf import cycle_types, llama_metadata, llama_tensors, tiny_llama, write_gguf
from helpers.llama_cpp_tools import llama_perplexity, printed_mean_kld, run_llama_perplexity

from flashformer.checkpoints.loading import load
from flashformer.cli import commands as cli
from flashformer.eval.base_logits import read_base_logits, write_base_logits
from flashformer.eval.kld import file_divergence, kl_divergence

TEXT = (
    "The quick brown fox jumps over the lazy dog, and then the dog sleeps in the sun. "
    "Paris is the capital of France; Berlin is the capital of Germany. 12 and 12 make 24.\n"
) * 4


@functools.cache
def _tiny_files(root: Path) -> tuple[Path, Path, Path]:
    """(base model, another model, text): two random tiny llamas in float32 GGUF files."""
    paths = []
    for seed in (0, 1):
        model = tiny_llama(seed=seed)
        with torch.no_grad():  # logits a few nats wide, as a trained model's
            model.lm_head.weight.mul_(30)
        path = root / f"tiny-{seed}.gguf"
        metadata = {**llama_metadata(model), "tokenizer.ggml.pre": "gpt-2"}  # llama.cpp's name of GPT-2's
        paths.append(write_gguf(path, "llama", metadata, llama_tensors(model, cycle_types("F32"))))
    text = root / "text.txt"
    text.write_text(TEXT)
    return paths[0], paths[1], text


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    return _tiny_files(tmp_path_factory.mktemp("kld-cli"))


def test_save_base_then_measure_another_model(tiny_files, tmp_path, capsys):
    base_model, other_model, text = tiny_files
    base_file, saved_json, result_json = tmp_path / "b.kld", tmp_path / "saved.json", tmp_path / "kld.json"
    cli.main(["eval", "kld", str(base_model), "--save-base", str(base_file), "--data", str(text), "--ctx", "32",
              "--chunks", "8", "--out", str(saved_json), "--no-progress"])  # fmt: skip
    base = read_base_logits(base_file)
    _, tokenizer = load(base_model)
    assert (base.ctx, base.chunks, base.vocab) == (32, 8, tokenizer.vocab_size)
    assert base.tokens.ravel().tolist() == tokenizer.encode(TEXT[:-1])[: 8 * 32]  # -f drops one final newline
    saved = json.loads(saved_json.read_text())
    assert saved["tokens"] == 8 * 15 and saved["perplexity"] > 1

    cli.main(
        [
            "eval",
            "kld",
            str(other_model),
            "--base",
            str(base_file),
            "--out",
            str(result_json),
            "--no-progress",
        ]
    )
    printed = capsys.readouterr().out
    result = json.loads(result_json.read_text())
    model, tokenizer = load(other_model)
    expected = kl_divergence(model, tokenizer, read_base_logits(base_file))
    assert result["kld"]["mean"] == pytest.approx(expected.mean_kld, rel=1e-9) and expected.mean_kld > 0.05
    assert result["tokens"] == 8 * 15 and result["same_top"]["mean"] == pytest.approx(expected.same_top)
    assert f"Mean    KLD: {expected.mean_kld:10.6f}" in printed and "Same top p:" in printed
    assert "99.9%   KLD:" in printed and "RMS Δp    :" in printed

    cli.main(
        ["eval", "kld", str(base_model), "--base", str(base_file), "--chunks", "2", "--out", str(result_json)]
    )
    itself = json.loads(result_json.read_text())
    assert itself["chunks"] == 2 and abs(itself["kld"]["mean"]) < 1e-4 and itself["same_top"]["mean"] == 1.0


def test_a_logits_file_as_model_is_measured_against_the_base(tiny_files, tmp_path, capsys):
    """MODEL may be another program's base file on the same tokens: the statistic alone."""
    base_model, other_model, text = tiny_files
    base_file, other_file, out = tmp_path / "b.kld", tmp_path / "o.kld", tmp_path / "kld.json"
    cli.main(["eval", "kld", str(base_model), "--save-base", str(base_file), "--data", str(text), "--ctx", "32",
              "--chunks", "4", "--no-progress"])  # fmt: skip
    cli.main(["eval", "kld", str(other_model), "--save-base", str(other_file), "--tokens-of", str(base_file),
              "--no-progress"])  # fmt: skip
    cli.main(["eval", "kld", str(other_file), "--base", str(base_file), "--out", str(out)])
    measured = json.loads(out.read_text())
    # these tiny models are many nats apart, past the 16 nats a file keeps (tests/eval/test_kld.py
    # compares the two ways on models within it): here the command's figures are file_divergence's
    expected = file_divergence(read_base_logits(other_file), read_base_logits(base_file))
    assert measured["model"] == str(other_file) and measured["tokens"] == 4 * 15
    assert measured["kld"]["mean"] == pytest.approx(expected.mean_kld, rel=1e-9) and expected.mean_kld > 0.05
    assert "Mean    KLD:" in capsys.readouterr().out
    err = user_error(capsys, ["eval", "kld", str(other_file), "--save-base", str(tmp_path / "x.kld"),
                              "--tokens-of", str(base_file)])  # fmt: skip
    assert "o.kld is a base logits file; it is measured against another: give --base FILE" in err
    err = user_error(
        capsys, ["eval", "kld", str(other_file), "--base", str(base_file), "--cache-type-k", "q8_0"]
    )
    assert "o.kld is a logits file" in err


def user_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_errors_name_what_is_wrong(tiny_files, tmp_path, capsys):
    base_model, _, text = tiny_files
    err = user_error(capsys, ["eval", "kld", str(base_model), "--save-base", str(tmp_path / "b.kld")])
    assert "--save-base needs the text to run over: give --data" in err
    err = user_error(capsys, ["eval", "kld", str(base_model), "--base", str(tmp_path / "none.kld")])
    assert "none.kld does not exist" in err
    (tmp_path / "short.txt").write_text("A few words only.")
    short = [
        "eval",
        "kld",
        str(base_model),
        "--save-base",
        str(tmp_path / "b.kld"),
        "--data",
        str(tmp_path / "short.txt"),
    ]
    assert "a context of 64 needs at least 128" in user_error(capsys, [*short, "--ctx", "64"])
    assert "ctx must be in [4, 128] (the model's max_seq_len); got 512" in user_error(capsys, short)
    assert not (tmp_path / "b.kld").exists()


def test_a_base_file_of_another_vocabulary_is_refused(tiny_files, tmp_path, capsys):
    base_model, _, _ = tiny_files
    write_base_logits(tmp_path / "wide.kld", 16, 5000, torch.zeros(1, 16, dtype=torch.int32).numpy(),
                      [torch.zeros(7, 5000)])  # fmt: skip
    err = user_error(capsys, ["eval", "kld", str(base_model), "--base", str(tmp_path / "wide.kld")])
    vocab = load(base_model)[1].vocab_size
    assert re.search(rf"wide\.kld holds .* vocabulary of 5000 tokens; the model has {vocab}", err)


# ---- against llama-perplexity, where a llama.cpp build has it ----


@pytest.mark.skipif(llama_perplexity() is None, reason="no llama.cpp build with llama-perplexity")
def test_llama_perplexity_and_we_read_each_others_files(tiny_files, tmp_path):
    binary = llama_perplexity()
    base_model, other_model, text = tiny_files
    theirs, ours, out = tmp_path / "theirs.kld", tmp_path / "ours.kld", tmp_path / "kld.json"

    run_llama_perplexity(binary, base_model, "-f", str(text), "--kl-divergence-base", str(theirs))
    their_kld = printed_mean_kld(
        run_llama_perplexity(binary, other_model, "--kl-divergence-base", str(theirs), "--kl-divergence")
    )
    cli.main(["eval", "kld", str(other_model), "--base", str(theirs), "--out", str(out), "--no-progress"])
    assert json.loads(out.read_text())["kld"]["mean"] == pytest.approx(their_kld, rel=0.01)

    cli.main(["eval", "kld", str(base_model), "--save-base", str(ours), "--data", str(text), "--ctx", "32",
              "--no-progress"])  # fmt: skip
    assert read_base_logits(ours).chunks == read_base_logits(theirs).chunks
    from_ours = printed_mean_kld(
        run_llama_perplexity(binary, other_model, "--kl-divergence-base", str(ours), "--kl-divergence")
    )
    assert from_ours == pytest.approx(their_kld, rel=0.01)
