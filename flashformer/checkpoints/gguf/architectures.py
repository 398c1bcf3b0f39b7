"""What a GGUF architecture means in transformers' terms: its config.json and, for every tensor
of the file, the transformers name it goes under and the shape the metadata implies.

The result is what `flashformer.model.hf` already reads from a Hugging Face folder, so the naming
rules between transformers' parameters and ours stay in one place (the hf families). Two
things llama.cpp's converter changed are undone on the way:

- llama: the rows of the q and k projections were reordered per head, from transformers'
  "rotate half" layout (the first half of a head's dims pairs with the second half) to
  interleaved pairs (dims 2i and 2i+1 rotate together), which is what ggml's RoPE reads.
  k is reordered over the KV heads, q over the query heads. (qwen2 and phi3 use ggml's
  rotate-half "NEOX" RoPE: their rows were not reordered.) Llama 3's rope scaling was
  written as per-frequency divisors (rope_freqs.weight): see rope_freqs.py.
- gpt2: the Conv1D weights, stored (in, out) by transformers, were written (out, in).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flashformer.checkpoints.gguf.reader import GGUFError, GGUFFile
from flashformer.checkpoints.gguf.rope_freqs import llama3_rope_parameters


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the file: its GGUF name, transformers' name, and its (out, in) shape."""

    gguf: str
    hf: str | None  # None: read into the config (rope_freqs.weight), not a weight
    shape: tuple[int, ...]
    rope_heads: int | None = None  # q/k of llama: rows interleaved per head over this many heads
    conv1d: bool = False  # gpt2: transformers keeps this weight transposed, (in, out)
    optional: bool = False  # may be absent from the file (rope_freqs.weight)


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


LLAMA_SHAPED_KEYS = (
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "vocab_size",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.dimension_count",
    "rope.freq_base",
    "expert_count",
    "expert_used_count",
)


def refuse_unread_keys(file: GGUFFile, arch: str, read: tuple[str, ...]) -> None:
    """A key of the architecture that flashformer does not read may change the computation:
    refused by name rather than ignored."""
    for key, value in file.metadata.items():
        if key.startswith(arch + ".") and key.removeprefix(arch + ".") not in read:
            raise GGUFError(
                f"{file.path}: metadata {key}={value!r} is not supported: flashformer's {arch} does not "
                f"read it (it reads {arch}.{{{', '.join(read)}}})"
            )


def llama_shaped_config(file: GGUFFile, arch: str, rope_dims: str = "all") -> dict:
    """The config.json keys of a LLaMA-shaped file (RMSNorm, SwiGLU, RoPE, GQA) that the
    llama, qwen2 and phi3 architectures share, with their checks. rope_dims "all": RoPE must
    turn the whole head; "partial": the rotated channels may be fewer (partial_rotary_factor)."""
    key = arch + "."
    d_model = file.value(key + "embedding_length", int)
    n_heads = file.value(key + "attention.head_count", int)
    kv_heads = file.value(key + "attention.head_count_kv", int, n_heads)
    if n_heads < 1 or kv_heads < 1 or n_heads % kv_heads:
        raise GGUFError(
            f"{file.path}: {n_heads} query heads cannot share {kv_heads} KV heads "
            f"({key}attention.head_count must be a multiple of {key}attention.head_count_kv)"
        )
    head_dim = file.value(key + "attention.key_length", int, d_model // n_heads)
    rotary = file.value(key + "rope.dimension_count", int, head_dim)
    unsupported = {
        key + "attention.value_length": (file.value(key + "attention.value_length", int, head_dim), head_dim),
        key + "expert_count": (file.value(key + "expert_count", int, 0), 0),
        key + "expert_used_count": (file.value(key + "expert_used_count", int, 0), 0),
    }
    if rope_dims == "all" or not (0 < rotary <= head_dim and rotary % 2 == 0):
        unsupported[key + "rope.dimension_count"] = (rotary, head_dim)
    for name, (value, supported) in unsupported.items():
        if value != supported:
            raise GGUFError(
                f"{file.path}: {name}={value} is not supported (flashformer's {arch} needs {supported}: "
                f"value heads as wide as key heads, RoPE over "
                f"{'the whole head' if rope_dims == 'all' else 'an even number of channels up to a head'}, "
                f"no mixture of experts)"
            )
    theta = float(file.value(key + "rope.freq_base", (int, float), 10000.0))
    return {
        "vocab_size": vocab_size(file, arch),
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
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": "output.weight" not in file.tensors,
        **special_token_ids(file),
        "torch_dtype": "float32",
    }


def llama_shaped_tensors(
    hf: dict,
    rope_permuted: bool,
    qkv_bias: bool = False,
    out_bias: bool = False,
    mlp_bias: bool = False,
) -> list[TensorSpec]:
    """Embedding, final norm, head (untied) and each block's norms, separate q, k, v, o and
    gate, up, down, with the biases asked for. rope_permuted: llama.cpp reordered the q/k rows
    for ggml's interleaved RoPE (llama), q over the query heads and k over the KV heads."""
    d, vocab, ff = hf["hidden_size"], hf["vocab_size"], hf["intermediate_size"]
    q_rows = hf["num_attention_heads"] * hf["head_dim"]
    kv_rows = hf["num_key_value_heads"] * hf["head_dim"]
    q_rope_heads = hf["num_attention_heads"] if rope_permuted else None
    k_rope_heads = hf["num_key_value_heads"] if rope_permuted else None
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
            ("attn_q", f"{attn}.q_proj", (q_rows, d), q_rope_heads, qkv_bias),
            ("attn_k", f"{attn}.k_proj", (kv_rows, d), k_rope_heads, qkv_bias),
            ("attn_v", f"{attn}.v_proj", (kv_rows, d), None, qkv_bias),
            ("attn_output", f"{attn}.o_proj", (d, q_rows), None, out_bias),
        ]
        specs += [
            TensorSpec(f"{blk}.attn_norm.weight", f"{layer}.input_layernorm.weight", (d,)),
            TensorSpec(f"{blk}.ffn_norm.weight", f"{layer}.post_attention_layernorm.weight", (d,)),
            TensorSpec(f"{blk}.ffn_gate.weight", f"{mlp}.gate_proj.weight", (ff, d)),
            TensorSpec(f"{blk}.ffn_up.weight", f"{mlp}.up_proj.weight", (ff, d)),
            TensorSpec(f"{blk}.ffn_down.weight", f"{mlp}.down_proj.weight", (d, ff)),
        ]
        for gguf_name, hf_name, shape, rope_heads, bias in projections:
            specs.append(TensorSpec(f"{blk}.{gguf_name}.weight", f"{hf_name}.weight", shape, rope_heads))
            if bias:
                specs.append(TensorSpec(f"{blk}.{gguf_name}.bias", f"{hf_name}.bias", shape[:1], rope_heads))
        if mlp_bias:
            for gguf_name, hf_name, rows in (
                ("ffn_gate", "gate_proj", ff),
                ("ffn_up", "up_proj", ff),
                ("ffn_down", "down_proj", d),
            ):
                specs.append(TensorSpec(f"{blk}.{gguf_name}.bias", f"{mlp}.{hf_name}.bias", (rows,)))
    return specs


def llama_shaped_summary(hf: dict) -> str:
    return (
        f"vocab {hf['vocab_size']}, d_model {hf['hidden_size']}, {hf['num_attention_heads']} heads of "
        f"{hf['head_dim']} ({hf['num_key_value_heads']} KV), feed-forward {hf['intermediate_size']}"
    )


class Llama:
    """LLaMA and the models llama.cpp files under it: SmolLM, TinyLlama, Mistral-style GQA, and
    Llama 3.1/3.2 with their per-frequency RoPE divisors (`rope_freqs.weight`)."""

    name = "llama"
    keys = LLAMA_SHAPED_KEYS + (
        "rope.scaling.type",
        "rope.scaling.factor",
        "rope.scale_linear",
        # informational beside linear scaling (yarn, which reads them, is refused)
        "rope.scaling.original_context_length",
        "rope.scaling.finetuned",
        "tensor_data_layout",  # older files: "Meta AI original pth", the same interleaved q/k rows
    )

    def config(self, file: GGUFFile) -> dict:
        key = "llama."
        refuse_unread_keys(file, "llama", self.keys)
        hf = llama_shaped_config(file, "llama")
        layout = file.value(key + "tensor_data_layout", str, "Meta AI original pth")
        if layout != "Meta AI original pth":
            raise GGUFError(
                f"{file.path}: llama.tensor_data_layout={layout!r} is not supported ('Meta AI original pth')"
            )
        rope = hf["rope_parameters"]
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
        if "rope_freqs.weight" in file.tensors:
            raw = file.tensors["rope_freqs.weight"]
            if raw.shape != (hf["head_dim"] // 2,):
                raise GGUFError(
                    f"{file.path}: tensor 'rope_freqs.weight' has shape {raw.shape}; the metadata implies "
                    f"({hf['head_dim'] // 2},), one divisor per RoPE channel pair"
                )
            if rope["rope_type"] != "default":
                raise GGUFError(
                    f"{file.path}: tensor 'rope_freqs.weight' together with llama.rope.scaling.type="
                    f"{scaling!r} is not supported (one RoPE scaling at a time)"
                )
            llama3 = llama3_rope_parameters(raw.to_float(), hf["head_dim"], hf["rope_theta"], str(file.path))
            rope.update(llama3 or {})
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **hf,
            "attention_bias": "blk.0.attn_q.bias" in file.tensors,
            "mlp_bias": "blk.0.ffn_up.bias" in file.tensors,
        }

    def tensors(self, hf: dict) -> list[TensorSpec]:
        bias = hf["attention_bias"]
        specs = llama_shaped_tensors(hf, True, qkv_bias=bias, out_bias=bias, mlp_bias=hf["mlp_bias"])
        # read into the config (the llama3 rope parameters, or none for divisors of 1), not a weight
        return specs + [TensorSpec("rope_freqs.weight", None, (hf["head_dim"] // 2,), optional=True)]

    def summary(self, hf: dict) -> str:
        return llama_shaped_summary(hf)


class Qwen2:
    """Qwen2 and Qwen2.5: LLaMA's blocks with biases on q, k and v, none on the output. ggml
    rotates these in the rotate-half ("NEOX") layout, as transformers does, so the q/k rows
    are stored as transformers has them: no permutation to undo."""

    name = "qwen2"
    keys = LLAMA_SHAPED_KEYS

    def config(self, file: GGUFFile) -> dict:
        refuse_unread_keys(file, "qwen2", self.keys)
        return {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            **llama_shaped_config(file, "qwen2"),
            "use_sliding_window": False,
        }

    def tensors(self, hf: dict) -> list[TensorSpec]:
        return llama_shaped_tensors(hf, False, qkv_bias=True)

    def summary(self, hf: dict) -> str:
        return llama_shaped_summary(hf)


class Phi3:
    """Phi-3, Phi-3.5 and Phi-4-mini: q, k, v in one tensor (attn_qkv) and gate and up in one
    (ffn_up, gate rows first), as transformers' Phi3 has them (qkv_proj, gate_up_proj); RoPE
    in the rotate-half layout over the first rope.dimension_count channels of a head.

    attention.sliding_window is read and not applied: llama.cpp switches Phi-3's window off
    (its phi3 model sets no sliding window, whatever the file says) and transformers' GGUF
    loader does not read it, so both compute full causal attention. LongRoPE (the
    rope_factors_long/short tensors and rope.scaling.attn_factor of the 128k-context models)
    is refused by name.
    """

    name = "phi3"
    keys = LLAMA_SHAPED_KEYS + ("rope.scaling.original_context_length", "attention.sliding_window")

    def config(self, file: GGUFFile) -> dict:
        key = "phi3."
        longrope = [n for n in ("rope_factors_long.weight", "rope_factors_short.weight") if n in file.tensors]
        if longrope or key + "rope.scaling.attn_factor" in file.metadata:
            found = longrope or [key + "rope.scaling.attn_factor"]
            raise GGUFError(
                f"{file.path}: {', '.join(map(repr, found))}: LongRoPE (Phi-3's 128k context, Phi-3.5, "
                f"Phi-4-mini) is not supported; supported: phi3 files with plain RoPE (Phi-3-mini-4k)"
            )
        refuse_unread_keys(file, "phi3", self.keys)
        hf = llama_shaped_config(file, "phi3", rope_dims="partial")
        if hf["head_dim"] * hf["num_attention_heads"] != hf["hidden_size"]:
            raise GGUFError(
                f"{file.path}: phi3.attention.key_length={hf['head_dim']} is not supported (transformers' "
                f"phi3 has heads of embedding_length / head_count = "
                f"{hf['hidden_size'] // hf['num_attention_heads']})"
            )
        rotary = file.value(key + "rope.dimension_count", int, hf["head_dim"])
        file.value(key + "attention.sliding_window", int, 0)  # read, checked, not applied (docstring)
        hf["rope_parameters"]["partial_rotary_factor"] = rotary / hf["head_dim"]
        del hf["head_dim"]
        return {
            "architectures": ["Phi3ForCausalLM"],
            "model_type": "phi3",
            **hf,
            "original_max_position_embeddings": file.value(
                key + "rope.scaling.original_context_length", int, hf["max_position_embeddings"]
            ),
            "sliding_window": None,
        }

    def tensors(self, hf: dict) -> list[TensorSpec]:
        d, vocab, ff = hf["hidden_size"], hf["vocab_size"], hf["intermediate_size"]
        head_dim = d // hf["num_attention_heads"]
        qkv_rows = (hf["num_attention_heads"] + 2 * hf["num_key_value_heads"]) * head_dim
        specs = [
            TensorSpec("token_embd.weight", "model.embed_tokens.weight", (vocab, d)),
            TensorSpec("output_norm.weight", "model.norm.weight", (d,)),
        ]
        if not hf["tie_word_embeddings"]:
            specs.append(TensorSpec("output.weight", "lm_head.weight", (vocab, d)))
        for i in range(hf["num_hidden_layers"]):
            blk, layer = f"blk.{i}", f"model.layers.{i}"
            specs += [
                TensorSpec(f"{blk}.attn_norm.weight", f"{layer}.input_layernorm.weight", (d,)),
                TensorSpec(f"{blk}.attn_qkv.weight", f"{layer}.self_attn.qkv_proj.weight", (qkv_rows, d)),
                TensorSpec(f"{blk}.attn_output.weight", f"{layer}.self_attn.o_proj.weight", (d, d)),
                TensorSpec(f"{blk}.ffn_norm.weight", f"{layer}.post_attention_layernorm.weight", (d,)),
                TensorSpec(f"{blk}.ffn_up.weight", f"{layer}.mlp.gate_up_proj.weight", (2 * ff, d)),
                TensorSpec(f"{blk}.ffn_down.weight", f"{layer}.mlp.down_proj.weight", (d, ff)),
            ]
        return specs

    def summary(self, hf: dict) -> str:
        return (
            f"vocab {hf['vocab_size']}, d_model {hf['hidden_size']}, {hf['num_attention_heads']} heads "
            f"({hf['num_key_value_heads']} KV), feed-forward {hf['intermediate_size']}"
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


ARCHITECTURES = {arch.name: arch for arch in (Llama(), Qwen2(), Phi3(), GPT2())}
