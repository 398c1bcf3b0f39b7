"""The sections of ModelConfig (config.py): one dataclass per part of the model, in the order
the data flows through them (SizeFields, EmbeddingFields, ..., TaskHeadFields), each with the
fields that shape that part, their documentation and their checks.

A section is never built alone: ModelConfig inherits every section, so the fields stay flat, and
each section's `_check` runs on the whole config, in section order. What is outside the
architecture (token ids, training, running and saving) has its sections in config.py, beside
ModelConfig.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashformer.model.positional import RopeScaling

RECURRENT_ARCHS = ("lstm", "gru", "ssm")  # the recurrent alternatives (recurrent.py, ssm.py)
ARCHS = ("encoder", "decoder", "encoder-decoder", *RECURRENT_ARCHS)
CAUSAL_ARCHS = ("decoder", *RECURRENT_ARCHS)  # next-token language models
ATTENTION_KINDS = ("softmax", "linear")
FEATURE_MAPS = ("elu", "favor")
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "relative", "none")
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
HF_MODEL_TYPES = (
    "bert",
    "gpt2",
    "t5",
    "llama",
    "qwen2",
    "phi3",
    "qwen3",
    "qwen3_moe",
    "gpt_oss",
    "lfm2",
    "gemma",
    "gemma2",
    "gemma3_text",
    "smollm3",
    "gemma4_text",
)
EXPERT_GATINGS = ("softmax", "topk_softmax")
LAYER_TYPES = ("full_attention", "sliding_attention", "conv")
TASKS = ("sequence-classification", "token-classification")
PROBLEM_TYPES = ("single_label_classification", "multi_label_classification", "regression")
CLASSIFIER_POOLINGS = ("pooler", "cls", "mean", "max")


class Section:
    """One section of ModelConfig: a dataclass of the fields that shape one part of the model (or
    say how it trains, runs or names its tokens), documented in its docstring and checked by its
    `_check`.

    A section is never built alone. ModelConfig inherits every section, so a field is given, read
    and saved flat (`ModelConfig(n_kv_heads=2)`, `config.n_kv_heads`, to_dict), and each `_check`
    runs on the whole config, in section order, reading the fields of earlier sections where it
    needs them. A new field goes into the section of the part it shapes, its checks into that
    section's `_check`; serialization, `replace`, the presets' overrides and the command line's
    `--model.FIELD` read the fields from the dataclass and need no edit.
    """

    def _check(self) -> None:
        """Fill in the section's derived fields; raise ValueError naming a field, its value and
        what was expected."""

    def _derive(self, name: str, value) -> None:
        """Field `name` given as None becomes `value`, computed from the other fields, and is
        remembered as derived, so that `replace` derives it again from new sizes."""
        if getattr(self, name) is None:
            setattr(self, name, value)
            self._derived = self._derived | {name}


# ---- the model's parts, in the order the data flows through them ----


@dataclass
class SizeFields(Section):
    """The architecture and its sizes.

    arch: "encoder" (BERT), "decoder" (GPT-2, LLaMA), "encoder-decoder" (T5), or one of the
        recurrent alternatives (no attention): "lstm", "gru" (recurrent.py: n_layers
        nn.LSTM / nn.GRU of width d_model) and "ssm" (ssm.py: Mamba blocks).
    vocab_size, d_model, n_layers, n_heads, d_ff: the usual sizes.
    n_kv_heads: key/value heads (GQA, MQA); None = n_heads.
    head_dim: None = d_model // n_heads; T5 sets it apart (d_kv).
    n_decoder_layers: decoder depth of an encoder-decoder; None = n_layers.
    (These three are resolved at construction: a built config holds ints.)
    max_seq_len: positions a model knows; a hard limit only for learned positions.
    """

    arch: str = "decoder"
    vocab_size: int = 50257
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    d_ff: int = 3072
    n_kv_heads: int | None = None
    head_dim: int | None = None
    n_decoder_layers: int | None = None
    max_seq_len: int = 1024

    def _check(self) -> None:
        _choice("arch", self.arch, ARCHS)
        _at_least(self, 1, "vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len")
        if self.head_dim is None and self.d_model % self.n_heads != 0:
            raise ValueError(
                f"ModelConfig.d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads}) "
                f"unless head_dim is given"
            )
        self._derive("n_kv_heads", self.n_heads)
        self._derive("head_dim", self.d_model // self.n_heads)
        self._derive("n_decoder_layers", self.n_layers)
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )


@dataclass
class EmbeddingFields(Section):
    """What the embeddings add to the token table.

    type_vocab_size: segment embeddings (BERT's token types); 0 = none.
    embedding_norm: a norm right after the embeddings (BERT).
    scale_embeddings: the token embeddings are multiplied by sqrt(d_model), rounded to their
        dtype first (Gemma).
    per_layer_input_dim: Gemma 4's per-layer inputs (model/per_layer.py): a second token table of
        n_layers * per_layer_input_dim, mixed with a projection of the embeddings, gives every layer
        a vector of this width that it gates into its output; 0 = none.
    per_layer_vocab_size: the rows of that table; None = vocab_size.
    """

    type_vocab_size: int = 0
    embedding_norm: bool = False
    scale_embeddings: bool = False
    per_layer_input_dim: int = 0
    per_layer_vocab_size: int | None = None

    def _check(self) -> None:
        _at_least(self, 0, "per_layer_input_dim")
        self._derive("per_layer_vocab_size", self.vocab_size)
        _at_least(self, 1, "per_layer_vocab_size")


@dataclass
class PositionFields(Section):
    """How the model knows the order of its tokens.

    position: "learned" | "sinusoidal" (added to the embeddings), "rope", "alibi", "relative"
        (T5's bucketed bias), "none".
    rope_theta, rotary_fraction (partial rotary), rope_scaling.
    rope_local_theta: the RoPE base of the sliding-window layers (Gemma 3's local 10,000 beside a
        global 1e6), which turn whole heads and take no rope_scaling; None = the same RoPE as every
        other layer.
    nope_layers: the indices of the layers whose queries and keys are not rotated at all (NoPE:
        SmolLM3's every fourth layer); () = RoPE in every layer.
    rope_proportional: partial rotary as Gemma 4's "proportional" RoPE: channel i still pairs with
        i + head_dim/2 and turns at theta^(-2i/head_dim), but only the first
        rotary_fraction * head_dim / 2 pairs turn (the others' frequency is 0); False = the first
        rotary_fraction * head_dim channels form a rotary part of their own (GPT-NeoX).
    relative_buckets, relative_max_distance: T5's bucketing.
    """

    position: str = "learned"
    rope_theta: float = 10000.0
    rotary_fraction: float = 1.0
    rope_scaling: RopeScaling | None = None
    rope_local_theta: float | None = None
    nope_layers: tuple[int, ...] = ()
    rope_proportional: bool = False
    relative_buckets: int = 32
    relative_max_distance: int = 128

    def _check(self) -> None:
        if isinstance(self.rope_scaling, dict):  # as read back from config.json
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        _choice("position", self.position, POSITIONS)
        if (
            self.position == "rope"
            and not self.rope_proportional
            and int(self.head_dim * self.rotary_fraction) % 2 != 0
        ):
            raise ValueError(
                f"RoPE rotates channel pairs: head_dim * rotary_fraction = {self.head_dim} * "
                f"{self.rotary_fraction} must be even"
            )
        self.nope_layers = tuple(self.nope_layers)  # a list, as read back from config.json
        if self.nope_layers and (
            self.position != "rope" or any(not 0 <= i < self.n_layers for i in self.nope_layers)
        ):
            raise ValueError(
                f"ModelConfig.nope_layers must name layers in [0, n_layers={self.n_layers}) of a RoPE model "
                f"(position='rope'); got {self.nope_layers!r} with position={self.position!r}"
            )
        if self.position == "sinusoidal" and self.d_model % 2 != 0:
            raise ValueError(f"sinusoidal positions need an even d_model; got {self.d_model}")


@dataclass
class AttentionFields(Section):
    """The attention sub-layer: its projections and its scores.

    attention_bias: biases in the q, k, v and output projections.
    attention_out_bias: a bias in self-attention's output projection; None = attention_bias
        (Qwen2 has q/k/v biases and none on the output).
    attention_scale: None = 1/sqrt(head_dim); T5 uses 1.0.
    qk_norm: an RMSNorm over head_dim on every query and key head before RoPE (Qwen3, Gemma 3).
    v_norm: an RMSNorm without a weight over every value head (Gemma 4).
    attention_softcap: attention scores become c * tanh(scores / c) (Gemma 2); None = off.
    attention_kind: "softmax" (exact attention) or "linear" (kernelized linear attention,
        attention/linear.py: phi(q) (sum phi(k) v^T), O(n) time and an O(1) decoding state).
    linear_feature_map: linear attention's phi: "elu" (elu + 1, Katharopoulos et al. 2020)
        or "favor" (Performer's positive random features, linear_features of them).
    attention_sinks: a learned logit per query head in every softmax's denominator, attending to
        nothing (gpt-oss; flashformer.attention's `sinks`).
    """

    attention_bias: bool = True
    attention_out_bias: bool | None = None
    attention_scale: float | None = None
    qk_norm: bool = False
    v_norm: bool = False
    attention_softcap: float | None = None
    attention_kind: str = "softmax"
    linear_feature_map: str = "elu"
    linear_features: int = 64
    attention_sinks: bool = False

    def _check(self) -> None:
        self._derive("attention_out_bias", self.attention_bias)
        _positive_or_none(self, "attention_softcap")
        _choice("attention_kind", self.attention_kind, ATTENTION_KINDS)
        _choice("linear_feature_map", self.linear_feature_map, FEATURE_MAPS)
        _at_least(self, 1, "linear_features")
        if self.attention_kind == "linear":
            clashes = {
                "position": self.position in ("alibi", "relative"),
                "attention_softcap": self.attention_softcap is not None,
                "attention_sinks": self.attention_sinks,
                "layer_types": self.layer_types is not None,
                "arch": self.arch != "decoder",
            }
            bad = [name for name, clash in clashes.items() if clash]
            if bad:
                raise ValueError(
                    f"attention_kind='linear' forms no score matrix, so it takes no score bias, softcap, "
                    f"sink or window, and serves decoders; got {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}"
                )


@dataclass
class LayerPatternFields(Section):
    """What differs from one layer to the next.

    layer_types: per layer "full_attention", "sliding_attention" (the window below, and
        rope_local_theta) or "conv" (LFM2's double-gated short convolution in place of attention:
        short_conv.py); None = every layer full.
    sliding_window: how many keys (the query's own included) a sliding layer sees.
    global_tokens: the first global_tokens positions attend to every key and every query attends
        to them, beside the window (Longformer / BigBird's global tokens); 0 = none. Only in
        sliding_attention layers, where they widen what the window sees.
    share_layers: one block's weights for all layers of a stack (ALBERT).
    (A conv layer's sizes are StateSpaceFields'.)
    global_head_dim: the head width of the full_attention layers (Gemma 4: 512 beside the sliding
        layers' 256); None = head_dim.
    kv_shared_layers: the last kv_shared_layers layers compute no keys and values: each attends
        over those of the last earlier layer of its type (Gemma 4); 0 = none.
    layer_d_ff: each layer's feed-forward width (Gemma 4 doubles it on the KV-shared layers);
        None = d_ff everywhere.
    """

    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    global_tokens: int = 0
    share_layers: bool = False
    global_head_dim: int | None = None
    kv_shared_layers: int = 0
    layer_d_ff: tuple[int, ...] | None = None

    def _check(self) -> None:
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
            if len(self.layer_types) != self.n_layers or any(t not in LAYER_TYPES for t in self.layer_types):
                raise ValueError(
                    f"ModelConfig.layer_types must give one of {LAYER_TYPES} for each of the "
                    f"n_layers={self.n_layers} layers; got {self.layer_types!r}"
                )
            if "sliding_attention" in self.layer_types and not (
                isinstance(self.sliding_window, int) and self.sliding_window >= 1
            ):
                raise ValueError(
                    f"sliding_attention layers need ModelConfig.sliding_window, an int >= 1; "
                    f"got {self.sliding_window!r}"
                )
            if self.share_layers and len(set(self.layer_types)) > 1:
                raise ValueError("ModelConfig.share_layers=True needs every layer of one type (layer_types)")
            if "conv" in self.layer_types and (self.arch != "decoder" or self.attention_kind != "softmax"):
                raise ValueError(
                    f"conv layers (layer_types) sit beside softmax attention in a decoder; got "
                    f"arch={self.arch!r}, attention_kind={self.attention_kind!r}"
                )
        _at_least(self, 0, "global_tokens")
        if self.global_head_dim is not None:
            _at_least(self, 1, "global_head_dim")
        _at_least(self, 0, "kv_shared_layers")
        if self.layer_d_ff is not None:
            self.layer_d_ff = tuple(self.layer_d_ff)
            widths = self.layer_d_ff
            if len(widths) != self.n_layers or not all(isinstance(w, int) and w >= 1 for w in widths):
                raise ValueError(
                    f"ModelConfig.layer_d_ff must give an int >= 1 for each of the n_layers={self.n_layers} "
                    f"layers; got {self.layer_d_ff!r}"
                )
        if self.kv_shared_layers:
            if self.kv_shared_layers >= self.n_layers or self.arch != "decoder":
                raise ValueError(
                    f"ModelConfig.kv_shared_layers={self.kv_shared_layers} needs a decoder with more layers "
                    f"(n_layers={self.n_layers}, arch={self.arch!r})"
                )
            for index in range(self.n_layers - self.kv_shared_layers, self.n_layers):
                if self.kv_source(index) is None:
                    raise ValueError(
                        f"ModelConfig.kv_shared_layers={self.kv_shared_layers}: layer {index} "
                        f"({self.layer_type(index)}) has no earlier layer of its type to share keys and values with"
                    )
        if self.global_tokens and "sliding_attention" not in (self.layer_types or ()):
            raise ValueError(
                f"ModelConfig.global_tokens={self.global_tokens} widens sliding-window layers, but "
                f"layer_types has none: {self.layer_types!r}"
            )

    def layer_type(self, index: int) -> str:
        """ "full_attention" or "sliding_attention": what layer `index` attends to."""
        return "full_attention" if self.layer_types is None else self.layer_types[index]

    def layer_head_dim(self, index: int) -> int:
        """The head width of layer `index` (global_head_dim on full layers, where given)."""
        if self.global_head_dim is not None and self.layer_type(index) == "full_attention":
            return self.global_head_dim
        return self.head_dim

    def layer_ffn_width(self, index: int) -> int:
        """The feed-forward width of layer `index` (layer_d_ff, else d_ff)."""
        return self.d_ff if self.layer_d_ff is None else self.layer_d_ff[index]

    def kv_source(self, index: int) -> int | None:
        """The layer whose keys and values layer `index` attends over, or None where it computes its
        own: the last layer before the shared ones with the same layer type."""
        first_shared = self.n_layers - self.kv_shared_layers
        if not self.kv_shared_layers or index < first_shared:
            return None
        kind = self.layer_type(index)
        return next((j for j in reversed(range(first_shared)) if self.layer_type(j) == kind), None)

    def kv_sharers(self) -> dict[int, str]:
        """The layers whose keys and values later layers read, each with its layer type."""
        sources = {self.kv_source(i) for i in range(self.n_layers)} - {None}
        return {j: self.layer_type(j) for j in sorted(sources)}


@dataclass
class FeedForwardFields(Section):
    """The feed-forward sub-layer.

    activation: "relu" | "gelu" | "gelu_tanh" | "silu".
    gated_ffn: act(gate(x)) * up(x) (SwiGLU with silu, T5 v1.1's gated-gelu with gelu_tanh).
    ffn_bias: biases in the feed-forward's projections.
    fused_gate_up: a gated feed-forward's gate and up as one projection, gate rows first
        (Phi-3's gate_up_proj), so a checkpoint's fused tensor loads as it is.
    swiglu_limit: gpt-oss's clamped SwiGLU (feed_forward.ClampedGatedFeedForward): the gate
        clamped to <= limit, up to [-limit, limit], and the output act(gate) * (up + 1), where
        act(g) = g * sigmoid(swiglu_alpha * g); None = the plain gated unit.
    swiglu_alpha: the clamped SwiGLU's sigmoid gain (gpt-oss: 1.702); 1.0 is silu.
    """

    activation: str = "gelu_tanh"
    gated_ffn: bool = False
    ffn_bias: bool = True
    fused_gate_up: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0

    def _check(self) -> None:
        _choice("activation", self.activation, ACTIVATIONS)
        _positive_or_none(self, "swiglu_limit")
        if not (isinstance(self.swiglu_alpha, (int, float)) and self.swiglu_alpha > 0):
            raise ValueError(f"ModelConfig.swiglu_alpha must be > 0; got {self.swiglu_alpha!r}")
        if self.swiglu_limit is None and self.swiglu_alpha != 1.0:
            raise ValueError(
                f"ModelConfig.swiglu_alpha={self.swiglu_alpha} belongs to the clamped SwiGLU; swiglu_limit is None"
            )
        if self.swiglu_limit is not None and (
            not self.gated_ffn or self.activation != "silu" or self.fused_gate_up
        ):
            raise ValueError(
                f"ModelConfig.swiglu_limit={self.swiglu_limit} (the clamped SwiGLU) needs gated_ffn=True, "
                f"activation='silu' and fused_gate_up=False; got gated_ffn={self.gated_ffn!r}, "
                f"activation={self.activation!r}, fused_gate_up={self.fused_gate_up!r}"
            )


@dataclass
class ExpertFields(Section):
    """A mixture of experts in place of every layer's feed-forward (model/experts.py; Qwen3 MoE,
    gpt-oss).

    n_expert: how many experts a layer holds; 0 = the dense feed-forward above.
    n_expert_used: how many of them each token runs (top-k of the router's scores).
    expert_ffn_hidden: each expert's width (a gated feed-forward, as gated_ffn, activation,
        ffn_bias and swiglu_limit say); None = d_ff.
    expert_weights_norm: the chosen experts' probabilities are divided by their sum
        (Qwen3 MoE's norm_topk_prob); False = they weigh the experts as the softmax over all
        experts gave them.
    expert_gating: "softmax": a softmax over all experts' logits, then the top k (Qwen3 MoE);
        "topk_softmax": the top k logits, then a softmax over those k (gpt-oss, llama.cpp's
        softmax_weight), whose weights sum to 1 already.
    expert_router_bias: a bias in the router (gpt-oss).
    """

    n_expert: int = 0
    n_expert_used: int = 0
    expert_ffn_hidden: int | None = None
    expert_weights_norm: bool = False
    expert_gating: str = "softmax"
    expert_router_bias: bool = False

    def _check(self) -> None:
        self._derive("expert_ffn_hidden", self.d_ff)
        _choice("expert_gating", self.expert_gating, EXPERT_GATINGS)
        _at_least(self, 0, "n_expert", "n_expert_used")
        _at_least(self, 1, "expert_ffn_hidden")
        if not self.n_expert:
            if self.n_expert_used:
                raise ValueError(
                    f"ModelConfig.n_expert_used={self.n_expert_used} needs experts; n_expert is 0"
                )
            return
        if not 1 <= self.n_expert_used <= self.n_expert:
            raise ValueError(
                f"ModelConfig.n_expert_used must be in [1, n_expert={self.n_expert}]; got {self.n_expert_used!r}"
            )
        clashes = {
            "arch": self.arch != "decoder",
            "gated_ffn": not self.gated_ffn,
            "fused_gate_up": self.fused_gate_up,
            "attention_kind": self.attention_kind != "softmax",
        }
        bad = [name for name, clash in clashes.items() if clash]
        if bad:
            raise ValueError(
                f"a mixture of experts (n_expert={self.n_expert}) is implemented for decoders whose experts "
                f"are gated feed-forwards, apart gate and up, beside softmax attention "
                f"(arch='decoder', gated_ffn=True, fused_gate_up=False, "
                f"attention_kind='softmax'); got {', '.join(f'{n}={getattr(self, n)!r}' for n in bad)}"
            )


@dataclass
class NormFields(Section):
    """The norms and where they sit around each sub-layer.

    norm: "layernorm" | "rmsnorm"; norm_eps.
    prenorm: norm before each sub-layer (GPT-2, T5, LLaMA; a final norm closes the stack) or
        after the residual add (BERT).
    sandwich_norm: a norm on each sub-layer's output too, before the residual add (Gemma 2 and 3:
        x + norm(attn(norm(x)))).
    layer_scale: each block's output is multiplied by a learned scalar of its own (Gemma 4's
        layer_scalar).
    """

    norm: str = "layernorm"
    norm_eps: float = 1e-5
    prenorm: bool = True
    sandwich_norm: bool = False
    layer_scale: bool = False

    def _check(self) -> None:
        _choice("norm", self.norm, NORMS)


@dataclass
class StateSpaceFields(Section):
    """The state-space blocks of arch "ssm" (Mamba: ssm.py), and the conv layers of a hybrid
    (layer_types "conv": LFM2's short convolution, short_conv.py).

    ssm_state: N, the state size per channel; ssm_conv: the causal conv's width;
    ssm_expand: the inner width d_inner = ssm_expand * d_model;
    ssm_dt_rank: the rank of the step size's projection; None = ceil(d_model / 16).
    short_conv_kernel: the width of a conv layer's causal depthwise convolution, the token
        itself included (LFM2's conv_L_cache: 3); its decoding state holds the last
        short_conv_kernel - 1 inputs. short_conv_bias: biases in its projections and conv.
    """

    ssm_state: int = 16
    ssm_conv: int = 4
    ssm_expand: int = 2
    ssm_dt_rank: int | None = None
    short_conv_kernel: int = 3
    short_conv_bias: bool = False

    def _check(self) -> None:
        self._derive("ssm_dt_rank", -(-self.d_model // 16))
        _at_least(self, 1, "ssm_state", "ssm_conv", "ssm_expand", "ssm_dt_rank")
        _at_least(self, 2, "short_conv_kernel")


@dataclass
class OutputHeadFields(Section):
    """What turns the last hidden state into logits.

    tie_word_embeddings: the output projection is the token embedding.
    final_logit_softcap: logits become c * tanh(logits / c) (Gemma 2); None = off.
    scale_decoder_output: multiply the final hidden state by d_model^-0.5 before the LM head
        (T5 with tied embeddings).
    mlm_head, pooler: an encoder's masked-LM head and [CLS] pooler.
    """

    tie_word_embeddings: bool = True
    final_logit_softcap: float | None = None
    scale_decoder_output: bool = False
    mlm_head: bool = True
    pooler: bool = False

    def _check(self) -> None:
        _positive_or_none(self, "final_logit_softcap")


@dataclass
class TaskHeadFields(Section):
    """An encoder's task head (model/heads.py), in place of the output heads above.

    task: None (the output heads), "sequence-classification" or "token-classification". A task
        decides the heads: no masked-LM head, and the pooler only where the classifier reads it
        (as transformers' BertFor*Classification have them).
    num_labels: None = len(labels), or 2. labels: the label names in id order (transformers'
        id2label); None = LABEL_0, LABEL_1, ...
    problem_type: "single_label_classification" | "multi_label_classification" | "regression",
        or None: inferred from the labels' dtype, as transformers does.
    classifier_pooling: what a sequence classifier reads: "pooler" (BERT's tanh-dense [CLS]
        state, transformers' choice), "cls" (the first token's hidden state), "mean" or "max"
        over the real tokens. classifier_dropout: None = dropout.
    """

    task: str | None = None
    num_labels: int | None = None
    labels: list[str] | None = None
    problem_type: str | None = None
    classifier_pooling: str = "pooler"
    classifier_dropout: float | None = None

    def _check(self) -> None:
        self._derive("num_labels", len(self.labels) if self.labels else 2)
        if self.task is not None:
            _choice("task", self.task, TASKS)
            if self.arch != "encoder":
                raise ValueError(f"ModelConfig.task={self.task!r} needs arch 'encoder'; got {self.arch!r}")
        if self.problem_type is not None:
            _choice("problem_type", self.problem_type, PROBLEM_TYPES)
        _choice("classifier_pooling", self.classifier_pooling, CLASSIFIER_POOLINGS)
        _at_least(self, 1, "num_labels")
        if self.labels is not None:
            self.labels = list(self.labels)
            if len(self.labels) != self.num_labels or len(set(self.labels)) != len(self.labels):
                raise ValueError(
                    f"ModelConfig.labels must name each of the num_labels={self.num_labels} labels once; "
                    f"got {self.labels!r}"
                )
        if self.classifier_dropout is not None and not 0.0 <= self.classifier_dropout < 1.0:
            raise ValueError(
                f"ModelConfig.classifier_dropout must be None or in [0, 1); got {self.classifier_dropout!r}"
            )
        if self.task == "token-classification" and self.problem_type not in (None, PROBLEM_TYPES[0]):
            raise ValueError(
                f"a token classifier predicts one label per token; got problem_type={self.problem_type!r}"
            )
        if self.task is not None:
            self.mlm_head = False
            self.pooler = self.task == "sequence-classification" and self.classifier_pooling == "pooler"


def _choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"ModelConfig.{name} must be one of {allowed}; got {value!r}")


def _at_least(config, minimum: int, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value < minimum:
            raise ValueError(f"ModelConfig.{name} must be an int >= {minimum}; got {value!r}")


def _positive_or_none(config, name: str) -> None:
    value = getattr(config, name)
    if value is not None and not value > 0:
        raise ValueError(f"ModelConfig.{name} must be None or > 0; got {value!r}")
