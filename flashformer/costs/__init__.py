"""What a Transformer costs, from the complexity formulas: FLOPs, bytes, memory traffic.

    est = flashformer.costs.estimate("gpt2", seq_len=1024)
    est.forward_flops, est.train_step_flops, est.decode_step_flops
    est.weight_bytes, est.optimizer_bytes, est.kv_cache_bytes, est.activation_bytes["flash"]
    est.flops["attn_scores"], est.layer_flops["decoder"]["ffn"]

Variables (docs/costs.md): n = seq_len new tokens, c = cache_len cached
ones, d = d_model, h = n_heads, h_kv = n_kv_heads, d_k = head_dim, d_ff,
L = layers, V = vocab_size, B = batch.

estimates.py: estimate() and its Estimate, resolve_config;
flops.py: FLOPs (matmul FLOPs, checked against FlopCounterMode);
memory.py: parameters, weights, optimizer state, KV cache, activations and
the attention call's peak; traffic.py: HBM traffic of eager attention
against FlashAttention; report.py: the `flashformer cost` table and plot.
"""

from flashformer.costs.estimates import Estimate, estimate, resolve_config
from flashformer.costs.flops import (
    CONVENTIONS,
    attention_pairs,
    closed_form_crossover,
    crossover_seq_len,
)
from flashformer.costs.memory import Saved, attention_peak_bytes, parameter_count

__all__ = [
    "CONVENTIONS",
    "Estimate",
    "Saved",
    "attention_pairs",
    "attention_peak_bytes",
    "closed_form_crossover",
    "crossover_seq_len",
    "estimate",
    "parameter_count",
    "resolve_config",
]
