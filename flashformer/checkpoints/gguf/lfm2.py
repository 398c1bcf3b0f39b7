"""lfm2 (LiquidAI's LFM2 and LFM2.5; llama.cpp's LLM_ARCH_LFM2): conv layers beside GQA attention
layers, read into transformers' lfm2 names (model/hf/lfm2.py).

Which layer is which is in the metadata's per-layer head counts: attention.head_count_kv is an
array, 0 for a conv layer (the converter writes it so; a single number would make every layer
attention). A conv layer holds shortconv.in_proj (3 d_model, d_model), shortconv.conv
(d_model, shortconv.l_cache), stored 2-D (transformers' Conv1d weight is (d_model, 1, l_cache):
read back with its middle axis) and kept F32 by llama.cpp's quantizer (rows of 3 fill no block),
and shortconv.out_proj; an attention layer attn_q/k/v/output and the head norms attn_q_norm,
attn_k_norm (half-split RoPE: rows not permuted). Every layer has attn_norm (transformers'
operator_norm), ffn_norm and the SwiGLU's ffn_gate/up/down (w1, w3, w2). The final norm is
token_embd_norm (transformers' model.embedding_norm, applied after the last layer, which
llama.cpp's own table calls a fix for a wrong name), the head tied unless output.weight is there.
"""

from __future__ import annotations

from flashformer.checkpoints.gguf.common import (
    LLAMA_SHAPED_KEYS,
    TensorSpec,
    refuse_unread_keys,
    special_token_ids,
    vocab_size,
)
from flashformer.checkpoints.gguf.reader import GGUFError, GGUFFile


class Lfm2:
    name = "lfm2"
    # llama's keys but the experts', and the short convolutions' window
    keys = (*(k for k in LLAMA_SHAPED_KEYS if not k.startswith("expert_")), "shortconv.l_cache")

    def config(self, file: GGUFFile) -> dict:
        key = self.name + "."
        refuse_unread_keys(file, self.name, self.keys)
        n_layers = file.value(key + "block_count", int)
        d_model = file.value(key + "embedding_length", int)
        n_heads = file.value(key + "attention.head_count", int)
        kv = file.value(key + "attention.head_count_kv", (list, int))
        kv = [kv] * n_layers if isinstance(kv, int) else kv
        attention_kv = {k for k in kv if k}
        if len(kv) != n_layers or len(attention_kv) != 1 or n_heads % next(iter(attention_kv)):
            raise GGUFError(
                f"{file.path}: {key}attention.head_count_kv={kv!r} must give each of the {n_layers} layers "
                f"0 (a conv layer) or one KV head count that divides {key}attention.head_count={n_heads}"
            )
        head_dim = d_model // n_heads
        for name in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
            if file.value(key + name, int, head_dim) != head_dim:
                raise GGUFError(
                    f"{file.path}: {key}{name}={file.value(key + name, int)} is not supported (flashformer's "
                    f"lfm2 needs {head_dim}: heads of d_model / head_count, RoPE over the whole head)"
                )
        theta = float(file.value(key + "rope.freq_base", (int, float), 1000000.0))
        return {
            "architectures": ["Lfm2ForCausalLM"],
            "model_type": "lfm2",
            "vocab_size": vocab_size(file, self.name),
            "hidden_size": d_model,
            "intermediate_size": file.value(key + "feed_forward_length", int),
            "block_auto_adjust_ff_dim": False,  # the file holds the width itself
            "num_hidden_layers": n_layers,
            "num_attention_heads": n_heads,
            "num_key_value_heads": next(iter(attention_kv)),
            "layer_types": ["full_attention" if k else "conv" for k in kv],
            "conv_L_cache": file.value(key + "shortconv.l_cache", int),
            "conv_bias": False,
            "max_position_embeddings": file.value(key + "context_length", int),
            "norm_eps": float(file.value(key + "attention.layer_norm_rms_epsilon", (int, float))),
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
            "tie_word_embeddings": "output.weight" not in file.tensors,
            **special_token_ids(file),
            "torch_dtype": "float32",
        }

    def tensors(self, hf: dict) -> list[TensorSpec]:
        d, ff, vocab = hf["hidden_size"], hf["intermediate_size"], hf["vocab_size"]
        head_dim = d // hf["num_attention_heads"]
        q_rows, kv_rows = hf["num_attention_heads"] * head_dim, hf["num_key_value_heads"] * head_dim
        specs = [
            TensorSpec("token_embd.weight", "model.embed_tokens.weight", (vocab, d)),
            TensorSpec("token_embd_norm.weight", "model.embedding_norm.weight", (d,)),
        ]
        if not hf["tie_word_embeddings"]:
            specs.append(TensorSpec("output.weight", "lm_head.weight", (vocab, d)))
        for i, kind in enumerate(hf["layer_types"]):
            blk, layer = f"blk.{i}", f"model.layers.{i}"
            specs += [
                TensorSpec(f"{blk}.attn_norm.weight", f"{layer}.operator_norm.weight", (d,)),
                TensorSpec(f"{blk}.ffn_norm.weight", f"{layer}.ffn_norm.weight", (d,)),
                TensorSpec(f"{blk}.ffn_gate.weight", f"{layer}.feed_forward.w1.weight", (ff, d)),
                TensorSpec(f"{blk}.ffn_up.weight", f"{layer}.feed_forward.w3.weight", (ff, d)),
                TensorSpec(f"{blk}.ffn_down.weight", f"{layer}.feed_forward.w2.weight", (d, ff)),
            ]
            if kind == "conv":
                width = hf["conv_L_cache"]
                specs += [
                    TensorSpec(f"{blk}.shortconv.in_proj.weight", f"{layer}.conv.in_proj.weight", (3 * d, d)),
                    TensorSpec(
                        f"{blk}.shortconv.conv.weight",
                        f"{layer}.conv.conv.weight",
                        (d, width),
                        hf_shape=(d, 1, width),
                    ),
                    TensorSpec(f"{blk}.shortconv.out_proj.weight", f"{layer}.conv.out_proj.weight", (d, d)),
                ]
                continue
            attn = f"{layer}.self_attn"
            specs += [
                TensorSpec(f"{blk}.attn_q.weight", f"{attn}.q_proj.weight", (q_rows, d)),
                TensorSpec(f"{blk}.attn_k.weight", f"{attn}.k_proj.weight", (kv_rows, d)),
                TensorSpec(f"{blk}.attn_v.weight", f"{attn}.v_proj.weight", (kv_rows, d)),
                TensorSpec(f"{blk}.attn_output.weight", f"{attn}.out_proj.weight", (d, q_rows)),
                TensorSpec(f"{blk}.attn_q_norm.weight", f"{attn}.q_layernorm.weight", (head_dim,)),
                TensorSpec(f"{blk}.attn_k_norm.weight", f"{attn}.k_layernorm.weight", (head_dim,)),
            ]
        return specs

    def summary(self, hf: dict) -> str:
        kinds = hf["layer_types"]
        return (
            f"vocab {hf['vocab_size']}, d_model {hf['hidden_size']}, {len(kinds)} layers "
            f"({kinds.count('conv')} conv of {hf['conv_L_cache']} taps), {hf['num_attention_heads']} heads "
            f"({hf['num_key_value_heads']} KV), feed-forward {hf['intermediate_size']}"
        )
