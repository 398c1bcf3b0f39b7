"""A thinking model small enough to script: a qwen3 GGUF file (written with gguf's writer, as
tests/helpers/gguf.py writes its files) whose chat template thinks as Qwen3's does, and whose
weights make it a bigram machine: every attention and feed-forward output is zeroed, so the
logits depend on the last token alone, and the head sends each scripted token to the next.

    Ċ (the generation prompt's end)   <think> h m </think> o k <|im_end|>
    ĊĊ (after enable_thinking=false's empty <think></think>)               o k <|im_end|>

So the greedy answer is "<think>hm</think>ok" with thinking on and "ok" with it off, and a
grammar that holds the answer still sees the model prefer its script wherever it may.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from helpers.gguf import (
    new_decoder_metadata,
    new_decoder_tensors,
    tiny_new_decoder,
    tiny_vocabulary,
    write_gguf,
)

THINKING_TEMPLATE = """{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}"""

SCRIPT = [("Ċ", "<think>"), ("<think>", "h"), ("h", "m"), ("m", "</think>"), ("</think>", "o"),
          ("ĊĊ", "o"), ("o", "k"), ("k", "<|im_end|>")]  # fmt: skip
REASONING, ANSWER = "hm", "ok"
STRENGTH = 20.0  # the scripted next token's logit; any other is within about STRENGTH / 2


def thinking_vocabulary() -> dict:
    """tiny_vocabulary with </think> (user-defined, as <think>: text, not a control token)."""
    vocabulary = tiny_vocabulary()
    vocabulary["tokenizer.ggml.tokens"] = vocabulary["tokenizer.ggml.tokens"] + ["</think>"]
    vocabulary["tokenizer.ggml.token_type"] = vocabulary["tokenizer.ggml.token_type"] + [4]
    return vocabulary


def thinking_qwen3_gguf(folder: Path) -> Path:
    """The scripted qwen3 file (see the module docstring), with a 2048-token context."""
    vocabulary = thinking_vocabulary()
    tokens = vocabulary["tokenizer.ggml.tokens"]
    model = tiny_new_decoder("qwen3", vocab_size=len(tokens), max_position_embeddings=2048)
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream is the token's embedding alone
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        embeddings = model.model.embed_tokens.weight  # (V, d)
        normed = embeddings / embeddings.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()  # (V, d), RMS 1
        head = torch.zeros_like(model.lm_head.weight)  # (V, d)
        for token, following in SCRIPT:
            head[tokens.index(following)] += STRENGTH * normed[tokens.index(token)] / normed.shape[1]
        model.lm_head.weight.copy_(head)
    metadata = {**new_decoder_metadata(model, "qwen3"), **vocabulary}
    metadata["qwen3.context_length"] = 2048
    metadata["tokenizer.chat_template"] = THINKING_TEMPLATE
    tensors = new_decoder_tensors(model, "qwen3")
    assert all(np.isfinite(values).all() for values, _ in tensors.values())
    return write_gguf(folder / "thinking-qwen3.gguf", "qwen3", metadata, tensors)
