"""gpt-oss (gpt-oss-20b, gpt-oss-120b): LLaMA's layout with biases on q, k, v and o, a learned
attention sink per query head (self_attn.sinks), sliding-window layers (128 keys) beside full
ones (layer_types), YaRN RoPE, and in every layer a mixture of experts: a router with a bias
(mlp.router) whose top num_experts_per_tok logits are softmaxed (top-k, then softmax), and
num_local_experts experts of gpt-oss's clamped SwiGLU (swiglu_limit, swiglu_alpha, the (up + 1)
form), each projection with a bias.

transformers keeps the experts fused in the folder as in memory: mlp.experts.gate_up_proj
(experts, d_model, 2 * intermediate), its columns gate and up interleaved (gate at even
columns), gate_up_proj_bias likewise, down_proj (experts, intermediate, d_model) and
down_proj_bias. Reading splits them into one matrix per expert and projection under per-expert
names (`split_experts`), which the rules map; saving fuses them back (`fuse_experts`).

MXFP4 experts (the released checkpoints' gate_up_proj_blocks / _scales, quantization_config
mxfp4) are read by checkpoints/mxfp4_folder.py, which gives this family per-expert names (blocks
or float); experts quantized any other way are refused by name.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from flashformer.model.hf.llama import Llama, decoder_config, decoder_to_hf, rope_fraction
from flashformer.model.hf.mapping import Rule, linear, plain_layers, require

_FUSED = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")


def split_experts(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers' fused expert tensors -> one per expert and projection, (out, in) as a
    Linear holds it: layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.{weight,bias}."""
    out = {}
    for name, tensor in weights.items():
        match = _FUSED.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, projection, bias = match.groups()
        kind = "bias" if bias else "weight"
        for e, matrix in enumerate(tensor):
            if projection == "down_proj":  # (intermediate, d_model) -> (d_model, intermediate)
                out[f"{prefix}.{e}.down_proj.{kind}"] = matrix if bias else matrix.t().contiguous()
                continue
            gate, up = matrix[..., 0::2], matrix[..., 1::2]  # interleaved columns
            out[f"{prefix}.{e}.gate_proj.{kind}"] = gate.contiguous() if bias else gate.t().contiguous()
            out[f"{prefix}.{e}.up_proj.{kind}"] = up.contiguous() if bias else up.t().contiguous()
    return out


def fuse_experts(weights: dict[str, Tensor], n_layers: int, n_expert: int) -> dict[str, Tensor]:
    """The inverse of split_experts: the per-expert tensors back into transformers' fused ones
    (a layer whose per-expert tensors are not all there passes as it is)."""
    out = dict(weights)
    for i in range(n_layers):
        prefix = f"layers.{i}.mlp.experts"
        names = {
            (e, projection, kind): f"{prefix}.{e}.{projection}.{kind}"
            for e in range(n_expert)
            for projection in ("gate_proj", "up_proj", "down_proj")
            for kind in ("weight", "bias")
        }
        if not all(isinstance(out.get(name), Tensor) for name in names.values()):
            continue
        part = {key: out.pop(name) for key, name in names.items()}
        experts = range(n_expert)
        gate_up = [
            torch.stack((part[e, "gate_proj", "weight"].t(), part[e, "up_proj", "weight"].t()), -1)
            for e in experts
        ]
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [g.flatten(-2) for g in gate_up]
        )  # (E, d, 2 ff), interleaved
        biases = [
            torch.stack((part[e, "gate_proj", "bias"], part[e, "up_proj", "bias"]), -1) for e in experts
        ]
        out[f"{prefix}.gate_up_proj_bias"] = torch.stack([b.flatten() for b in biases])  # (E, 2 ff)
        out[f"{prefix}.down_proj"] = torch.stack(
            [part[e, "down_proj", "weight"].t() for e in experts]
        )  # (E, ff, d)
        out[f"{prefix}.down_proj_bias"] = torch.stack(
            [part[e, "down_proj", "bias"] for e in experts]
        )  # (E, d)
    return out


class GptOss(Llama):
    model_type = "gpt_oss"

    def strip_prefix(self, weights):
        return split_experts(super().strip_prefix(weights))

    def add_prefix(self, weights, config):
        return super().add_prefix(fuse_experts(weights, config.n_layers, config.n_expert), config)

    def file_name(self, name, config):
        match = re.match(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|bias)$", name)
        if match is None:
            return super().file_name(name, config)
        prefix, e, projection, kind = match.groups()
        fused = "down_proj" if projection == "down" else "gate_up_proj"
        columns = {"gate": ", 0::2", "up": ", 1::2", "down": ""}[projection]
        if kind == "bias":
            return f"model.{prefix}.{fused}_bias[{e}{columns}]"
        return f"model.{prefix}.{fused}[{e}{', :' + columns if columns else ''}]ᵀ"

    def config_from_hf(self, hf, weights):
        quantization = (hf.get("quantization_config") or {}).get("quant_method")
        mxfp4 = sorted(name for name in weights if name.endswith(("_blocks", "_scales")))
        if quantization is not None or mxfp4:
            raise ValueError(
                f"config.json: gpt_oss experts quantized as {quantization or 'MXFP4'} "
                f"({mxfp4[:2] or 'quantization_config'}) are not supported: flashformer reads float experts "
                f"and MXFP4 ones (quantization_config.quant_method 'mxfp4', with _blocks and _scales)"
            )
        if rope_fraction(hf) != 1.0:
            raise ValueError(
                f"config.json: partial_rotary_factor={rope_fraction(hf)} is not supported for gpt_oss"
            )
        n_layers = hf.get("num_hidden_layers", 36)
        layer_types = hf.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)
        ]
        sliding = "sliding_attention" in layer_types
        ffn = hf.get("intermediate_size", 2880)
        bias = bool(hf.get("attention_bias", True))
        return decoder_config(
            {
                "vocab_size": 201088,
                "hidden_size": 2880,
                "num_attention_heads": 64,
                "rms_norm_eps": 1e-5,
                **hf,
            },
            weights,
            "gpt_oss",
            n_layers=n_layers,
            n_kv_heads=hf.get("num_key_value_heads") or 8,
            head_dim=hf.get("head_dim") or 64,
            d_ff=ffn,
            activation="silu",  # gpt-oss's experts ignore hidden_act: their SwiGLU is their own
            attention_bias=bias,
            attention_sinks=True,
            layer_types=tuple(layer_types),
            sliding_window=hf.get("sliding_window", 128) if sliding else None,
            ffn_bias=True,
            swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
            n_expert=hf.get("num_local_experts", hf.get("num_experts", 128)),
            n_expert_used=hf.get("num_experts_per_tok", 4),
            expert_ffn_hidden=ffn,
            expert_gating="topk_softmax",
            expert_router_bias=True,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
        )

    def config_to_hf(self, config):
        if not config.n_expert or config.swiglu_limit is None:
            raise ValueError(
                f"ModelConfig.n_expert={config.n_expert}, swiglu_limit={config.swiglu_limit!r} cannot be saved as a "
                f"Hugging Face gpt_oss model (it needs experts of the clamped SwiGLU)"
            )
        plain_layers(
            config,
            "gpt_oss",
            layer_types=config.layer_types,
            n_expert=config.n_expert,
            attention_sinks=True,
            swiglu_limit=config.swiglu_limit,
            expert_gating="topk_softmax",
            expert_router_bias=True,
        )
        require(
            config,
            "gpt_oss",
            ffn_bias=True,
            expert_ffn_hidden=config.d_ff,
            expert_weights_norm=False,
            rotary_fraction=1.0,
            attention_out_bias=config.attention_bias,
        )
        return {
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            **decoder_to_hf(config, "gpt_oss"),
            "attention_bias": config.attention_bias,
            "layer_types": list(config.layer_types or ["full_attention"] * config.n_layers),
            "sliding_window": config.sliding_window,
            "num_local_experts": config.n_expert,
            "num_experts_per_tok": config.n_expert_used,
            "swiglu_limit": config.swiglu_limit,
            "swiglu_alpha": config.swiglu_alpha,
        }

    def rules(self, config):
        sinks = [
            Rule(f"decoder.blocks.{i}.attn.sinks", (f"layers.{i}.self_attn.sinks",))
            for i in range(config.n_layers)
        ]
        return super().rules(config) + sinks

    def feed_forward_rules(self, config, ours, theirs):
        rules = linear(f"{ours}.router", f"{theirs}.router", bias=True)
        for e in range(config.n_expert):
            expert, their_expert = f"{ours}.experts.{e}", f"{theirs}.experts.{e}"
            for projection in ("gate", "up", "down"):
                rules += linear(f"{expert}.{projection}", f"{their_expert}.{projection}_proj", bias=True)
        return rules
