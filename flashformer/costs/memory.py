"""Bytes: weights, gradients, optimizer state, the KV cache, and activations.

Activations are counted as what autograd keeps for the loss's backward pass
at the end of a training forward: every tensor a flashformer module saves
on the loss's path, once per storage (tests/test_costs.py compares the
count with torch.autograd.graph.saved_tensors_hooks, storage by storage).
Branches the loss does not reach (the eager backend's unused log-sum-exp,
BERT's pooler) are released with their outputs and not counted. It is an
account of this implementation, not of an idealized one: a linear layer keeps
its input, a LayerNorm its input and two statistics per token, an RMSNorm
also its normalized output, CPU dropout a noise tensor of the input's size.

The attention core is where the backends differ. The eager backend keeps,
per head and per (query, key) pair, the exponentiated scores and the
probabilities (or, with attention dropout, the keep mask and the dropped
weights): Θ(n²). The flash backend keeps the output and one log-sum-exp per
query: Θ(n).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashformer.costs.flops import Pass, Shapes, flash_block_sizes
from flashformer.model.config import RECURRENT_ARCHS, ModelConfig

FLOAT32 = 4
INDEX = 8  # int64 token ids, positions, bucket indices
BOOL = 1

# ---- parameters ----


def norm_parameters(config: ModelConfig) -> int:
    return config.d_model * (2 if config.norm == "layernorm" else 1)  # weight (+ bias)


def block_parameters(config: ModelConfig, cross_attention: bool) -> int:
    s = Shapes.of(config)
    attn_bias, ffn_bias = config.attention_bias, config.ffn_bias
    qkv = s.d * (s.d_q + 2 * s.d_kv) + attn_bias * (s.d_q + 2 * s.d_kv)
    out = s.d_q * s.d + config.attention_out_bias * s.d
    total = qkv + out + 2 * norm_parameters(config)
    if cross_attention:
        q = s.d * s.d_q + attn_bias * s.d_q
        kv = s.d * 2 * s.d_kv + attn_bias * 2 * s.d_kv
        total += q + kv + s.d_q * s.d + attn_bias * s.d + norm_parameters(config)
    ffn_in = s.d * s.d_ff + ffn_bias * s.d_ff  # up (and gate)
    ffn_out = s.d_ff * s.d + ffn_bias * s.d
    total += (s.ffn_matrices - 1) * ffn_in + ffn_out
    return total


def stack_parameters(config: ModelConfig, layers: int, cross_attention: bool) -> int:
    blocks = 1 if config.share_layers else layers
    total = blocks * block_parameters(config, cross_attention)
    if config.position == "relative":
        total += config.relative_buckets * config.n_heads  # T5's bias table, one per stack
    if config.prenorm:
        total += norm_parameters(config)  # the final norm
    return total


def recurrent_parameter_count(config: ModelConfig) -> int:
    """Parameters of an LSTM, GRU or SSM model (model/recurrent.py, model/ssm.py)."""
    d = config.d_model
    total = config.vocab_size * d * (1 if config.tie_word_embeddings else 2)
    if config.arch in ("lstm", "gru"):
        gates = 4 if config.arch == "lstm" else 3
        return total + config.n_layers * gates * (2 * d * d + 2 * d)  # W_ih, W_hh, b_ih, b_hh
    e, n, r, k = config.ssm_expand * d, config.ssm_state, config.ssm_dt_rank, config.ssm_conv
    block = norm_parameters(config) + d * 2 * e + e * k + e + e * (r + 2 * n) + r * e + e + e * n + e + e * d
    return total + config.n_layers * block + norm_parameters(config)


def parameter_count(config: ModelConfig) -> int:
    """Parameters of flashformer.build(config), tied weights counted once."""
    if config.arch in RECURRENT_ARCHS:
        return recurrent_parameter_count(config)
    d, vocab = config.d_model, config.vocab_size
    total = vocab * d
    if config.position == "learned":
        total += config.max_seq_len * d
    total += config.type_vocab_size * d
    if config.embedding_norm:
        total += norm_parameters(config)
    if config.arch == "encoder":
        total += stack_parameters(config, config.n_layers, False)
        if config.pooler:
            total += d * d + d
        if config.mlm_head:
            total += d * d + d + norm_parameters(config) + vocab  # transform, norm, output bias
            total += 0 if config.tie_word_embeddings else vocab * d
        return total
    if config.arch == "decoder":
        total += stack_parameters(config, config.n_layers, False)
    else:
        total += stack_parameters(config, config.n_layers, False)
        total += stack_parameters(config, config.n_decoder_layers, True)
    return total + (0 if config.tie_word_embeddings else vocab * d)


# ---- the KV cache ----


def kv_cache_bytes(config: ModelConfig, batch: int, cache_len: int, memory_len: int, element: int):
    """(self-attention cache, cross-attention cache) in bytes.

    Every decoder layer keeps K and V for c positions: 2·L·c·h_kv·d_k
    elements per sequence. A T5 decoder also keeps the encoder output's keys
    and values for its cross-attention, 2·L·M·h_kv·d_k (M encoder tokens);
    counted when there is a cache (cache_len > 0). An encoder keeps none.
    """
    if config.arch == "encoder" or cache_len == 0:
        return 0, 0
    layers = config.n_decoder_layers if config.arch == "encoder-decoder" else config.n_layers
    per_position = 2 * layers * config.n_kv_heads * config.head_dim * element * batch
    cross = per_position * memory_len if config.arch == "encoder-decoder" else 0
    return per_position * cache_len, cross


# ---- activations kept for the backward pass ----


@dataclass(frozen=True)
class Saved:
    """Bytes of one training forward's saved tensors, by where they come from."""

    embeddings: int
    layers: int  # norms, projections, feed-forward and dropout noise of every block
    attention: int  # the attention cores: what the backend keeps
    head: int  # final norms, the LM / masked-LM head, the loss

    @property
    def total(self) -> int:
        return self.embeddings + self.layers + self.attention + self.head


def norm_saved(config: ModelConfig, tokens: int, element: int) -> int:
    """LayerNorm keeps its input, mean and 1/std; RMSNorm its input, 1/rms and
    its normalized output (the weight's gradient reads it)."""
    width = config.d_model * element
    if config.norm == "layernorm":
        return tokens * (width + 2 * FLOAT32)
    return tokens * (2 * width + FLOAT32)


def feed_forward_saved(config: ModelConfig, tokens: int, element: int) -> int:
    """Between the up and the down projection, each tensor d_ff wide.

    GELU and SiLU keep their input, ReLU its output (which the down
    projection keeps too); the gated product keeps both factors; dropout
    keeps its noise, and the down projection then keeps the dropped tensor.
    """
    dropout = config.activation_dropout > 0
    if config.gated_ffn:
        kept = 5 if dropout else 4  # gate, act(gate), up, [noise,] the down projection's input
    elif config.activation == "relu":
        kept = 3 if dropout else 1  # relu(u), [noise, dropped]
    else:
        kept = 3 if dropout else 2  # u, [noise,] the down projection's input
    return kept * tokens * config.d_ff * element


def sublayer_saved(config: ModelConfig, tokens: int, inner: int, element: int) -> int:
    """One residual sub-layer outside its core: the norm (of the input before
    the sub-layer, or of the sum after it), the projection's input, the
    output projection's input (`inner` wide) and the residual dropout's noise.
    Pre- and post-norm keep the same amounts."""
    d = config.d_model
    noise = tokens * d * element if config.dropout > 0 else 0
    return norm_saved(config, tokens, element) + tokens * (d + inner) * element + noise


def attention_core_saved(
    config: ModelConfig, backend: str, batch: int, q_len: int, k_len: int, kind: str, element: int
) -> int:
    """What one attention call keeps, from the q, k, v projections' outputs to
    its own output (kind: "encoder", "decoder" or "cross")."""
    s = Shapes.of(config)
    rotary = config.position == "rope" and kind != "cross"
    q_size = batch * q_len * s.d_q  # elements of Q, B·h·n·d_k
    qkv_size = batch * q_len * (s.d_q + 2 * s.d_kv)  # the fused projection's output
    if backend == "flash":
        # flash keeps q, k, v (views of the projections' outputs, or RoPE's
        # rotated copies of q and k), the output and the LSE
        if kind == "cross":
            inputs = q_size + batch * k_len * 2 * s.d_kv  # q's projection; the memory's k, v projection
        else:
            inputs = qkv_size + rotary * (q_size + batch * q_len * s.d_kv)
        return (inputs + q_size) * element + batch * s.heads * q_len * FLOAT32
    if backend != "eager":
        raise ValueError(f"backend must be 'eager' or 'flash'; got {backend!r}")
    pairs = batch * s.heads * q_len * k_len
    # Q for QKᵀ: a view of the fused projection when its (B, h) dims merge
    # (B = 1 or h = 1), otherwise (or rotated, or cross) a tensor of Q's size.
    # K and V are repeated to h heads: copies of B·h·k_len·d_k each.
    q_kept = qkv_size if kind != "cross" and not rotary and (batch == 1 or s.heads == 1) else q_size
    kept = (q_kept + 2 * batch * s.heads * k_len * s.head_dim) * element
    kept += pairs * FLOAT32  # exp(S - max), read by the division's and exp's backward
    if config.attention_dropout > 0:
        kept += pairs * (BOOL + FLOAT32)  # the keep mask, the dropped weights
    else:
        kept += pairs * FLOAT32  # P
    kept += batch * s.heads * q_len * (FLOAT32 + BOOL)  # the softmax denominators, their zero mask
    if kind == "decoder" and q_len > 1:
        kept += q_len * k_len * BOOL  # the causal mask: one (n, m) tensor, shared by batch and heads
    if config.position == "relative" and kind != "cross":
        kept += q_len * k_len * INDEX  # T5's bucket of every pair, for the bias table's gradient
    return kept


def activation_bytes(
    config: ModelConfig, p: Pass, backend: str, element: int = FLOAT32, with_loss: bool = True
) -> Saved:
    """Bytes autograd keeps after a training forward (no padding mask), per part.

    The formulas follow flashformer's modules tensor by tensor; see the
    module docstring. `element`: bytes per activation (scores, statistics and
    softmax rows stay float32 in every dtype).
    """
    s = Shapes.of(config)
    d, b = s.d, p.batch
    stacks = []  # (kind, layers, q_len, k_len)
    if config.arch in ("encoder", "encoder-decoder"):
        stacks.append(("encoder", config.n_layers, p.seq_len, p.seq_len))
    if config.arch == "decoder":
        stacks.append(("decoder", config.n_layers, p.seq_len, p.cache_len + p.seq_len))
    if config.arch == "encoder-decoder":
        stacks.append(("decoder", config.n_decoder_layers, p.dec_len, p.cache_len + p.dec_len))

    embeddings = layers = attention = head = 0
    for kind, depth, q_len, k_len in stacks:
        tokens = b * q_len
        embeddings += tokens * INDEX  # token ids, for the embedding's gradient
        if config.position == "learned":
            embeddings += q_len * INDEX  # position ids
        if config.embedding_norm:
            embeddings += norm_saved(config, tokens, element)
        if config.dropout > 0:
            embeddings += tokens * d * element
        if config.position == "rope":
            embeddings += 2 * q_len * int(s.head_dim * config.rotary_fraction) * FLOAT32  # cos, sin
        per_layer = sublayer_saved(config, tokens, s.d_q, element)  # attention
        per_layer += sublayer_saved(config, tokens, 0, element) + feed_forward_saved(config, tokens, element)
        core = attention_core_saved(config, backend, b, q_len, k_len, kind, element)
        if kind == "decoder" and config.arch == "encoder-decoder":
            per_layer += sublayer_saved(config, tokens, s.d_q, element)  # cross-attention
            core += attention_core_saved(config, backend, b, q_len, p.seq_len, "cross", element)
        layers += depth * per_layer
        attention += depth * core
        if config.prenorm:
            head += norm_saved(config, tokens, element)  # the final norm
        if config.dropout_after_final_norm and config.dropout > 0:
            head += tokens * d * element  # its dropout's noise
    head_tokens = b * (p.dec_len if config.arch == "encoder-decoder" else p.seq_len)
    if config.arch == "encoder-decoder":
        head += b * p.seq_len * d * element  # the memory, projected by every cross-attention
        head += head_tokens * d * element  # hidden * d^-0.5, the LM head's input
    elif config.arch == "decoder":
        head += head_tokens * d * element  # the final norm's output, the LM head's input
    else:
        if config.mlm_head:  # its input, dense output, norm (of GELU's output), norm output
            head += 3 * head_tokens * d * element + norm_saved(config, head_tokens, element)
    if with_loss and (config.arch != "encoder" or config.mlm_head):
        head += head_tokens * (s.vocab * FLOAT32 + INDEX)  # log-softmax of the logits, the targets
        head += FLOAT32  # the loss's total weight, a scalar
        if config.arch == "decoder" and b == 1:
            head += INDEX  # the shifted targets are a view of the labels padded by one
    return Saved(embeddings, layers, attention, head)


# ---- the peak memory of one attention call ----


def attention_peak_bytes(
    backend: str,
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    head_dim: int,
    *,
    kv_heads: int | None = None,
    causal: bool = True,
    train: bool = False,
) -> int:
    """Bytes one float32 call of flashformer.attention allocates at its peak,
    on top of q, k, v (and, in training, the output's gradient).

    This is what `flashformer bench attention` measures (its memory worker:
    a forward without grad, then a forward + backward). The counts follow the
    code of each backend, tensor by tensor:

    eager, forward: three score-sized float32 buffers at once (the masked
    scores, exp(S - max), P) beside the repeated K and V and the output.
    eager, training: six score-sized buffers at the peak, in the backward of
    P = E / rowsum(E): the saved E, the incoming dP, the numerator's gradient
    dP / r, and three temporaries of the denominator's gradient (-dP·E/r/r);
    beside them the causal mask, the repeated K (saved), the output and dV.
    flash, forward: the output and the LSE, and per query block the scaled
    query tile, its accumulator and two score tiles (the next one is
    allocated before the last is released).
    flash, training: the output and LSE (saved), dQ, dK, dV, the LSE's safe
    copy and the row sums D = rowsum(dO∘O), and per key block the key tile,
    its dK and dV accumulators, the dQ update, and three score-sized tiles
    (S, dP, and the previous iteration's, alive until reassigned).
    """
    kv_heads = heads if kv_heads is None else kv_heads
    f = FLOAT32
    out = batch * heads * q_len * head_dim * f
    if backend == "eager":
        scores = batch * heads * q_len * k_len * f
        repeated = batch * heads * k_len * head_dim * f  # K (or V) repeated to every query head
        if not train:
            return 3 * scores + 2 * repeated + out
        mask = q_len * k_len * BOOL if causal and q_len > 1 else 0
        return 6 * scores + mask + repeated + out + repeated  # ... + dV at Hq heads
    if backend != "flash":
        raise ValueError(f"backend must be 'eager' or 'flash'; got {backend!r}")
    block_q, block_k = flash_block_sizes(q_len)
    block_k = min(block_k, k_len)
    tile = batch * heads * block_q * block_k * f
    q_tile = batch * heads * block_q * head_dim * f
    lse = batch * heads * q_len * f
    if not train:
        return out + lse + 2 * q_tile + 2 * tile  # + the scaled query tile and the accumulator
    grads = out + 2 * batch * kv_heads * k_len * head_dim * f  # dQ, dK, dV
    key_tiles = 3 * batch * kv_heads * block_k * head_dim * f  # K tile, dK and dV accumulators
    return out + lse + 2 * lse + grads + key_tiles + q_tile + 3 * tile
