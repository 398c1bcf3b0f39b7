"""FLOPs of a forward pass, a training step and a decode step, per component.

FLOPs are matmul FLOPs, 2 per multiply-add, the convention of
torch.utils.flop_counter.FlopCounterMode (the tests check every figure
against it): norms, softmax, activations, residual adds and embedding
lookups are not counted; they are O(n·d) each, a few percent at most.

Causal attention computes fewer scores than full attention, and how many
fewer depends on the backend, so the score count follows a convention:

    "flash"  the pairs flashformer's flash backend computes: for each block of
             BLOCK_Q queries, every key up to the block's last visible one
             (tiles wholly above the diagonal are skipped): ≈ n²/2 + n·BLOCK_Q/2.
    "eager"  every (query, key) pair: the eager backend scores the whole
             matrix and masks afterwards: n·(c + n).
    "exact"  only the allowed pairs, n·c + n(n+1)/2: the lower bound a kernel
             with a per-element causal skip would reach.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashformer.attention.flash import BLOCK_K, BLOCK_Q
from flashformer.model.config import ModelConfig

CONVENTIONS = ("flash", "eager", "exact")
ATTENTION_COMPONENTS = ("attn_scores", "attn_values", "cross_scores", "cross_values")

# ---- how many (query, key) scores one head computes ----


def check_convention(convention: str) -> None:
    if convention not in CONVENTIONS:
        raise ValueError(f"attention convention must be one of {CONVENTIONS}; got {convention!r}")


def flash_block_sizes(q_len: int, block_q: int = BLOCK_Q, block_k: int = BLOCK_K) -> tuple[int, int]:
    """The tile the flash backend uses: with fewer queries than a block (decoding),
    the query block shrinks to q_len and the key block grows to keep the tile's area."""
    if q_len < block_q:
        return q_len, max(block_k, (block_q * block_k) // q_len)
    return block_q, block_k


def attention_pairs(
    q_len: int,
    k_len: int,
    causal: bool,
    convention: str = "flash",
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
) -> int:
    """Scores one head computes in the forward pass, under `convention`.

    Causal is aligned bottom-right, as in flashformer.attention: query i sees
    key j iff j <= i + (k_len - q_len).
    """
    check_convention(convention)
    if q_len < 1 or (causal and k_len < q_len) or k_len < 1:
        raise ValueError(f"need 1 <= q_len (<= k_len if causal); got q_len={q_len}, k_len={k_len}")
    if not causal or convention == "eager":
        return q_len * k_len
    offset = k_len - q_len
    if convention == "exact":
        return q_len * offset + q_len * (q_len + 1) // 2
    block_q, _ = flash_block_sizes(q_len, block_q, block_k)
    pairs = 0
    for q0 in range(0, q_len, block_q):  # ScoreRules.key_range: keys 0 .. last query + offset
        q1 = min(q_len, q0 + block_q)
        pairs += (q1 - q0) * min(k_len, q1 + offset)
    return pairs


def flash_backward_pairs(
    q_len: int, k_len: int, causal: bool, block_q: int = BLOCK_Q, block_k: int = BLOCK_K
) -> int:
    """Scores the flash backward recomputes: it walks key blocks and, for each,
    the queries that can see any of its keys (ScoreRules.query_range)."""
    if not causal:
        return q_len * k_len
    _, block_k = flash_block_sizes(q_len, block_q, block_k)
    offset = k_len - q_len
    pairs = 0
    for k0 in range(0, k_len, block_k):
        k1 = min(k_len, k0 + block_k)
        pairs += (k1 - k0) * max(0, q_len - max(0, k0 - offset))
    return pairs


# ---- one layer ----


@dataclass(frozen=True)
class Shapes:
    """The sizes the formulas read, from a ModelConfig."""

    d: int  # d_model
    d_ff: int
    heads: int  # query heads h
    kv_heads: int  # h_kv
    head_dim: int  # d_k
    vocab: int
    gated: bool

    @property
    def d_q(self) -> int:  # all query heads: h·d_k
        return self.heads * self.head_dim

    @property
    def d_kv(self) -> int:  # all key (or value) heads: h_kv·d_k
        return self.kv_heads * self.head_dim

    @property
    def ffn_matrices(self) -> int:  # up and down; a gated feed-forward adds the gate
        return 3 if self.gated else 2

    @classmethod
    def of(cls, config: ModelConfig) -> Shapes:
        return cls(
            config.d_model,
            config.d_ff,
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
            config.vocab_size,
            config.gated_ffn,
        )


def self_attention_flops(
    s: Shapes, batch: int, q_len: int, k_len: int, causal: bool, convention: str
) -> dict[str, int]:
    """One self-attention sub-layer: q_len new tokens, k_len keys (cached + new)."""
    tokens = batch * q_len
    pairs = batch * s.heads * attention_pairs(q_len, k_len, causal, convention)
    return {
        "q_proj": 2 * tokens * s.d * s.d_q,
        "k_proj": 2 * tokens * s.d * s.d_kv,
        "v_proj": 2 * tokens * s.d * s.d_kv,
        "attn_scores": 2 * pairs * s.head_dim,  # S = Q Kᵀ
        "attn_values": 2 * pairs * s.head_dim,  # O = P V
        "o_proj": 2 * tokens * s.d_q * s.d,
    }


def cross_attention_flops(
    s: Shapes, batch: int, q_len: int, memory_len: int, project_memory: bool = True
) -> dict[str, int]:
    """One cross-attention sub-layer (a T5 decoder's) over memory_len encoder tokens.
    With project_memory=False the memory's keys and values come from a cache."""
    pairs = batch * s.heads * q_len * memory_len
    return {
        "cross_q_proj": 2 * batch * q_len * s.d * s.d_q,
        "cross_kv_proj": 2 * batch * memory_len * s.d * 2 * s.d_kv if project_memory else 0,
        "cross_scores": 2 * pairs * s.head_dim,
        "cross_values": 2 * pairs * s.head_dim,
        "cross_o_proj": 2 * batch * q_len * s.d_q * s.d,
    }


def feed_forward_flops(s: Shapes, tokens: int) -> dict[str, int]:
    return {"ffn": 2 * s.ffn_matrices * tokens * s.d * s.d_ff}


def encoder_layer_flops(s: Shapes, batch: int, length: int, convention: str) -> dict[str, int]:
    return {
        **self_attention_flops(s, batch, length, length, causal=False, convention=convention),
        **feed_forward_flops(s, batch * length),
    }


def decoder_layer_flops(
    s: Shapes,
    batch: int,
    length: int,
    cache_len: int,
    convention: str,
    memory_len: int | None = None,
    project_memory: bool = True,
) -> dict[str, int]:
    flops = self_attention_flops(s, batch, length, cache_len + length, causal=True, convention=convention)
    if memory_len is not None:
        flops.update(cross_attention_flops(s, batch, length, memory_len, project_memory))
    flops.update(feed_forward_flops(s, batch * length))
    return flops


def head_flops(config: ModelConfig, s: Shapes, batch: int, tokens: int) -> dict[str, int]:
    """The LM head (tied or not: the same matmul). BERT's masked-LM head adds a
    d×d transform before it; its pooler is a d×d on the [CLS] token alone."""
    flops = {}
    if config.arch == "encoder" and config.mlm_head:
        flops["mlm_transform"] = 2 * batch * tokens * s.d * s.d
    if config.arch != "encoder" or config.mlm_head:
        flops["lm_head"] = 2 * batch * tokens * s.d * s.vocab
    if config.arch == "encoder" and config.pooler:
        flops["pooler"] = 2 * batch * s.d * s.d
    return flops


# ---- the whole model ----


@dataclass(frozen=True)
class Pass:
    """One forward pass: seq_len tokens (T5: into the encoder; dec_len into its
    decoder) after cache_len cached ones, batch sequences."""

    batch: int
    seq_len: int
    cache_len: int
    dec_len: int
    convention: str


def attention_calls(config: ModelConfig, p: Pass) -> list[tuple[str, int, int, int, bool]]:
    """(kind, layers, q_len, k_len, causal) of every attention call in the pass."""
    calls = []
    if config.arch in ("encoder", "encoder-decoder"):
        calls.append(("encoder", config.n_layers, p.seq_len, p.seq_len, False))
    if config.arch == "decoder":
        calls.append(("decoder", config.n_layers, p.seq_len, p.cache_len + p.seq_len, True))
    if config.arch == "encoder-decoder":
        calls.append(("decoder", config.n_decoder_layers, p.dec_len, p.cache_len + p.dec_len, True))
        calls.append(("cross", config.n_decoder_layers, p.dec_len, p.seq_len, False))
    return calls


def forward_flops(config: ModelConfig, p: Pass) -> tuple[dict[str, dict[str, int]], dict[str, int]]:
    """(one layer's components per stack, the whole model's components)."""
    s = Shapes.of(config)
    layer: dict[str, dict[str, int]] = {}
    stacks = []
    if config.arch in ("encoder", "encoder-decoder"):
        layer["encoder"] = encoder_layer_flops(s, p.batch, p.seq_len, p.convention)
        stacks.append(("encoder", config.n_layers))
    if config.arch == "decoder":
        layer["decoder"] = decoder_layer_flops(s, p.batch, p.seq_len, p.cache_len, p.convention)
        stacks.append(("decoder", config.n_layers))
    if config.arch == "encoder-decoder":
        layer["decoder"] = decoder_layer_flops(
            s, p.batch, p.dec_len, p.cache_len, p.convention, memory_len=p.seq_len
        )
        stacks.append(("decoder", config.n_decoder_layers))

    flops: dict[str, int] = {"embeddings": 0}  # a table lookup: no FLOPs
    for kind, depth in stacks:
        for name, value in layer[kind].items():
            flops[name] = flops.get(name, 0) + depth * value
    head_tokens = p.dec_len if config.arch == "encoder-decoder" else p.seq_len
    flops.update(head_flops(config, s, p.batch, head_tokens))
    return layer, flops


def backward_flops(config: ModelConfig, p: Pass, flops: dict[str, int]) -> int:
    """FLOPs of the backward pass of a training step, given the forward's components.

    A matmul Y = X W costs two in the backward pass (dX = dY Wᵀ, dW = Xᵀ dY):
    twice its forward. Attention's S = QKᵀ and O = PV likewise with the eager
    backend. The flash backward recomputes S tile by tile and forms dV, dP, dQ
    and dK: five matmuls over the pairs its backward visits, ≈ 2.5× the
    forward's two. The pooler is not on the masked-LM loss's path.
    """
    s = Shapes.of(config)
    dense = sum(v for k, v in flops.items() if k not in ATTENTION_COMPONENTS and k != "pooler")
    backward = 2 * dense
    for _, layers, q_len, k_len, causal in attention_calls(config, p):
        per_pair = 2 * p.batch * s.heads * s.head_dim * layers  # one matmul over one pair, all heads
        if p.convention == "flash":
            backward += 5 * per_pair * flash_backward_pairs(q_len, k_len, causal)
        else:
            backward += 4 * per_pair * attention_pairs(q_len, k_len, causal, p.convention)
    return backward


def recomputed_flops(config: ModelConfig, p: Pass, flops: dict[str, int]) -> int:
    """Activation checkpointing reruns every block's forward during the backward.

    torch.utils.checkpoint stops a rerun once it has recomputed the last
    tensor the backward needs. In a pre-norm block without dropout nothing
    after the feed-forward's down projection saves a tensor (the residual add
    keeps none), so that projection is not rerun.
    """
    if not config.activation_checkpointing:
        return 0
    recomputed = sum(v for k, v in flops.items() if component_group(k) != GROUPS[3])
    if config.prenorm and config.dropout == 0:
        for kind, layers, q_len, _, _ in attention_calls(config, p):
            if kind != "cross":
                recomputed -= layers * 2 * p.batch * q_len * config.d_ff * config.d_model
    return recomputed


def decode_step_flops(config: ModelConfig, batch: int, cache_len: int, memory_len: int) -> dict[str, int]:
    """Forward FLOPs of one new token per sequence after cache_len cached ones.

    Per layer: one token's projections and feed-forward (O(d² + d·d_ff)) and
    attention over c + 1 keys (O(c·d)); then the LM head (O(d·V)). In an
    encoder-decoder the encoder ran once before, and the memory's keys and
    values come from the cross-attention cache.
    """
    s = Shapes.of(config)
    memory = memory_len if config.arch == "encoder-decoder" else None
    layer = decoder_layer_flops(s, batch, 1, cache_len, "exact", memory, project_memory=False)
    depth = config.n_decoder_layers if config.arch == "encoder-decoder" else config.n_layers
    flops = {"embeddings": 0, **{name: depth * value for name, value in layer.items()}}
    flops.update(head_flops(config, s, batch, 1))
    return flops


GROUPS = ("projections (Q, K, V, O)", "attention (QKᵀ, PV)", "feed-forward", "embeddings and head")


def component_group(name: str) -> str:
    if name.endswith("_proj"):
        return GROUPS[0]
    if name in ATTENTION_COMPONENTS:
        return GROUPS[1]
    if name == "ffn":
        return GROUPS[2]
    return GROUPS[3]


# ---- where attention overtakes the rest ----


def crossover_seq_len(config: ModelConfig, convention: str = "flash", against: str = "dense") -> int:
    """The smallest n at which one self-attention layer's QKᵀ and PV FLOPs
    reach the rest of the layer's.

    against="dense": the Q, K, V, O projections and the feed-forward together;
    against="projections": the Q, K, V, O projections alone. Causal for
    decoders and encoder-decoders (their decoder layer). Found by bisection on
    the formulas, so every convention and shape is handled alike.
    """
    if against not in ("dense", "projections"):
        raise ValueError(f"against must be 'dense' or 'projections'; got {against!r}")
    s = Shapes.of(config)
    causal = config.arch != "encoder"

    def excess(n: int) -> int:
        flops = self_attention_flops(s, 1, n, n, causal, convention)
        rest = sum(v for k, v in flops.items() if k.endswith("_proj"))
        if against == "dense":
            rest += feed_forward_flops(s, n)["ffn"]
        return flops["attn_scores"] + flops["attn_values"] - rest

    low, high = 1, 2
    while excess(high) < 0:
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if excess(mid) < 0 else (low, mid)
    return high


def closed_form_crossover(config: ModelConfig, causal: bool, against: str = "dense") -> float:
    """The crossover from the closed form (docs/costs.md).

    Per token and layer the projections cost 2·d·(d_q + 2·d_kv) + 2·d_q·d and
    the feed-forward 2·m·d·d_ff (m = 2 matrices, 3 gated); attention costs
    4·d_q per key seen, n keys in full attention and (n + 1)/2 on average
    with the exact causal count. Equal when n = dense / (4·d_q), or
    2·dense / (4·d_q) - 1 causal. For the standard block (d_q = d_kv = d,
    d_ff = 4d): dense = 24·d², so n = 6·d, and 12·d - 1 causal.
    """
    s = Shapes.of(config)
    dense = 2 * s.d * (s.d_q + 2 * s.d_kv) + 2 * s.d_q * s.d
    if against == "dense":
        dense += 2 * s.ffn_matrices * s.d * s.d_ff
    per_key = 4 * s.d_q
    return dense / per_key if not causal else 2 * dense / per_key - 1
