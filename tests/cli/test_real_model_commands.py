"""The commands a user types with a real model (SmolLM2-135M-Instruct from its GGUF file):
`generate --chat`, `chat` and `eval perplexity`."""

from __future__ import annotations

import json

import pytest
from helpers.gguf import smollm2_model, smollm2_tokenizer

import flashformer
from flashformer.checkpoints.gguf.packaged_models import smollm2_path
from flashformer.cli import commands as cli
from flashformer.eval.perplexity import perplexity
from flashformer.generate.chat import Chat

# The file's own blocks with float32 activations: this 135M model's Q4_1 file answers these questions
# otherwise once its activations are rounded to int8 (the default, as llama.cpp runs it; README's tour
# shows both answers)
EXACT = ["--activations", "float32"]


def test_generate_chat_answers_one_message(capsys):
    question = ["--chat", "--prompt", "What is the capital of France?", "--greedy"]
    cli.main(["generate", str(smollm2_path()), *question, *EXACT])
    assert capsys.readouterr().out == "The capital of France is Paris.\n"


def test_chat_command_keeps_the_conversation(monkeypatch, capsys):
    from flashformer.cli import chat as chat_command

    lines = iter(["What is the capital of France?", "", "And of Germany?"])

    def typed(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    args = cli.build_parser().parse_args(
        ["chat", str(smollm2_path()), "--greedy", "--max-new-tokens", "20", *EXACT]
    )
    chat_command.main_from_args(args, input_line=typed)
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["The capital of France is Paris.", "The capital of Germany is Berlin."]


def test_eval_perplexity_prints_and_writes_json(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 8)
    (tmp_path / "b.md").write_text("Paris is the capital of France. " * 6)
    out = tmp_path / "ppl.json"
    argv = ["eval", "perplexity", str(smollm2_path()), "--data", str(tmp_path / "*.*"), "--context", "64"]
    cli.main([*argv, "--stride", "32", "--out", str(out), "--no-progress"])
    result = json.loads(out.read_text())
    assert result["texts"] == 2 and "bits/byte" in capsys.readouterr().out
    texts = [(tmp_path / name).read_text() for name in ("a.txt", "b.md")]
    as_typed = flashformer.from_pretrained(smollm2_path())  # the default: the file's own blocks
    expected = perplexity(as_typed, smollm2_tokenizer(), texts, context=64, stride=32)
    assert result["perplexity"] == pytest.approx(expected.perplexity, rel=1e-12)
    assert result["tokens"] == expected.tokens


def test_a_chat_template_can_be_given_for_a_model_without_one(tmp_path, capsys):
    import copy

    tokenizer = copy.copy(smollm2_tokenizer())
    template, tokenizer.chat_template = tokenizer.chat_template, None
    with pytest.raises(ValueError, match="--chat-template"):
        Chat(smollm2_model(), tokenizer)
    chat = Chat(smollm2_model(), tokenizer, chat_template=template, do_sample=False)
    assert "".join(chat.send("What is the capital of France?")) == "The capital of France is Paris."
    (tmp_path / "chatml.jinja").write_text(template)
    argv = [
        "generate",
        str(smollm2_path()),
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--greedy",
    ]
    cli.main([*argv, "--chat-template", str(tmp_path / "chatml.jinja"), "--system", "Be brief."])
    assert "Paris" in capsys.readouterr().out
