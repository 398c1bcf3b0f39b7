"""Tiny random models of the dense families of 2026 that llama.cpp files under their own names,
from transformers' own classes (SmolLM3ForCausalLM; Phi3ForCausalLM with LongRoPE, shaped as
Phi-4-mini), and their GGUF files written as llama.cpp's convert_hf_to_gguf.py writes them (its
SmolLM3Model is its LlamaModel: q/k rows permuted; its Phi3MiniModel writes the LongRoPE factors
as two tensors and the attention factor as rope.scaling.attn_factor)."""

from __future__ import annotations

import math

import numpy as np
import torch

from helpers.gguf import (
    _perturb_norms_and_biases,
    llama_metadata,
    llama_tensors,
    phi3_metadata,
    phi3_tensors,
    tiny_vocabulary,
)

VOCAB = len(tiny_vocabulary()["tokenizer.ggml.tokens"])


def tiny_smollm3(n_layers: int = 5, seed: int = 0, **overrides):
    """Five layers: layer 3 rotates nothing (transformers' interval of 4)."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    torch.manual_seed(seed)
    values = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _perturb_norms_and_biases(SmolLM3ForCausalLM(SmolLM3Config(**{**values, **overrides})))


def smollm3_tensors(model, types) -> dict[str, tuple[np.ndarray, str]]:
    return llama_tensors(model, types)


def smollm3_metadata(model) -> dict:
    return {key.replace("llama.", "smollm3.", 1): value for key, value in llama_metadata(model).items()}


ORIGINAL_CONTEXT = 32  # the tiny Phi-4-mini's original context: the tests' sequences pass it


def longrope_factors(half: int, seed: int = 5) -> dict:
    """Short factors near 1 and long ones up to 20, as the released configs have them (Phi-4-mini's
    long factors reach ~60): positions past the original context turn visibly slower."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "short_factor": (1 + torch.rand(half, generator=generator) * 0.5).tolist(),
        "long_factor": (1 + torch.rand(half, generator=generator) * 20).tolist(),
    }


def tiny_phi4_mini(
    partial_rotary_factor: float = 0.75, seed: int = 0, head_dim: int = 16, vocab_size: int = VOCAB, **rope
):
    """Phi-4-mini's shape in small: LongRoPE over 3/4 of a head (heads of 16: 12 channels, 6
    factors each), tied embeddings, a context 8x the original one. Heads of 32 hold a q8_0 block."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    half = int(head_dim * partial_rotary_factor) // 2
    config = Phi3Config(
        vocab_size=vocab_size,
        hidden_size=4 * head_dim,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8 * ORIGINAL_CONTEXT,
        original_max_position_embeddings=ORIGINAL_CONTEXT,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": partial_rotary_factor,
            **longrope_factors(half),
            **rope,
        },
        tie_word_embeddings=True,
        sliding_window=None,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return _perturb_norms_and_biases(Phi3ForCausalLM(config))


def phi4_mini_tensors(model, types) -> dict[str, tuple[np.ndarray, str]]:
    rope = model.config.rope_parameters
    return {
        **phi3_tensors(model, types),
        "rope_factors_long.weight": (np.asarray(rope["long_factor"], dtype=np.float32), "F32"),
        "rope_factors_short.weight": (np.asarray(rope["short_factor"], dtype=np.float32), "F32"),
    }


def phi4_mini_metadata(model) -> dict:
    """The converter's attention factor: sqrt(1 + ln(scale) / ln(original)), scale = context / original."""
    config = model.config
    scale = config.max_position_embeddings / config.original_max_position_embeddings
    factor = math.sqrt(1 + math.log(scale) / math.log(config.original_max_position_embeddings))
    return {**phi3_metadata(model, sliding_window=0), "phi3.rope.scaling.attn_factor": factor}


# ---- SmolLM3's chat ----

# A template of SmolLM3's shape, written here after it (not copied): its reasoning mode from
# enable_thinking or a /think, /no_think flag in the system message (taken out of the
# instructions), an empty <think></think> closing the reasoning in /no_think mode, tools in
# <tools> with calls asked for in <tool_call> tags, tool results as user turns, and
# {% generation %} around the assistant's turns.
SMOLLM3_SHAPED = """
{%- if enable_thinking is not defined -%}{%- set enable_thinking = true -%}{%- endif -%}
{%- set mode = "/think" if enable_thinking else "/no_think" -%}
{%- set instructions = "" -%}
{%- if messages[0].role == "system" -%}
  {%- set text = messages[0].content -%}
  {%- if "/no_think" in text -%}{%- set mode = "/no_think" -%}
  {%- elif "/think" in text -%}{%- set mode = "/think" -%}{%- endif -%}
  {%- set instructions = text.replace("/no_think", "").replace("/think", "").rstrip() -%}
{%- endif -%}
{{- "<|im_start|>system\\n## Mode\\n\\n" + mode + "\\n\\n## Instructions\\n\\n" -}}
{{- (instructions or "Be useful.") + "\\n\\n" -}}
{%- if tools -%}
  {%- set ns = namespace(listing="<tools>\\n") -%}
  {%- for tool in tools -%}{%- set ns.listing = ns.listing ~ (tool | tojson) ~ "\\n" -%}{%- endfor -%}
  {{- "## Tools\\n\\n" + ns.listing + "</tools>\\nCall one with <tool_call>{\\"name\\": ..., \\"arguments\\": ...}</tool_call>.\\n\\n" -}}
{%- endif -%}
{{- "<|im_end|>\\n" -}}
{%- for message in messages -%}
  {%- set content = message.content if message.content is string else "" -%}
  {%- if message.role == "user" or message.role == "tool" -%}
    {{ "<|im_start|>user\\n" + content + "<|im_end|>\\n" }}
  {%- elif message.role == "assistant" -%}
    {% generation %}
    {{- "<|im_start|>assistant\\n" + ("" if mode == "/think" else "<think>\\n\\n</think>\\n") -}}
    {{- content.lstrip("\\n") + "<|im_end|>\\n" -}}
    {% endgeneration %}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{ "<|im_start|>assistant\\n" + ("" if mode == "/think" else "<think>\\n\\n</think>\\n") }}
{%- endif -%}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

# a random model's free strings run to max_tokens: a closed set keeps its calls short
CITY = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}


# ---- Phi-4-mini's chat ----

# A template of Phi-4-mini's shape, written here after it (not copied): <|role|> turns closed by
# <|end|>, the tools as JSON between <|tool|> and <|/tool|> in the system turn, an assistant's
# calls as a JSON array between <|tool_call|> and <|/tool_call|>.
PHI4_MINI_SHAPED = """
{%- set system = messages[0].content if messages and messages[0].role == "system" else "" -%}
{%- if system or tools -%}
  {{- "<|system|>" + (system or "You are a helpful assistant.") -}}
  {%- if tools -%}{{- "<|tool|>" + (tools | tojson) + "<|/tool|>" -}}{%- endif -%}
  {{- "<|end|>" -}}
{%- endif -%}
{%- for message in messages if message.role != "system" -%}
  {%- if message.role == "assistant" and message.tool_calls -%}
    {%- set ns = namespace(calls=[]) -%}
    {%- for call in message.tool_calls -%}
      {%- set ns.calls = ns.calls + [{"name": call.function.name, "arguments": call.function.arguments}] -%}
    {%- endfor -%}
    {{- "<|assistant|><|tool_call|>" + (ns.calls | tojson) + "<|/tool_call|><|end|>" -}}
  {%- else -%}
    {{- "<|" + message.role + "|>" + (message.content if message.content is string else "") + "<|end|>" -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|assistant|>" -}}{%- endif -%}
"""
