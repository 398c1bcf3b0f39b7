"""One typed config for every model of the three families, in sections.

A model is fully described by a `ModelConfig`: the architecture (encoder,
decoder or encoder-decoder), the sizes, and one choice per variant (the norm,
where it sits, the feed-forward, the positional encoding, the heads). The
modules read the config once, at construction, and pick their components;
nothing in a forward pass branches on it.

The fields are grouped in sections, one dataclass each (SizeFields, AttentionFields, ...,
RunFields): a section holds the fields that shape one part of the model (sections.py, in the
order the data flows), or say how it trains, runs or names its tokens (here, beside ModelConfig),
with their documentation and their checks. ModelConfig inherits them all, so its fields stay
flat: given, read and saved by name, as config.json holds them.

    config = ModelConfig(arch="decoder", d_model=512, n_layers=8, n_heads=8, position="rope")
    ModelConfig.sections()                       # (SizeFields, EmbeddingFields, ...)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from flashformer.model.sections import (  # noqa: F401 (the constants, read from here by other rooms)
    ACTIVATIONS,
    ARCHS,
    CAUSAL_ARCHS,
    HF_MODEL_TYPES,
    LAYER_TYPES,
    RECURRENT_ARCHS,
    AttentionFields,
    EmbeddingFields,
    ExpertFields,
    FeedForwardFields,
    LayerPatternFields,
    NormFields,
    OutputHeadFields,
    PositionFields,
    Section,
    SizeFields,
    StateSpaceFields,
    TaskHeadFields,
    _choice,
)

# ---- outside the architecture: token ids, training, running and saving ----


@dataclass
class TokenFields(Section):
    """The special token ids (None = the model has none)."""

    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    decoder_start_token_id: int | None = None


@dataclass
class TrainingFields(Section):
    """What only training reads.

    dropout (embeddings and residual branches), attention_dropout, activation_dropout (inside the
    feed-forward, T5), dropout_after_final_norm (T5).
    init_std: the standard deviation of the initial weights.
    activation_checkpointing: recompute each block in the backward pass.
    """

    dropout: float = 0.1
    attention_dropout: float = 0.1
    activation_dropout: float = 0.0
    dropout_after_final_norm: bool = False
    init_std: float = 0.02
    activation_checkpointing: bool = False

    def _check(self) -> None:
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"ModelConfig.{name} must be in [0, 1); got {getattr(self, name)!r}")


@dataclass
class RunFields(Section):
    """How the model runs and what it saves as; neither changes what it computes.

    attention_backend: passed to flashformer.attention ("auto" picks).
    hf_model_type: the Hugging Face family this model saves as (one of HF_MODEL_TYPES), or None.
        The recurrent archs, linear attention and global tokens have no Hugging Face family: for
        them it becomes None (so that `--model.arch lstm` on the gpt-mini preset trains without
        a GPT-2 export at the end).
    """

    attention_backend: str = "auto"
    hf_model_type: str | None = None

    def _check(self) -> None:
        if self.hf_model_type is not None:
            _choice("hf_model_type", self.hf_model_type, HF_MODEL_TYPES)
        if self.arch in RECURRENT_ARCHS or self.attention_kind == "linear" or self.global_tokens:
            self.hf_model_type = None  # transformers has no such family: nothing to export as


# dataclasses gather a class's fields from its last base to its first: the sections are
# listed right to left, so that the fields (and config.json) read from SizeFields to RunFields
@dataclass
class ModelConfig(
    RunFields,
    TrainingFields,
    TokenFields,
    TaskHeadFields,
    OutputHeadFields,
    StateSpaceFields,
    NormFields,
    ExpertFields,
    FeedForwardFields,
    LayerPatternFields,
    AttentionFields,
    PositionFields,
    EmbeddingFields,
    SizeFields,
):
    """Everything that decides a model's shape and behaviour, in sections (`sections()`):

    the architecture, in the order the data flows: SizeFields, EmbeddingFields, PositionFields,
    AttentionFields, LayerPatternFields, FeedForwardFields, ExpertFields, NormFields, StateSpaceFields,
    OutputHeadFields, TaskHeadFields; then TokenFields, TrainingFields and RunFields. Each
    section's docstring describes its fields, and its `_check` validates them, in this order,
    when the config is built. The fields are flat: `ModelConfig(n_kv_heads=2).n_kv_heads`.
    """

    # which of the fields above were None and filled in from the others (see replace)
    _derived: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self):
        for section in self.sections():
            section._check(self)

    @classmethod
    def sections(cls) -> tuple[type[Section], ...]:
        """The config's sections in reading order (the order their fields and checks come in)."""
        return tuple(base for base in reversed(cls.__mro__) if Section in base.__bases__)

    # ---- serialization (config.json of our own checkpoints) ----

    def to_dict(self) -> dict:
        """The fields as one flat dict, as config.json holds them."""
        out = dataclasses.asdict(self)  # rope_scaling becomes a plain dict
        del out["_derived"]
        return out

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {unknown}")
        return cls(**values)

    def replace(self, **changes) -> ModelConfig:
        """A copy with fields changed. A field that was derived (None at
        construction) is derived again from the new sizes unless it is changed
        too: replace(n_heads=6) on GPT-2's config gives head_dim 128, not 64."""
        known = {f.name for f in dataclasses.fields(self) if f.init}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {unknown}")
        again = {name: None for name in self._derived if name not in changes}
        return dataclasses.replace(self, **again, **changes)
