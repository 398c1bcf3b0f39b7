"""What qwen3 and the gemmas add to architectures.py's LLaMA-shaped helpers: a linear RoPE
scaling read as transformers' rope_parameters, and the decoder tensors with the norms each of
them has (q/k head norms, sandwich norms, gemma's 1 + w storage).

Their q and k rows are stored as transformers has them: llama.cpp's converter permutes the
rows for llama only, and these architectures use the half-split ("NEOX") RoPE that
transformers uses too.
"""

from __future__ import annotations

import dataclasses

from flashformer.checkpoints.gguf.architectures import TensorSpec, llama_shaped_tensors
from flashformer.checkpoints.gguf.reader import GGUFError, GGUFFile

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
