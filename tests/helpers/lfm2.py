"""A tiny random transformers Lfm2ForCausalLM and its GGUF form as llama.cpp's converter writes
it (tensor names, metadata keys, the per-layer head_count_kv with 0 for a conv layer, the conv
filter 2-D), for the model, generate and GGUF tests of LFM2."""

from __future__ import annotations

import numpy as np
import torch

from helpers.gguf import tiny_vocabulary

KINDS = ("conv", "full_attention", "conv", "conv", "full_attention")  # as LFM2 mixes them


def tiny_lfm2(seed: int = 0, hidden: int = 64, ff: int = 96, vocab: int | None = None, **changes):
    """Weights nudged away from their init (norms around 1, the conv's filters and projections of
    unit gain) so that no layer is an identity and a misplaced tensor shows in the logits."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    values = dict(
        vocab_size=vocab or len(tiny_vocabulary()["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=ff,
        block_auto_adjust_ff_dim=False,
        num_hidden_layers=len(KINDS),
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        layer_types=list(KINDS),
        conv_L_cache=3,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    values.update(changes)
    torch.manual_seed(seed)
    model = Lfm2ForCausalLM(Lfm2Config(**values)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1:
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
            elif "conv.conv" in name:
                parameter.copy_(0.5 * torch.randn_like(parameter))
            else:
                parameter.copy_(torch.randn_like(parameter) / parameter.shape[-1] ** 0.5)
    return model


def lfm2_metadata(model) -> dict:
    config = model.config
    kv = [0 if kind == "conv" else config.num_key_value_heads for kind in config.layer_types]
    return {
        "lfm2.block_count": config.num_hidden_layers,
        "lfm2.context_length": config.max_position_embeddings,
        "lfm2.embedding_length": config.hidden_size,
        "lfm2.feed_forward_length": config.intermediate_size,
        "lfm2.attention.head_count": config.num_attention_heads,
        "lfm2.attention.head_count_kv": kv,
        "lfm2.rope.freq_base": float(config.rope_parameters["rope_theta"]),
        "lfm2.attention.layer_norm_rms_epsilon": float(config.norm_eps),
        "lfm2.vocab_size": config.vocab_size,
        "lfm2.shortconv.l_cache": config.conv_L_cache,
        **tiny_vocabulary(),
    }


def lfm2_tensors(model, matrix_type: str = "F32") -> dict[str, tuple[np.ndarray, str]]:
    """GGUF tensors under llama.cpp's names; the 2-D projections in matrix_type, the norms and
    the conv filters (d_model, l_cache) in F32, as llama.cpp's quantizer leaves them."""
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    tensors = {
        "token_embd.weight": (state["model.embed_tokens.weight"], matrix_type),
        "token_embd_norm.weight": (state["model.embedding_norm.weight"], "F32"),
    }
    if not model.config.tie_word_embeddings:
        tensors["output.weight"] = (state["lm_head.weight"], matrix_type)
    for i, kind in enumerate(model.config.layer_types):
        layer = f"model.layers.{i}"
        names = {
            "attn_norm": "operator_norm",
            "ffn_norm": "ffn_norm",
            "ffn_gate": "feed_forward.w1",
            "ffn_up": "feed_forward.w3",
            "ffn_down": "feed_forward.w2",
        }
        if kind == "conv":
            names.update({"shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj"})
            tensors[f"blk.{i}.shortconv.conv.weight"] = (state[f"{layer}.conv.conv.weight"][:, 0], "F32")
        else:
            names.update(
                {
                    "attn_q": "self_attn.q_proj",
                    "attn_k": "self_attn.k_proj",
                    "attn_v": "self_attn.v_proj",
                    "attn_output": "self_attn.out_proj",
                    "attn_q_norm": "self_attn.q_layernorm",
                    "attn_k_norm": "self_attn.k_layernorm",
                }
            )
        for ours, theirs in names.items():
            values = state[f"{layer}.{theirs}.weight"]
            tensors[f"blk.{i}.{ours}.weight"] = (values, "F32" if values.ndim == 1 else matrix_type)
    return tensors
