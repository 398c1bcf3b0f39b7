"""What the GGUF architecture modules share: the table row (TensorSpec), llama.cpp's q/k row
order undone (rope_row_permutation), the metadata every file holds (vocabulary, special tokens),
the LLaMA-shaped config and tensors that llama, qwen2, phi3, qwen3 and the gemmas build on, and
what qwen3 and the gemmas add to them: a linear RoPE scaling read as transformers'
rope_parameters, and the decoder tensors with the norms each has (q/k head norms, sandwich
norms, gemma's 1 + w storage).

Two things llama.cpp's converter changed are undone on the way (in the architecture modules,
with these helpers):

- llama: the rows of the q and k projections were reordered per head, from transformers'
  "rotate half" layout (the first half of a head's dims pairs with the second half) to
  interleaved pairs (dims 2i and 2i+1 rotate together), which is what ggml's RoPE reads.
  k is reordered over the KV heads, q over the query heads. (qwen2, phi3, qwen3 and the gemmas
  use ggml's rotate-half "NEOX" RoPE, as transformers does: their rows were not reordered.)
- gpt2: the Conv1D weights, stored (in, out) by transformers, were written (out, in).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from flashformer.checkpoints.gguf.reader import GGUFError, GGUFFile


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the file: its GGUF name, transformers' name, and its (out, in) shape."""

    gguf: str
    hf: str | None  # None: read into the config (rope_freqs.weight), not a weight
    shape: tuple[int, ...]
    rope_heads: int | None = None  # q/k of llama: rows interleaved per head over this many heads
    conv1d: bool = False  # gpt2: transformers keeps this weight transposed, (in, out)
    optional: bool = False  # may be absent from the file (rope_freqs.weight)
    plus_one: bool = False  # gemma's norms: the file holds 1 + w, transformers w
    # a mixture of experts' 3-D tensor, shape (experts, out, in): one (out, in) matrix per expert
    # (or a 2-D one of biases, (experts, out): gpt-oss), transformers' name for each with the
    # expert's index in place of "{expert}"
    experts: int = 0
    # transformers' shape where it differs from the file's by axes of 1 (LFM2's conv (d, 1, K),
    # stored (d, K)): the float values are reshaped to it; such a tensor must be stored as floats
    hf_shape: tuple[int, ...] | None = None


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


def llama_shaped_config(file: GGUFFile, arch: str, rope_dims: str = "all", experts: bool = False) -> dict:
    """The config.json keys of a LLaMA-shaped file (RMSNorm, SwiGLU, RoPE, GQA) that the
    llama, qwen2 and phi3 architectures share, with their checks. rope_dims "all": RoPE must
    turn the whole head; "partial": the rotated channels may be fewer (partial_rotary_factor).
    experts: the architecture reads expert_count and expert_used_count itself (qwen3moe);
    otherwise a file with experts is refused."""
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
    }
    if not experts:
        unsupported[key + "expert_count"] = (file.value(key + "expert_count", int, 0), 0)
        unsupported[key + "expert_used_count"] = (file.value(key + "expert_used_count", int, 0), 0)
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


def embedding_and_head_specs(hf: dict) -> list[TensorSpec]:
    """A transformers-named decoder's (model.*, lm_head) embedding, final norm and, untied, head."""
    d, vocab = hf["hidden_size"], hf["vocab_size"]
    specs = [
        TensorSpec("token_embd.weight", "model.embed_tokens.weight", (vocab, d)),
        TensorSpec("output_norm.weight", "model.norm.weight", (d,)),
    ]
    if not hf["tie_word_embeddings"]:
        specs.append(TensorSpec("output.weight", "lm_head.weight", (vocab, d)))
    return specs


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
    d, ff = hf["hidden_size"], hf["intermediate_size"]
    q_rows = hf["num_attention_heads"] * hf["head_dim"]
    kv_rows = hf["num_key_value_heads"] * hf["head_dim"]
    q_rope_heads = hf["num_attention_heads"] if rope_permuted else None
    k_rope_heads = hf["num_key_value_heads"] if rope_permuted else None
    specs = embedding_and_head_specs(hf)
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


# read beside a linear scaling, which needs nothing else (yarn, which reads more, is refused)
ROPE_SCALING_KEYS = ("rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length")


def linear_rope_scaling(file: GGUFFile, arch: str) -> dict | None:
    """transformers' rope_parameters update for `{arch}.rope.scaling.*`: None without scaling,
    a linear factor; any other kind (yarn, longrope) is refused by name."""
    key = arch + ".rope.scaling."
    kind = file.value(key + "type", str, "none")
    factor = file.value(key + "factor", (int, float), None)
    if kind == "none" or (kind == "linear" and factor in (None, 1, 1.0)):
        return None
    if kind != "linear":
        raise GGUFError(f"{file.path}: {arch}.rope.scaling.type={kind!r} is not supported ('none', 'linear')")
    return {"rope_type": "linear", "factor": float(factor)}


def decoder_specs(hf: dict, layer_norms: dict[str, str], plus_one: bool = False) -> list[TensorSpec]:
    """llama_shaped_tensors without the q/k row permutation and without biases, with each
    layer's 1-D norms those of `layer_norms` (GGUF name -> transformers name under the layer;
    q/k head norms are head_dim wide). plus_one: every norm is stored as 1 + w (gemma)."""
    specs = []
    for spec in llama_shaped_tensors(hf, rope_permuted=False):
        parts = spec.gguf.split(".")
        if parts[0] == "blk" and parts[2] in ("attn_norm", "ffn_norm"):
            continue  # added below, under this architecture's names
        specs.append(
            dataclasses.replace(spec, plus_one=plus_one) if spec.gguf == "output_norm.weight" else spec
        )
    for i in range(hf["num_hidden_layers"]):
        for gguf_name, hf_name in layer_norms.items():
            width = hf["head_dim"] if gguf_name in ("attn_q_norm", "attn_k_norm") else hf["hidden_size"]
            specs.append(
                TensorSpec(
                    f"blk.{i}.{gguf_name}.weight",
                    f"model.layers.{i}.{hf_name}.weight",
                    (width,),
                    plus_one=plus_one,
                )
            )
    return specs


def summary(hf: dict) -> str:
    return (
        f"vocab {hf['vocab_size']}, d_model {hf['hidden_size']}, {hf['num_hidden_layers']} layers, "
        f"{hf['num_attention_heads']} heads of {hf['head_dim']} ({hf['num_key_value_heads']} KV), "
        f"feed-forward {hf['intermediate_size']}"
    )


# ---- writing ----


def require_config_value(hf: dict, key: str, supported: tuple) -> None:
    """A config.json value llama.cpp computes otherwise: refused by name rather than written."""
    if key in hf and hf[key] not in supported:
        raise ValueError(
            f"config.json: {key}={hf[key]!r} cannot be written to GGUF (llama.cpp computes "
            f"{' or '.join(map(repr, supported))})"
        )
