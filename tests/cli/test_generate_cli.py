"""`flashformer generate` and `flashformer.load` on checkpoints the trainer
wrote (a few steps of a tiny model) and on a Hugging Face folder; clear
errors for missing or damaged checkpoints and a missing tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

import flashformer
from flashformer.checkpoints.checkpoint import CheckpointError, list_checkpoints
from flashformer.cli import commands as cli

PROMPT = "def "


def run_cli(args, capsys) -> tuple[int, str, str]:
    try:
        code = cli.main(args)
    except SystemExit as exit:
        code = exit.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_load_takes_the_newest_checkpoint_of_a_run(tiny_run):
    model, tokenizer = flashformer.load(tiny_run)
    newest = list_checkpoints(tiny_run)[-1]
    assert newest.name == "step-0000006"
    same, _ = flashformer.load(newest)
    for (name, a), (_, b) in zip(model.state_dict().items(), same.state_dict().items()):
        assert torch.equal(a, b), name
    assert not model.training
    assert tokenizer.decode(tokenizer.encode(PROMPT)) == PROMPT


def test_generate_prints_the_greedy_continuation(tiny_run, capsys):
    code, out, _ = run_cli(
        ["generate", str(tiny_run), "--prompt", PROMPT, "--max-new-tokens", "12", "--greedy"], capsys
    )
    assert code == 0
    model, tokenizer = flashformer.load(tiny_run)
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    eos = tokenizer.token_id("<|endoftext|>")
    expected = model.generate(ids, max_new_tokens=12, eos_token_id=eos)[0, ids.shape[1] :].tolist()
    assert out == PROMPT + tokenizer.decode(expected) + "\n"


def test_seeded_sampling_from_the_command_line_is_reproducible(tiny_run, capsys):
    args = ["generate", str(tiny_run), "--prompt", PROMPT, "--max-new-tokens", "16", "--seed", "3"]
    first = run_cli(args, capsys)
    again = run_cli(args, capsys)
    assert first[0] == again[0] == 0 and first[1] == again[1] and first[1].startswith(PROMPT)


def test_min_p_of_one_samples_the_greedy_text(tiny_run, capsys):
    """--min-p reaches the sampler: 1.0 keeps only the likeliest token, so a draw is greedy."""
    args = ["generate", str(tiny_run), "--prompt", PROMPT, "--max-new-tokens", "12"]
    greedy = run_cli([*args, "--greedy"], capsys)
    drawn = run_cli([*args, "--seed", "3", "--top-k", "0", "--min-p", "1.0"], capsys)
    free = run_cli([*args, "--seed", "3", "--top-k", "0"], capsys)
    assert greedy[0] == drawn[0] == 0 and drawn[1] == greedy[1] != free[1]


def test_beam_search_from_the_command_line(tiny_run, capsys):
    code, out, _ = run_cli(
        ["generate", str(tiny_run), "--prompt", PROMPT, "--max-new-tokens", "8", "--num-beams", "3"], capsys
    )
    model, tokenizer = flashformer.load(tiny_run)
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    eos = tokenizer.token_id("<|endoftext|>")
    expected = model.generate(ids, max_new_tokens=8, num_beams=3, eos_token_id=eos)[0, ids.shape[1] :]
    assert code == 0 and out == PROMPT + tokenizer.decode(expected.tolist()) + "\n"


def test_a_hugging_face_folder_loads_with_its_tokenizer(tmp_path, capsys):
    model = flashformer.build("gpt2-tiny", vocab_size=300)
    model.save_pretrained(tmp_path)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.add_tokens(list("abcdefghij "))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded, loaded_tokenizer = flashformer.load(tmp_path)
    assert isinstance(loaded, flashformer.DecoderModel) and loaded_tokenizer.encode("abc")
    code, out, _ = run_cli(
        ["generate", str(tmp_path), "--prompt", "abc", "--max-new-tokens", "4", "--greedy"], capsys
    )
    assert code == 0 and out.startswith("abc")


def test_a_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    code, _, err = run_cli(["generate", str(tmp_path / "nowhere"), "--prompt", PROMPT], capsys)
    assert code == 2 and "nowhere does not exist" in err
    code, _, err = run_cli(["generate", str(tmp_path), "--prompt", PROMPT], capsys)
    assert code == 2 and "neither a run folder" in err


def test_a_damaged_checkpoint_is_a_clear_error(tiny_run, tmp_path, capsys):
    folder = tmp_path / "step-0000006"
    shutil.copytree(list_checkpoints(tiny_run)[-1], folder)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    code, _, err = run_cli(["generate", str(folder), "--prompt", PROMPT], capsys)
    assert code == 2 and "model.safetensors is corrupt" in err
    with pytest.raises(CheckpointError, match="corrupt"):
        flashformer.load(folder)


def test_a_missing_tokenizer_is_a_clear_error(tiny_run, tmp_path, capsys):
    folder = tmp_path / "step-0000006"
    shutil.copytree(list_checkpoints(tiny_run)[-1], folder)
    (folder / "tokenizer.json").unlink()
    code, _, err = run_cli(["generate", str(folder), "--prompt", PROMPT], capsys)
    assert code == 2 and "tokenizer.json is missing" in err
    hf = tmp_path / "hf"
    flashformer.build("gpt2-tiny").save_pretrained(hf)
    with pytest.raises(CheckpointError, match="has no tokenizer.json"):
        flashformer.load(hf)


def test_an_empty_prompt_is_a_clear_error(tiny_run, capsys):
    code, _, err = run_cli(["generate", str(tiny_run), "--prompt", ""], capsys)
    assert code == 2 and "--prompt" in err and "no tokens" in err


def test_a_config_without_the_model_is_a_clear_error(tiny_run, tmp_path):
    folder = tmp_path / "step-0000006"
    shutil.copytree(list_checkpoints(tiny_run)[-1], folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "config.json").write_text("{}")
    manifest["files"].pop("config.json")  # a consistent manifest, so the config itself is judged
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="lacks the model's config"):
        flashformer.load(folder)


def test_structure_flags_constrain_the_text(tiny_run, tmp_path, capsys):
    """A tiny byte-level run (its vocabulary is the 256 bytes) held to a regex, a choice and a
    JSON schema: the printed continuation matches each (Python's re, json and jsonschema)."""
    import re

    import jsonschema

    base = ["generate", str(tiny_run), "--prompt", PROMPT, "--max-new-tokens", "40"]
    code, out, _ = run_cli(base + ["--regex", "[0-9]{3}-[a-z]{2}"], capsys)
    assert code == 0 and re.fullmatch(r"[0-9]{3}-[a-z]{2}", out[len(PROMPT) : -1]), out
    code, out, _ = run_cli(base + ["--choice", "yes", "--choice", "no", "--seed", "1"], capsys)
    assert code == 0 and out[len(PROMPT) : -1] in ("yes", "no"), out
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"],
        "additionalProperties": False,
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    code, out, _ = run_cli(base + ["--json-schema", str(tmp_path / "schema.json")], capsys)
    assert code == 0
    jsonschema.validate(json.loads(out[len(PROMPT) : -1]), schema)
