"""gemma4: the GGUF metadata of Gemma 4's text model in transformers' terms (gemma4_text).

What llama.cpp's converter writes differently from transformers:
- two head widths: attention.key_length (the full layers', 512 in the released sizes) and
  attention.key_length_swa (the sliding layers'), with rope.dimension_count(_swa) equal to them;
- the full layers' "proportional" RoPE as per-pair frequency divisors (rope_freqs.weight): 1 for
  the pairs that turn, 1e30 for those that stand still; read back as partial_rotary_factor;
- attention.sliding_window_pattern (one flag per layer), attention.shared_kv_layers,
  embedding_length_per_layer_input, and feed_forward_length per layer when use_double_wide_mlp
  widened the shared layers' feed-forwards;
- norms stored as they are (Gemma 4 scales by w), layer_output_scale for layer_scalar.

What the metadata leaves implicit, taken from llama.cpp's graph (src/models/gemma4.cpp): an
attention scale of 1, gelu-tanh, and the layers the KV-shared ones read: the last own layer for
a full layer, the one before it for a sliding one. transformers picks the last earlier layer of
the same type; a file where the two differ is refused. The per-layer table's rows are the
tensor's (the converter writes no vocab_size_per_layer_input). Refused by name: experts
(26B-A4B), a fused qkv, keys as values (no attn_v: 31B), per-layer KV head counts.
"""

from __future__ import annotations

from flashformer.checkpoints.gguf.common import (
    TensorSpec,
    embedding_and_head_specs,
    refuse_unread_keys,
    special_token_ids,
    summary,
    vocab_size,
)
from flashformer.checkpoints.gguf.reader import GGUFError, GGUFFile

KEYS = (
    "block_count",
    "context_length",
    "embedding_length",
    "vocab_size",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.key_length_swa",
    "attention.value_length_swa",
    "attention.layer_norm_rms_epsilon",
    "attention.sliding_window",
    "attention.sliding_window_pattern",
    "attention.shared_kv_layers",
    "rope.dimension_count",
    "rope.dimension_count_swa",
    "rope.freq_base",
    "rope.freq_base_swa",
    "embedding_length_per_layer_input",
    "final_logit_softcapping",
)
STILL = 1e20  # a rope_freqs divisor past this stops its pair (the converter writes 1e30)


class Gemma4:
    name = "gemma4"

    def config(self, file: GGUFFile) -> dict:
        key = self.name + "."
        refuse_unread_keys(file, self.name, KEYS)
        n_layers = file.value(key + "block_count", int)
        n_heads = file.value(key + "attention.head_count", int)
        kv_heads = _one_value(file, key + "attention.head_count_kv", n_layers, "per-layer KV head counts")
        if n_heads % kv_heads:
            raise GGUFError(f"{file.path}: {n_heads} query heads cannot share {kv_heads} KV heads")
        full_dim = file.value(key + "attention.key_length", int)
        swa_dim = file.value(key + "attention.key_length_swa", int)
        for name, value, expected in (
            ("attention.value_length", file.value(key + "attention.value_length", int, full_dim), full_dim),
            (
                "attention.value_length_swa",
                file.value(key + "attention.value_length_swa", int, swa_dim),
                swa_dim,
            ),
            ("rope.dimension_count", file.value(key + "rope.dimension_count", int, full_dim), full_dim),
            ("rope.dimension_count_swa", file.value(key + "rope.dimension_count_swa", int, swa_dim), swa_dim),
        ):
            if value != expected:
                raise GGUFError(
                    f"{file.path}: {key}{name}={value} is not supported (flashformer's gemma4 needs {expected}: "
                    f"values as wide as keys, RoPE over whole heads with rope_freqs.weight for the partial turn)"
                )
        types = self._layer_types(file, n_layers)
        shared = file.value(key + "attention.shared_kv_layers", int, 0)
        _check_kv_sources(file, types, shared)
        ff = file.value(key + "feed_forward_length", (int, list))
        widths = ff if isinstance(ff, list) else [ff] * n_layers
        first_shared = n_layers - shared
        double = [widths[0] * (2 if i >= first_shared else 1) for i in range(n_layers)]
        if len(widths) != n_layers or (widths != [widths[0]] * n_layers and widths != double):
            raise GGUFError(
                f"{file.path}: {key}feed_forward_length={ff!r} is not supported (one width, or Gemma 4's "
                f"double width on the {shared} KV-shared layers)"
            )
        for name in file.tensors:
            if "_exps." in name or name.endswith(("attn_qkv.weight", "ffn_gate_inp.weight")):
                raise GGUFError(
                    f"{file.path}: tensor {name!r} is not supported (flashformer's gemma4 has no experts "
                    f"and reads q, k and v apart)"
                )
        per_layer = file.value(key + "embedding_length_per_layer_input", int, 0)
        per_layer_table = file.tensors.get("per_layer_token_embd.weight")
        softcap = file.value(key + "final_logit_softcapping", (int, float), None)
        return {
            "architectures": ["Gemma4ForCausalLM"],
            "model_type": "gemma4_text",
            "vocab_size": vocab_size(file, self.name),
            "hidden_size": file.value(key + "embedding_length", int),
            "intermediate_size": widths[0],
            "use_double_wide_mlp": widths != [widths[0]] * n_layers,
            "num_hidden_layers": n_layers,
            "num_attention_heads": n_heads,
            "num_key_value_heads": kv_heads,
            "head_dim": swa_dim,
            "global_head_dim": full_dim,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": file.value(key + "context_length", int),
            "rms_norm_eps": float(file.value(key + "attention.layer_norm_rms_epsilon", (int, float))),
            "rope_parameters": {
                "full_attention": {
                    "rope_type": "proportional",
                    "rope_theta": float(file.value(key + "rope.freq_base", (int, float))),
                    "partial_rotary_factor": _turning_fraction(file, full_dim, "full_attention" in types),
                },
                "sliding_attention": {
                    "rope_type": "default",
                    "rope_theta": float(file.value(key + "rope.freq_base_swa", (int, float), 10000.0)),
                },
            },
            "sliding_window": file.value(key + "attention.sliding_window", int),
            "layer_types": types,
            "final_logit_softcapping": None if softcap in (None, 0) else float(softcap),
            "hidden_size_per_layer_input": per_layer,
            "vocab_size_per_layer_input": per_layer_table.shape[0] if per_layer and per_layer_table else None,
            "num_kv_shared_layers": shared,
            "attention_bias": False,
            "tie_word_embeddings": "output.weight" not in file.tensors,
            **special_token_ids(file),
            "torch_dtype": "float32",
        }

    def _layer_types(self, file: GGUFFile, n_layers: int) -> list[str]:
        name = f"{self.name}.attention.sliding_window_pattern"
        pattern = file.value(name, list)
        if len(pattern) != n_layers or not all(isinstance(flag, bool) for flag in pattern):
            raise GGUFError(
                f"{file.path}: {name} lists {len(pattern)} values; expected one bool per layer ({n_layers})"
            )
        if pattern[-1]:
            raise GGUFError(
                f"{file.path}: {name} makes the last layer sliding; Gemma 4's last layer is a full one"
            )
        return ["sliding_attention" if flag else "full_attention" for flag in pattern]

    def tensors(self, hf: dict) -> list[TensorSpec]:
        d, n_layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
        kv_heads, per_layer = hf["num_key_value_heads"], hf["hidden_size_per_layer_input"]
        first_shared = n_layers - hf["num_kv_shared_layers"]
        specs = embedding_and_head_specs(hf)
        specs.append(TensorSpec("rope_freqs.weight", None, (hf["global_head_dim"] // 2,), optional=True))
        if per_layer:
            width = n_layers * per_layer
            specs += [
                TensorSpec(
                    "per_layer_token_embd.weight",
                    "model.embed_tokens_per_layer.weight",
                    (hf["vocab_size_per_layer_input"], width),
                ),
                TensorSpec(
                    "per_layer_model_proj.weight", "model.per_layer_model_projection.weight", (width, d)
                ),
                TensorSpec(
                    "per_layer_proj_norm.weight", "model.per_layer_projection_norm.weight", (per_layer,)
                ),
            ]
        for i in range(n_layers):
            blk, layer = f"blk.{i}", f"model.layers.{i}"
            full = hf["layer_types"][i] == "full_attention"
            head = hf["global_head_dim"] if full else hf["head_dim"]
            ff = hf["intermediate_size"] * (2 if hf["use_double_wide_mlp"] and i >= first_shared else 1)
            rows = [
                ("attn_norm", "input_layernorm", (d,)),
                ("post_attention_norm", "post_attention_layernorm", (d,)),
                ("ffn_norm", "pre_feedforward_layernorm", (d,)),
                ("post_ffw_norm", "post_feedforward_layernorm", (d,)),
                ("layer_output_scale", "layer_scalar", (1,)),
                ("attn_q", "self_attn.q_proj", (heads * head, d)),
                ("attn_q_norm", "self_attn.q_norm", (head,)),
                ("attn_output", "self_attn.o_proj", (d, heads * head)),
                ("ffn_gate", "mlp.gate_proj", (ff, d)),
                ("ffn_up", "mlp.up_proj", (ff, d)),
                ("ffn_down", "mlp.down_proj", (d, ff)),
            ]
            if i < first_shared:
                rows += [
                    ("attn_k", "self_attn.k_proj", (kv_heads * head, d)),
                    ("attn_v", "self_attn.v_proj", (kv_heads * head, d)),
                    ("attn_k_norm", "self_attn.k_norm", (head,)),
                ]
            if per_layer:
                rows += [
                    ("inp_gate", "per_layer_input_gate", (per_layer, d)),
                    ("proj", "per_layer_projection", (d, per_layer)),
                    ("post_norm", "post_per_layer_input_norm", (d,)),
                ]
            for gguf_name, hf_name, shape in rows:
                suffix = "" if hf_name == "layer_scalar" else ".weight"
                specs.append(TensorSpec(f"{blk}.{gguf_name}.weight", f"{layer}.{hf_name}{suffix}", shape))
        return specs

    def summary(self, hf: dict) -> str:
        return (
            f"{summary(hf)}, full layers' heads of {hf['global_head_dim']}, per-layer inputs of "
            f"{hf['hidden_size_per_layer_input']}, {hf['num_kv_shared_layers']} KV-shared layers"
        )


def _one_value(file: GGUFFile, key: str, n_layers: int, what: str) -> int:
    """An int key that llama.cpp may write per layer: one value for every layer, else refused."""
    value = file.value(key, (int, list))
    values = value if isinstance(value, list) else [value]
    if len(set(values)) != 1 or (isinstance(value, list) and len(value) != n_layers):
        raise GGUFError(f"{file.path}: {key}={value!r} is not supported ({what})")
    return values[0]


def _check_kv_sources(file: GGUFFile, types: list[str], shared: int) -> None:
    """llama.cpp's KV-shared layers read the last own layer (a full one) or the one before it
    (a sliding one); transformers' read the last own layer of their type: they must agree."""
    n_layers = len(types)
    first_shared = n_layers - shared
    if shared and first_shared < 2:
        raise GGUFError(f"{file.path}: {shared} KV-shared layers of {n_layers} leave fewer than 2 own layers")
    for index in range(first_shared, n_layers):
        theirs = first_shared - (2 if types[index] == "sliding_attention" else 1)
        ours = max((j for j in range(first_shared) if types[j] == types[index]), default=None)
        if theirs != ours:
            raise GGUFError(
                f"{file.path}: layer {index} ({types[index]}) reads the keys and values of layer {theirs} in "
                f"llama.cpp but of layer {ours} in transformers (the last own layer of its type); "
                f"flashformer's gemma4 reads files where they agree"
            )


def _turning_fraction(file: GGUFFile, head_dim: int, has_full_layers: bool) -> float:
    """partial_rotary_factor from rope_freqs.weight: its leading 1s turn, the rest (1e30) stand still."""
    raw = file.tensors.get("rope_freqs.weight")
    if raw is None:
        if has_full_layers:
            raise GGUFError(
                f"{file.path}: tensor 'rope_freqs.weight' is missing; the full layers' RoPE needs it"
            )
        return 1.0
    divisors = raw.to_float().reshape(-1)
    turning = int((divisors == 1.0).sum())
    if (
        divisors.numel() != head_dim // 2
        or not (divisors[:turning] == 1.0).all()
        or not (divisors[turning:] > STILL).all()
    ):
        raise GGUFError(
            f"{file.path}: tensor 'rope_freqs.weight' holds divisors other than proportional RoPE's (1 for the "
            f"first pairs, 1e30 for the rest), which flashformer's gemma4 does not read"
        )
    return 2 * turning / head_dim
