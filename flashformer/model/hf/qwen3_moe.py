"""Qwen3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, and in every layer a mixture
of experts in place of the MLP: a router (mlp.gate, no bias) whose softmax picks
num_experts_per_tok of num_experts SwiGLU experts (mlp.experts.{e}.gate_proj / up_proj /
down_proj, moe_intermediate_size wide), their top-k probabilities renormalized when
norm_topk_prob is true (model/experts.py).

transformers holds the experts fused in memory (mlp.experts.gate_up_proj, mlp.experts.down_proj)
but writes and reads checkpoint folders one tensor per expert and projection, as the released
checkpoints are: those are the names here.

Not implemented, refused by name: dense layers between the sparse ones (decoder_sparse_step
other than 1, a non-empty mlp_only_layers; no released Qwen3 MoE has them), a model without
experts (num_experts 0), and Qwen3's sliding window.
"""

from __future__ import annotations

from flashformer.model.hf.mapping import linear, plain_layers, refuse, require
from flashformer.model.hf.qwen3 import Qwen3


class Qwen3Moe(Qwen3):
    model_type = "qwen3_moe"

    def config_from_hf(self, hf, weights):
        refuse(hf, "qwen3_moe", decoder_sparse_step=(1,), mlp_only_layers=([], None))
        # config.json says num_experts (the released ones) or num_local_experts (transformers 5)
        n_expert = hf.get("num_experts", hf.get("num_local_experts", 128))
        if not isinstance(n_expert, int) or n_expert < 1:
            raise ValueError(
                f"config.json: num_experts={n_expert!r} is not supported for qwen3_moe models "
                f"(supported: an int >= 1; without experts the model is a qwen3)"
            )
        dense = super().config_from_hf(hf, weights)
        return dense.replace(
            n_expert=n_expert,
            n_expert_used=hf.get("num_experts_per_tok", 8),
            expert_ffn_hidden=hf.get("moe_intermediate_size", 768),
            expert_weights_norm=bool(hf.get("norm_topk_prob", False)),
            hf_model_type="qwen3_moe",
        )

    def config_to_hf(self, config):
        if not config.n_expert:
            raise ValueError(
                "ModelConfig.n_expert=0 cannot be saved as a Hugging Face qwen3_moe model (it needs experts)"
            )
        plain_layers(config, "qwen3_moe", qk_norm=True, n_expert=config.n_expert)
        require(config, "qwen3_moe", ffn_bias=False)  # its experts have no biases
        dense = config.replace(n_expert=0, n_expert_used=0, hf_model_type="qwen3")
        hf = super().config_to_hf(dense)
        del hf["mlp_bias"]  # the experts have no biases (required above)
        return {
            **hf,
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "num_experts": config.n_expert,
            "num_experts_per_tok": config.n_expert_used,
            "moe_intermediate_size": config.expert_ffn_hidden,
            "norm_topk_prob": config.expert_weights_norm,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }

    def feed_forward_rules(self, config, ours, theirs):
        rules = linear(f"{ours}.router", f"{theirs}.gate", bias=False)
        for e in range(config.n_expert):
            expert, their_expert = f"{ours}.experts.{e}", f"{theirs}.experts.{e}"
            rules += [
                *linear(f"{expert}.gate", f"{their_expert}.gate_proj", bias=False),
                *linear(f"{expert}.up", f"{their_expert}.up_proj", bias=False),
                *linear(f"{expert}.down", f"{their_expert}.down_proj", bias=False),
            ]
        return rules
