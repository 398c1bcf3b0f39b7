"""Phi-3 / Phi-3.5 / Phi-4-mini: LLaMA's blocks with q, k, v in one projection (qkv_proj),
gate and up in one (gate_up_proj, gate rows first), no biases, and partial rotary
(partial_rotary_factor: Phi-4-mini rotates 96 of a head's 128 channels, rotate-half layout).

LongRoPE (rope type "longrope", or the older "su"; the 128k-context Phi-3, Phi-3.5 and
Phi-4-mini): short and long factors per channel pair, chosen by the sequence's length, and an
attention factor on cos and sin (positional.RopeScaling). Not implemented, refused by name: a
sliding window shorter than the context (Phi-3-mini-4k's 2047; transformers applies it, llama.cpp
switches it off), and rope type "yarn" (transformers reads it as LongRoPE, llama.cpp's converter
as YaRN's attention factor: the two disagree).
"""

from __future__ import annotations

from flashformer.model.hf.llama import Llama, decoder_config, decoder_to_hf, rope_fraction
from flashformer.model.hf.mapping import Rule, linear, norm, plain_layers, require


class Phi3(Llama):
    model_type = "phi3"

    def config_from_hf(self, hf, weights):
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "longrope", "su"):
            raise ValueError(
                f"config.json: rope type {rope_type!r} is not supported for phi3 models (supported: "
                f"'default', 'longrope' and its older name 'su')"
            )
        if rope_type == "su":  # as transformers' Phi3Config renames it
            rope.update(rope_type="longrope")
            hf = {**hf, "rope_parameters": rope}
        window, context = hf.get("sliding_window"), hf.get("max_position_embeddings", 4096)
        if window is not None and window < context:
            raise ValueError(
                f"config.json: sliding_window={window} is shorter than max_position_embeddings={context}; "
                f"flashformer's phi3 does not implement a sliding window (supported: null or >= the context)"
            )
        d_model, n_heads = hf.get("hidden_size", 3072), hf.get("num_attention_heads", 32)
        return decoder_config(
            hf,
            weights,
            "phi3",
            head_dim=hf.get("head_dim") or d_model // n_heads,  # as transformers' Phi3 reads it
            rotary_fraction=rope_fraction(hf),
            attention_bias=False,
            ffn_bias=False,
            fused_gate_up=True,
            norm_eps=hf.get("rms_norm_eps", 1e-5),
            vocab_size=hf.get("vocab_size", 32064),
            bos_token_id=hf.get("bos_token_id", 1),
            eos_token_id=hf.get("eos_token_id", 32000),
            pad_token_id=hf.get("pad_token_id", 32000),
        )

    def config_to_hf(self, config):
        plain_layers(config, "phi3")
        require(config, "phi3", fused_gate_up=True, attention_bias=False, ffn_bias=False)
        if config.head_dim * config.n_heads != config.d_model:
            raise ValueError(
                f"ModelConfig.head_dim={config.head_dim} cannot be saved as a phi3 model "
                f"(phi3 needs head_dim * n_heads == d_model = {config.d_model})"
            )
        hf = decoder_to_hf(config, "phi3")
        del hf["head_dim"]
        hf["rope_parameters"]["partial_rotary_factor"] = config.rotary_fraction
        return {
            "architectures": ["Phi3ForCausalLM"],
            "model_type": "phi3",
            **hf,
            "original_max_position_embeddings": (
                config.max_seq_len
                if config.rope_scaling is None
                else config.rope_scaling.original_max_seq_len
            ),
            "sliding_window": None,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
        }

    def rules(self, config):
        rules = [Rule("embeddings.tokens.weight", ("embed_tokens.weight",))]
        for i in range(config.n_layers):
            ours, theirs = f"decoder.blocks.{i}", f"layers.{i}"
            rules += [
                *norm(f"{ours}.attn_norm", f"{theirs}.input_layernorm", bias=False),
                *linear(f"{ours}.attn.qkv", f"{theirs}.self_attn.qkv_proj", bias=False),  # q, k, v rows
                *linear(f"{ours}.attn.out", f"{theirs}.self_attn.o_proj", bias=False),
                *norm(f"{ours}.ffn_norm", f"{theirs}.post_attention_layernorm", bias=False),
                *linear(
                    f"{ours}.ffn.gate_up", f"{theirs}.mlp.gate_up_proj", bias=False
                ),  # gate rows, up rows
                *linear(f"{ours}.ffn.down", f"{theirs}.mlp.down_proj", bias=False),
            ]
        rules += norm("decoder.final_norm", "norm", bias=False)
        if not config.tie_word_embeddings:
            rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
        return rules
