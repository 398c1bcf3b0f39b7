"""What the LLaMA-like GGUF architectures added after llama and gpt2 share (qwen3, the gemmas):
their attention shape from the metadata, the refusals that go with it, RoPE scaling, and the
tensor names of a pre-norm decoder layer.

Unlike llama's, their q and k rows are stored as transformers has them: llama.cpp's converter
permutes the rows for llama only, and these architectures use the half-split ("NEOX") RoPE
that transformers uses too.
"""

from __future__ import annotations

from flashformer.checkpoints.gguf.architectures import TensorSpec
from flashformer.checkpoints.gguf.reader import GGUFError, GGUFFile


def attention_shape(file: GGUFFile, arch: str) -> dict:
    """The sizes of the attention from `{arch}.*` keys: d_model, heads, KV heads, head_dim.

    Refuses what transformers' layers of these families cannot be: value heads of another
    width than key heads, RoPE over part of a head, experts.
    """
    key = arch + "."
    d_model = file.value(key + "embedding_length", int)
    n_heads = file.value(key + "attention.head_count", int)
    kv_heads = file.value(key + "attention.head_count_kv", int, n_heads)
    if n_heads < 1 or kv_heads < 1 or n_heads % kv_heads:
        raise GGUFError(
            f"{file.path}: {n_heads} query heads cannot share {kv_heads} KV heads "
            f"({arch}.attention.head_count must be a multiple of {arch}.attention.head_count_kv)"
        )
    head_dim = file.value(key + "attention.key_length", int, d_model // n_heads)
    for name, value, supported, meaning in (
        (
            "attention.value_length",
            file.value(key + "attention.value_length", int, head_dim),
            head_dim,
            "value heads as wide as key heads",
        ),
        (
            "rope.dimension_count",
            file.value(key + "rope.dimension_count", int, head_dim),
            head_dim,
            "RoPE over the whole head",
        ),
        ("expert_count", file.value(key + "expert_count", int, 0), 0, "no mixture of experts"),
    ):
        if value != supported:
            raise GGUFError(
                f"{file.path}: {arch}.{name}={value} is not supported (flashformer's {arch} needs {supported}: {meaning})"
            )
    return {"d_model": d_model, "n_heads": n_heads, "kv_heads": kv_heads, "head_dim": head_dim}


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
    """The tensors of a tied-or-untied decoder whose layers hold q, k, v, output and a gated
    feed-forward (gate, up, down) without biases, plus the 1-D norms `layer_norms` lists
    (GGUF name -> transformers name under the layer; q/k head norms are head_dim wide).
    plus_one: the norms are stored as 1 + w (Gemma)."""
    d, vocab, ff = hf["hidden_size"], hf["vocab_size"], hf["intermediate_size"]
    q_rows = hf["num_attention_heads"] * hf["head_dim"]
    kv_rows = hf["num_key_value_heads"] * hf["head_dim"]
    specs = [
        TensorSpec("token_embd.weight", "model.embed_tokens.weight", (vocab, d)),
        TensorSpec("output_norm.weight", "model.norm.weight", (d,), plus_one=plus_one),
    ]
    if not hf["tie_word_embeddings"]:
        specs.append(TensorSpec("output.weight", "lm_head.weight", (vocab, d)))
    for i in range(hf["num_hidden_layers"]):
        blk, layer = f"blk.{i}", f"model.layers.{i}"
        for gguf_name, hf_name, shape in (
            ("attn_q", "self_attn.q_proj", (q_rows, d)),
            ("attn_k", "self_attn.k_proj", (kv_rows, d)),
            ("attn_v", "self_attn.v_proj", (kv_rows, d)),
            ("attn_output", "self_attn.o_proj", (d, q_rows)),
            ("ffn_gate", "mlp.gate_proj", (ff, d)),
            ("ffn_up", "mlp.up_proj", (ff, d)),
            ("ffn_down", "mlp.down_proj", (d, ff)),
        ):
            specs.append(TensorSpec(f"{blk}.{gguf_name}.weight", f"{layer}.{hf_name}.weight", shape))
        for gguf_name, hf_name in layer_norms.items():
            width = hf["head_dim"] if gguf_name in ("attn_q_norm", "attn_k_norm") else d
            specs.append(
                TensorSpec(
                    f"{blk}.{gguf_name}.weight", f"{layer}.{hf_name}.weight", (width,), plus_one=plus_one
                )
            )
    return specs


def summary(hf: dict) -> str:
    return (
        f"vocab {hf['vocab_size']}, d_model {hf['hidden_size']}, {hf['num_hidden_layers']} layers, "
        f"{hf['num_attention_heads']} heads of {hf['head_dim']} ({hf['num_key_value_heads']} KV), "
        f"feed-forward {hf['intermediate_size']}"
    )
