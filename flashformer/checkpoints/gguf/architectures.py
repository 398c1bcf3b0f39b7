"""What a GGUF architecture means in transformers' terms: its config.json and, for every tensor
of the file, the transformers name it goes under and the shape the metadata implies.

The result is what `flashformer.model.hf` already reads from a Hugging Face folder, so the naming
rules between transformers' parameters and ours stay in one place (the hf families). Two
things llama.cpp's converter changed are undone on the way:

- llama: the rows of the q and k projections were reordered per head, from transformers'
  "rotate half" layout (the first half of a head's dims pairs with the second half) to
  interleaved pairs (dims 2i and 2i+1 rotate together), which is what ggml's RoPE reads.
  k is reordered over the KV heads, q over the query heads.
- gpt2: the Conv1D weights, stored (in, out) by transformers, were written (out, in).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flashformer.checkpoints.gguf.reader import GGUFError, GGUFFile


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the file: its GGUF name, transformers' name, and its (out, in) shape."""

    gguf: str
    hf: str
    shape: tuple[int, ...]
    rope_heads: int | None = None  # q/k of llama: rows interleaved per head over this many heads
    conv1d: bool = False  # gpt2: transformers keeps this weight transposed, (in, out)
    plus_one: bool = False  # gemma's norms: the file holds 1 + w, transformers w


def rope_row_permutation(rows: int, heads: int) -> Tensor:
    """The index that puts llama.cpp's q or k rows back in transformers' order:
    transformers_rows = file_rows[index]. A row permutation, so it applies equally to rows of
    quantized blocks."""
    head_dim = rows // heads
    file_rows = torch.arange(rows).reshape(heads, head_dim // 2, 2)  # (head, pair i, member j)
    return file_rows.transpose(1, 2).reshape(rows)  # transformers' row h*D + j*D/2 + i


def vocab_size(file: GGUFFile, arch: str) -> int:
    """The vocabulary size: the architecture's key, else the tokenizer's token count."""
    tokens = file.metadata.get("tokenizer.ggml.tokens")
    declared = file.value(f"{arch}.vocab_size", int, None)
    if declared is not None and tokens is not None and declared != len(tokens):
        raise GGUFError(
            f"{file.path}: {arch}.vocab_size={declared} but tokenizer.ggml.tokens lists {len(tokens)} tokens"
        )
    if declared is None and tokens is None:
        raise GGUFError(
            f"{file.path}: the metadata gives no vocabulary size ({arch}.vocab_size or tokenizer.ggml.tokens)"
        )
    return declared if declared is not None else len(tokens)


def special_token_ids(file: GGUFFile) -> dict:
    return {
        "bos_token_id": file.value("tokenizer.ggml.bos_token_id", int, None),
        "eos_token_id": file.value("tokenizer.ggml.eos_token_id", int, None),
        "pad_token_id": file.value("tokenizer.ggml.padding_token_id", int, None),
    }


class Llama:
    """LLaMA and the models llama.cpp files under it: SmolLM, TinyLlama, Mistral-style GQA."""

    name = "llama"

    def config(self, file: GGUFFile) -> dict:
        key = "llama."
        d_model = file.value(key + "embedding_length", int)
        n_heads = file.value(key + "attention.head_count", int)
        kv_heads = file.value(key + "attention.head_count_kv", int, n_heads)
        head_dim = file.value(key + "attention.key_length", int, d_model // n_heads)
        if n_heads < 1 or kv_heads < 1 or n_heads % kv_heads:
            raise GGUFError(
                f"{file.path}: {n_heads} query heads cannot share {kv_heads} KV heads "
                f"(llama.attention.head_count must be a multiple of llama.attention.head_count_kv)"
            )
        unsupported = {
            key + "attention.value_length": (
                file.value(key + "attention.value_length", int, head_dim),
                head_dim,
            ),
            key + "rope.dimension_count": (file.value(key + "rope.dimension_count", int, head_dim), head_dim),
            key + "expert_count": (file.value(key + "expert_count", int, 0), 0),
        }
        for name, (value, supported) in unsupported.items():
            if value != supported:
                raise GGUFError(
                    f"{file.path}: {name}={value} is not supported (flashformer's llama needs {supported}: "
                    f"value heads as wide as key heads, RoPE over the whole head, no mixture of experts)"
                )
        if "rope_freqs.weight" in file.tensors:
            raise GGUFError(
                f"{file.path}: tensor 'rope_freqs.weight' (per-frequency RoPE factors, as Llama 3.1 files "
                f"carry) is not supported"
            )
        theta = float(file.value(key + "rope.freq_base", (int, float), 10000.0))
        rope = {"rope_type": "default", "rope_theta": theta}
        scaling = file.value(key + "rope.scaling.type", str, "none")
        factor = file.value(key + "rope.scaling.factor", (int, float), None)
        if scaling == "none" and key + "rope.scale_linear" in file.metadata:  # older files
            scaling, factor = "linear", file.value(key + "rope.scale_linear", (int, float))
        if scaling == "linear" and factor not in (None, 1, 1.0):
            rope.update(rope_type="linear", factor=float(factor))
        elif scaling not in ("none", "linear"):
            raise GGUFError(
                f"{file.path}: llama.rope.scaling.type={scaling!r} is not supported ('none', 'linear')"
            )

        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size(file, "llama"),
            "hidden_size": d_model,
            "intermediate_size": file.value(key + "feed_forward_length", int),
            "num_hidden_layers": file.value(key + "block_count", int),
            "num_attention_heads": n_heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": file.value(key + "context_length", int),
            "rms_norm_eps": float(file.value(key + "attention.layer_norm_rms_epsilon", (int, float))),
            "rope_theta": theta,
            "rope_parameters": rope,
            "attention_bias": "blk.0.attn_q.bias" in file.tensors,
            "mlp_bias": "blk.0.ffn_up.bias" in file.tensors,
            "tie_word_embeddings": "output.weight" not in file.tensors,
            **special_token_ids(file),
            "torch_dtype": "float32",
        }

    def tensors(self, hf: dict) -> list[TensorSpec]:
        d, vocab, ff = hf["hidden_size"], hf["vocab_size"], hf["intermediate_size"]
        heads, kv_heads, head_dim = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
        q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
        specs = [
            TensorSpec("token_embd.weight", "model.embed_tokens.weight", (vocab, d)),
            TensorSpec("output_norm.weight", "model.norm.weight", (d,)),
        ]
        if not hf["tie_word_embeddings"]:
            specs.append(TensorSpec("output.weight", "lm_head.weight", (vocab, d)))
        for i in range(hf["num_hidden_layers"]):
            blk, layer = f"blk.{i}", f"model.layers.{i}"
            attn, mlp = f"{layer}.self_attn", f"{layer}.mlp"
            projections = [
                ("attn_q", f"{attn}.q_proj", (q_rows, d), heads),
                ("attn_k", f"{attn}.k_proj", (kv_rows, d), kv_heads),
                ("attn_v", f"{attn}.v_proj", (kv_rows, d), None),
                ("attn_output", f"{attn}.o_proj", (d, q_rows), None),
            ]
            specs += [
                TensorSpec(f"{blk}.attn_norm.weight", f"{layer}.input_layernorm.weight", (d,)),
                TensorSpec(f"{blk}.ffn_norm.weight", f"{layer}.post_attention_layernorm.weight", (d,)),
                TensorSpec(f"{blk}.ffn_gate.weight", f"{mlp}.gate_proj.weight", (ff, d)),
                TensorSpec(f"{blk}.ffn_up.weight", f"{mlp}.up_proj.weight", (ff, d)),
                TensorSpec(f"{blk}.ffn_down.weight", f"{mlp}.down_proj.weight", (d, ff)),
            ]
            for gguf_name, hf_name, shape, rope_heads in projections:
                specs.append(TensorSpec(f"{blk}.{gguf_name}.weight", f"{hf_name}.weight", shape, rope_heads))
                if hf["attention_bias"]:
                    specs.append(
                        TensorSpec(f"{blk}.{gguf_name}.bias", f"{hf_name}.bias", shape[:1], rope_heads)
                    )
            if hf["mlp_bias"]:
                for gguf_name, hf_name, rows in (
                    ("ffn_gate", "gate_proj", ff),
                    ("ffn_up", "up_proj", ff),
                    ("ffn_down", "down_proj", d),
                ):
                    specs.append(TensorSpec(f"{blk}.{gguf_name}.bias", f"{mlp}.{hf_name}.bias", (rows,)))
        return specs

    def summary(self, hf: dict) -> str:
        return (
            f"vocab {hf['vocab_size']}, d_model {hf['hidden_size']}, {hf['num_attention_heads']} heads of "
            f"{hf['head_dim']} ({hf['num_key_value_heads']} KV), feed-forward {hf['intermediate_size']}"
        )


class GPT2:
    """GPT-2: learned positions, LayerNorm with biases, fused qkv, tied head."""

    name = "gpt2"

    def config(self, file: GGUFFile) -> dict:
        key = "gpt2."
        d_model = file.value(key + "embedding_length", int)
        n_heads = file.value(key + "attention.head_count", int)
        if n_heads < 1 or d_model % n_heads:
            raise GGUFError(
                f"{file.path}: gpt2.embedding_length={d_model} is not a multiple of gpt2.attention.head_count={n_heads}"
            )
        context = file.value(key + "context_length", int)
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": vocab_size(file, "gpt2"),
            "n_embd": d_model,
            "n_layer": file.value(key + "block_count", int),
            "n_head": n_heads,
            "n_inner": file.value(key + "feed_forward_length", int, 4 * d_model),
            "n_positions": context,
            "n_ctx": context,
            "layer_norm_epsilon": float(file.value(key + "attention.layer_norm_epsilon", (int, float))),
            "activation_function": "gelu_new",
            "tie_word_embeddings": "output.weight" not in file.tensors,
            **special_token_ids(file),
            "torch_dtype": "float32",
        }

    def tensors(self, hf: dict) -> list[TensorSpec]:
        d, vocab, ff = hf["n_embd"], hf["vocab_size"], hf["n_inner"]
        specs = [
            TensorSpec("token_embd.weight", "transformer.wte.weight", (vocab, d)),
            TensorSpec("position_embd.weight", "transformer.wpe.weight", (hf["n_positions"], d)),
            TensorSpec("output_norm.weight", "transformer.ln_f.weight", (d,)),
            TensorSpec("output_norm.bias", "transformer.ln_f.bias", (d,)),
        ]
        if not hf["tie_word_embeddings"]:
            specs.append(TensorSpec("output.weight", "lm_head.weight", (vocab, d)))
        for i in range(hf["n_layer"]):
            blk, layer = f"blk.{i}", f"transformer.h.{i}"
            for gguf_name, hf_name, rows, cols, conv1d in (
                ("attn_norm", "ln_1", d, None, False),
                ("attn_qkv", "attn.c_attn", 3 * d, d, True),
                ("attn_output", "attn.c_proj", d, d, True),
                ("ffn_norm", "ln_2", d, None, False),
                ("ffn_up", "mlp.c_fc", ff, d, True),
                ("ffn_down", "mlp.c_proj", d, ff, True),
            ):
                weight_shape = (rows,) if cols is None else (rows, cols)
                specs += [
                    TensorSpec(
                        f"{blk}.{gguf_name}.weight", f"{layer}.{hf_name}.weight", weight_shape, conv1d=conv1d
                    ),
                    TensorSpec(f"{blk}.{gguf_name}.bias", f"{layer}.{hf_name}.bias", (rows,)),
                ]
        return specs

    def summary(self, hf: dict) -> str:
        return (
            f"vocab {hf['vocab_size']}, d_model {hf['n_embd']}, {hf['n_head']} heads, "
            f"feed-forward {hf['n_inner']}, context {hf['n_positions']}"
        )


ARCHITECTURES = {arch.name: arch for arch in (Llama(), GPT2())}
