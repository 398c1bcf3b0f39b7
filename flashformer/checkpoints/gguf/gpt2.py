"""gpt2: GPT-2 (learned positions, LayerNorm, fused qkv), read and written. Its Conv1D weights,
stored (in, out) by transformers, are (out, in) in the file (conv1d tensors)."""

from __future__ import annotations

from torch import Tensor

from flashformer.checkpoints.gguf.common import (
    TensorSpec,
    require_config_value,
    special_token_ids,
    vocab_size,
)
from flashformer.checkpoints.gguf.reader import GGUFError, GGUFFile


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


class GPT2Writer:
    """transformers' GPT-2 as GGUF "gpt2" (learned positions, LayerNorm, fused qkv)."""

    model_type = "gpt2"
    architecture = "gpt2"

    def metadata(self, hf: dict) -> dict:
        require_config_value(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"))
        require_config_value(hf, "scale_attn_weights", (True,))
        key = self.architecture + "."
        return {
            key + "vocab_size": hf["vocab_size"],
            key + "context_length": hf["n_positions"],
            key + "embedding_length": hf["n_embd"],
            key + "block_count": hf["n_layer"],
            key + "feed_forward_length": hf["n_inner"],
            key + "attention.head_count": hf["n_head"],
            key + "attention.layer_norm_epsilon": float(hf["layer_norm_epsilon"]),
        }

    def extra_tensor(self, spec: TensorSpec, hf: dict) -> Tensor | None:
        return None
