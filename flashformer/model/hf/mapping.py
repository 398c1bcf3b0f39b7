"""The mapping between our parameter names and a Hugging Face family's.

A family is a config translation plus a list of `Rule`s that each map one of
our parameters to one or more of theirs; loading applies the rules, saving
inverts them. The helpers here keep each family's file a readable table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flashformer.model.config import ModelConfig


@dataclass(frozen=True)
class Rule:
    """ours <- theirs. kind "copy": one tensor as is; "t": transposed (GPT-2's
    Conv1D); "cat": ours is theirs concatenated on dim 0 (fused projections);
    "plus_one": ours = theirs + 1 (Gemma's RMSNorm scales by 1 + w and stores w;
    ours scales by its weight), added in float32."""

    ours: str
    theirs: tuple[str, ...]
    kind: str = "copy"

    def load(self, tensors: list[Tensor]) -> Tensor:
        if any(t.is_meta for t in tensors):  # placeholders (a GGUF load's skeleton): the shape
            # alone, without the ops' meta kernels (the first one imports torch._dynamo: 1.6 s)
            return torch.empty(self._shape(tensors), dtype=tensors[0].dtype, device="meta")
        if self.kind == "cat":
            return torch.cat(tensors, dim=0)
        if self.kind == "plus_one":
            return (tensors[0].float() + 1).to(tensors[0].dtype)
        # contiguous: a transposed view would reach the model as its parameter (load_state_dict
        # with assign=True), and its layout decides which GEMM kernels run (see layers.linear)
        return tensors[0].t().contiguous() if self.kind == "t" else tensors[0]

    def _shape(self, tensors: list[Tensor]) -> tuple[int, ...]:
        if self.kind == "cat":
            return (sum(len(t) for t in tensors), *tensors[0].shape[1:])
        return tuple(tensors[0].shape[::-1]) if self.kind == "t" else tuple(tensors[0].shape)

    def save(self, tensor: Tensor, sizes: list[int]) -> list[Tensor]:
        if self.kind == "cat":
            return list(tensor.split(sizes, dim=0))
        if self.kind == "plus_one":
            return [(tensor.float() - 1).to(tensor.dtype)]
        return [tensor.t() if self.kind == "t" else tensor]


def linear(ours: str, theirs: str, bias: bool = True, kind: str = "copy") -> list[Rule]:
    """A projection's weight (and bias) under another name."""
    rules = [Rule(f"{ours}.weight", (f"{theirs}.weight",), kind)]
    if bias:
        rules.append(Rule(f"{ours}.bias", (f"{theirs}.bias",)))
    return rules


def fused(ours: str, theirs: list[str], bias: bool) -> list[Rule]:
    """Our one projection (q, k, v fused) from their separate ones, stacked on the output dim."""
    rules = [Rule(f"{ours}.weight", tuple(f"{t}.weight" for t in theirs), "cat")]
    if bias:
        rules.append(Rule(f"{ours}.bias", tuple(f"{t}.bias" for t in theirs), "cat"))
    return rules


def norm(ours: str, theirs: str, bias: bool = True) -> list[Rule]:
    """A norm's weight (and, for LayerNorm, bias)."""
    return linear(ours, theirs, bias)


def offset_norm(ours: str, theirs: str) -> list[Rule]:
    """A Gemma RMSNorm: their w is our weight - 1."""
    return [Rule(f"{ours}.weight", (f"{theirs}.weight",), "plus_one")]


HF_TO_ACTIVATION = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "silu": "silu",
    "swish": "silu",
}
ACTIVATION_TO_HF = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "silu"}


class Family:
    """One Hugging Face model type: config translation, weight rules, file layout."""

    model_type: str
    ignored: tuple[str, ...] = ()  # regexes of tensors that carry nothing we need (buffers, aliases)

    def config_from_hf(self, hf: dict, weights: dict[str, Tensor]) -> ModelConfig:
        """Our config from config.json; the weights tell which heads exist and whether they are tied."""
        raise NotImplementedError

    def config_to_hf(self, config: ModelConfig) -> dict:
        """config.json for our config; raises for fields the family cannot express."""
        raise NotImplementedError

    def rules(self, config: ModelConfig) -> list[Rule]:
        """Every parameter of the model, ours <- theirs (names without the file's prefix)."""
        raise NotImplementedError

    def tied_aliases(self, config: ModelConfig) -> dict[str, str]:
        """Their head weight -> the embedding it equals when tied (dropped on load)."""
        return {}

    def strip_prefix(self, weights: dict[str, Tensor]) -> dict[str, Tensor]:
        """Drop the prefix a head class adds ("bert.", "transformer.", "model.")."""
        return weights

    def add_prefix(self, weights: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
        """Add the prefix of the class we save as."""
        return weights

    def file_name(self, name: str, config: ModelConfig) -> str:
        """Where one of their tensors (a rule's name) lives in a checkpoint file, for the docs'
        names table: its name with the prefix, or a slice of a tensor the file holds fused."""
        return next(iter(self.add_prefix({name: None}, config)))


def strip(weights: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    if not any(name.startswith(prefix) for name in weights):
        return weights
    return {name.removeprefix(prefix): t for name, t in weights.items()}


def activation_from_hf(hf: dict, key: str, default: str) -> str:
    name = hf.get(key, default)
    if name not in HF_TO_ACTIVATION:
        raise ValueError(
            f"config.json: {key}={name!r} is not supported; supported: {sorted(HF_TO_ACTIVATION)}"
        )
    return HF_TO_ACTIVATION[name]


def refuse(hf: dict, family: str, **allowed: tuple) -> None:
    """Raise for an option whose value we do not implement (absent = the HF default)."""
    for key, values in allowed.items():
        if key in hf and hf[key] not in values:
            raise ValueError(
                f"config.json: {key}={hf[key]!r} is not supported for {family} models "
                f"(supported: {', '.join(map(repr, values))})"
            )


def require(config: ModelConfig, family: str, **expected) -> None:
    """Raise for a config field that the Hugging Face family cannot express."""
    for name, value in expected.items():
        if getattr(config, name) != value:
            raise ValueError(
                f"ModelConfig.{name}={getattr(config, name)!r} cannot be saved as a Hugging Face {family} "
                f"model (it needs {value!r})"
            )


# the layer variants only some families have, at the values that mean "not there"
PLAIN_LAYERS = dict(
    qk_norm=False,
    sandwich_norm=False,
    attention_softcap=None,
    final_logit_softcap=None,
    scale_embeddings=False,
    layer_types=None,
    rope_local_theta=None,
    nope_layers=(),
    n_expert=0,
    attention_sinks=False,
    swiglu_limit=None,
    expert_gating="softmax",
    expert_router_bias=False,
    v_norm=False,
    layer_scale=False,
    rope_proportional=False,
    kv_shared_layers=0,
    layer_d_ff=None,
    per_layer_input_dim=0,
)


def plain_layers(config: ModelConfig, family: str, **allowed) -> None:
    """Raise for a layer variant (PLAIN_LAYERS) that the family cannot express; `allowed`
    overrides the values a family takes (Qwen3: qk_norm=True); heads of one width unless
    global_head_dim is allowed."""
    require(config, family, **{"global_head_dim": None, **PLAIN_LAYERS, **allowed})


def standard_heads(config: ModelConfig, family: str) -> None:
    if config.n_kv_heads != config.n_heads:
        raise ValueError(
            f"ModelConfig.n_kv_heads={config.n_kv_heads} cannot be saved as a {family} model (MHA only)"
        )
    if config.head_dim * config.n_heads != config.d_model:
        raise ValueError(f"ModelConfig.head_dim={config.head_dim} cannot be saved as a {family} model")


def is_tied(weights: dict[str, Tensor], head: str, embedding: str, hf: dict, default: bool) -> bool:
    """Tied when the file has no head weight, or one equal to the embedding
    with tie_word_embeddings on; a different head weight is the model's own."""
    if head not in weights:
        return True
    return hf.get("tie_word_embeddings", default) is not False and torch.equal(
        weights[head], weights[embedding]
    )
