"""What the alternatives to exact attention cost, against n: the recurrent models (LSTM, GRU,
the Mamba-style SSM), the Transformer's windowed (+ global tokens) and linear attention, and
LFM2's hybrid (short convolutions in some layers, attention in the rest).

    alternatives.forward_flops(config, batch, n)                 # a forward pass over n tokens
    alternatives.forward_flops(config, batch, 1, cache_len=n)    # one decode step after n tokens
    alternatives.decode_memory_bytes(config, batch, n)           # the state or KV cache after n

The conventions are flops.py's: matmul FLOPs, 2 per multiply-add, what
torch.utils.flop_counter.FlopCounterMode counts (tests/costs hold every figure to it); the
elementwise work (gates, the scan's exp and products, feature maps' exp, the state updates)
is O(n·d) and not counted. nn.LSTM's oneDNN kernel hides its matmuls from the counter; the
figures are those of the same LSTM without oneDNN, the same products.

Per token and layer (d = d_model, e = ssm_expand·d, N = ssm_state, K = ssm_conv, r = ssm_dt_rank,
h / h_kv heads of d_k, F features, C = the linear form's chunk, W = the window, G global tokens):
    LSTM  16·d²        GRU  12·d²         (input and recurrent products of 4 or 3 gates)
    SSM   2·d·2e + 2·e·K + 2·e·(r + 2N) + 2·r·e + 2·e·N + 2·e·d
    windowed attention  4·h·d_k per visible key: min(W, position + 1) + G, not the position
    linear attention (chunked)  2·h_kv·F·d_k + 2·h·(C·F + F·d_k + C·d_k + F); a step 2·h·(F·d_k + F)
    LFM2's conv layer  2·d·3d + 2·d·K + 2·d·d   (in_proj, the depthwise conv, out_proj; K taps)
A recurrent step costs the same after 10 tokens as after 10,000, and so does its state's memory;
exact attention's step grows with n, and so does its KV cache.
"""

from __future__ import annotations

import torch

from flashformer.attention.masks import ScoreRules
from flashformer.costs.flops import Pass, Shapes, attention_pairs, flash_block_sizes, head_flops
from flashformer.costs.flops import forward_flops as transformer_forward_flops
from flashformer.formatting import format_bytes, format_count, markdown_table
from flashformer.model.config import RECURRENT_ARCHS, ModelConfig

FAMILIES = ("lstm", "gru", "ssm", "linear", "windowed", "hybrid", "transformer")
LINEAR_CHUNK = 64  # attention.linear.causal_linear_attention's default


def family(config: ModelConfig) -> str:
    """Which of FAMILIES a config is: its recurrent arch, or a decoder's attention."""
    if config.arch in RECURRENT_ARCHS:
        return config.arch
    if config.attention_kind == "linear":
        return "linear"
    if config.layer_types is not None and "conv" in config.layer_types:
        return "hybrid"  # LFM2: short convolutions beside attention
    if config.layer_types is not None and "sliding_attention" in config.layer_types:
        return "windowed"
    return "transformer"


# ---- windowed attention: the pairs a head scores ----


def windowed_pairs(
    q_len: int,
    k_len: int,
    window: int,
    global_tokens: int = 0,
    causal: bool = True,
    convention: str = "flash",
) -> int:
    """Scores one head computes with a window of `window` keys (the query's own included) and
    global tokens: "flash" counts what the tiled backend visits (whole query blocks against
    each span of ScoreRules.key_spans), "exact" only the allowed pairs, "eager" every pair."""
    if convention == "eager":
        return q_len * k_len
    rules = ScoreRules(
        1,
        1,
        q_len,
        k_len,
        causal=causal,
        window_left=window - 1,
        window_right=None if causal else window - 1,
        global_tokens=global_tokens,
    )
    block = 1 if convention == "exact" else flash_block_sizes(q_len)[0]
    pairs = 0
    for q0 in range(0, q_len, block):
        q1 = min(q_len, q0 + block)
        pairs += (q1 - q0) * sum(hi - lo for lo, hi in rules.key_spans(q0, q1))
    return pairs


# ---- FLOPs ----


def forward_flops(config: ModelConfig, batch: int, length: int, cache_len: int = 0) -> dict[str, int]:
    """Matmul FLOPs of a forward pass over `length` new tokens per sequence after cache_len seen
    ones (a decode step: length=1), per component, for any of FAMILIES. The recurrent families'
    cost does not depend on cache_len."""
    kind = family(config)
    s = Shapes.of(config)
    if kind in RECURRENT_ARCHS:
        tokens = batch * length
        layer = _rnn_layer_flops(config, tokens) if kind != "ssm" else _ssm_layer_flops(config, tokens)
        flops = {name: config.n_layers * value for name, value in layer.items()}
        flops.update(head_flops(config, s, batch, length))
        return flops
    flops = transformer_forward_flops(config, Pass(batch, length, cache_len, length, "flash"))[1]
    pairs = 0
    if kind == "hybrid":  # a conv layer has no attention: its projections and conv instead
        convs = sum(config.layer_type(i) == "conv" for i in range(config.n_layers))
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            flops[name] -= convs * flops[name] // config.n_layers
        for name, value in _short_conv_layer_flops(config, batch * length).items():
            flops[name] = convs * value
    for index in range(config.n_layers):
        if kind == "hybrid" and config.layer_type(index) == "conv":
            continue
        if kind == "windowed" and config.layer_type(index) == "sliding_attention":
            pairs += windowed_pairs(length, cache_len + length, config.sliding_window, config.global_tokens)
        else:
            pairs += attention_pairs(length, cache_len + length, True, "flash")
    if kind == "linear":
        del flops["attn_scores"], flops["attn_values"]
        flops["linear_attention"] = config.n_layers * _linear_attention_flops(
            config, batch, length, cache_len
        )
        return flops
    flops["attn_scores"] = flops["attn_values"] = 2 * batch * s.heads * s.head_dim * pairs
    return flops


def _rnn_layer_flops(config: ModelConfig, tokens: int) -> dict[str, int]:
    gates = 4 if config.arch == "lstm" else 3
    d = config.d_model
    return {"rnn_input": 2 * tokens * d * gates * d, "rnn_recurrent": 2 * tokens * d * gates * d}


def _ssm_layer_flops(config: ModelConfig, tokens: int) -> dict[str, int]:
    d, e, n, r = config.d_model, config.ssm_expand * config.d_model, config.ssm_state, config.ssm_dt_rank
    return {
        "in_proj": 2 * tokens * d * 2 * e,
        "conv": 2 * tokens * e * config.ssm_conv,
        "x_proj": 2 * tokens * e * (r + 2 * n),
        "dt_proj": 2 * tokens * r * e,
        "ssm_output": 2 * tokens * e * n,  # y = C · h (the scan itself is elementwise)
        "out_proj": 2 * tokens * e * d,
    }


def _short_conv_layer_flops(config: ModelConfig, tokens: int) -> dict[str, int]:
    """LFM2's conv layer (model/short_conv.py): in_proj to 3 d, the depthwise conv of K taps, out_proj."""
    d = config.d_model
    return {
        "conv_in_proj": 2 * tokens * d * 3 * d,
        "conv": 2 * tokens * d * config.short_conv_kernel,
        "conv_out_proj": 2 * tokens * d * d,
    }


def linear_features(config: ModelConfig) -> int:
    return config.head_dim if config.linear_feature_map == "elu" else config.linear_features


def _linear_attention_flops(config: ModelConfig, batch: int, length: int, cache_len: int) -> int:
    """One layer of attention.linear: the feature maps (Performer's projection), then the
    recurrent step (a decode step: one token after some) or the chunked form."""
    s, f = Shapes.of(config), linear_features(config)
    flops = 0
    if config.linear_feature_map == "favor":
        flops += 2 * batch * (s.heads + s.kv_heads) * length * s.head_dim * f
    if length == 1 and cache_len > 0:
        return flops + 2 * batch * s.heads * (f * s.head_dim + f)
    chunk = min(LINEAR_CHUNK, length)
    padded = -(-length // chunk) * chunk
    flops += 2 * batch * s.kv_heads * padded * f * s.head_dim  # each chunk's sum of phi(k) v^T
    flops += 2 * batch * s.heads * padded * (chunk * f + f * s.head_dim + chunk * s.head_dim + f)
    return flops


# ---- decoding memory ----


def decode_memory_bytes(config: ModelConfig, batch: int, n: int, dtype=torch.float32) -> int:
    """Bytes of what decoding keeps after n tokens: the recurrent states (LSTM: h, c; GRU: h; SSM:
    the conv window and h, kept in float32 at least; linear attention: S and z), a hybrid's KV
    caches and conv windows, or the static KV cache of exact and windowed attention (the cache keeps every position, also for a
    windowed layer: a ring buffer would bound it at W + G, see window_bound_bytes)."""
    element = torch.empty((), dtype=dtype).element_size()
    kind, s = family(config), Shapes.of(config)
    d, layers = config.d_model, config.n_layers
    if kind == "lstm":
        return layers * 2 * batch * d * element
    if kind == "gru":
        return layers * batch * d * element
    if kind == "ssm":
        e = config.ssm_expand * d
        scan_element = max(element, 4)
        return layers * batch * e * ((config.ssm_conv - 1) * element + config.ssm_state * scan_element)
    if kind == "linear":
        f = linear_features(config)
        return layers * batch * s.kv_heads * (f * s.head_dim + f) * element
    if kind == "hybrid":  # the attention layers' KV caches, the conv layers' last K - 1 inputs
        convs = sum(config.layer_type(i) == "conv" for i in range(layers))
        window = convs * batch * d * (config.short_conv_kernel - 1) * element
        return (layers - convs) * 2 * batch * s.kv_heads * n * s.head_dim * element + window
    return layers * 2 * batch * s.kv_heads * n * s.head_dim * element


def window_bound_bytes(config: ModelConfig, batch: int, n: int, dtype=torch.float32) -> int:
    """The KV cache a windowed model needs at most: W + G positions in each sliding layer."""
    element = torch.empty((), dtype=dtype).element_size()
    s = Shapes.of(config)
    total = 0
    for index in range(config.n_layers):
        sliding = config.layer_type(index) == "sliding_attention"
        kept = min(n, config.sliding_window + config.global_tokens) if sliding else n
        total += 2 * batch * s.kv_heads * kept * s.head_dim * element
    return total


# ---- against n ----


def cost_rows(config: ModelConfig, lengths: list[int], batch: int = 1) -> list[dict]:
    """Per n: a forward pass's FLOPs per token, a decode step's FLOPs after n tokens, the
    decoding memory after n tokens."""
    rows = []
    for n in lengths:
        forward = sum(forward_flops(config, batch, n).values())
        step = sum(forward_flops(config, batch, 1, cache_len=n).values())
        rows.append(
            {
                "n": n,
                "forward_flops_per_token": forward / (batch * n),
                "decode_step_flops": step,
                "decode_memory_bytes": decode_memory_bytes(config, batch, n),
            }
        )
    return rows


def table(config: ModelConfig, lengths: list[int], batch: int = 1) -> str:
    """cost_rows as a Markdown table (`flashformer cost` for these families)."""
    rows = [
        [
            str(r["n"]),
            format_count(r["forward_flops_per_token"], "FLOP"),
            format_count(r["decode_step_flops"], "FLOP"),
            format_bytes(r["decode_memory_bytes"]),
        ]
        for r in cost_rows(config, lengths, batch)
    ]
    header = ["n", "forward FLOPs per token", "decode step after n", "decoding memory after n"]
    return markdown_table(header, rows)
