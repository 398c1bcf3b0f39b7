"""LoRA beside a projection: y = base(x) + scaling · B(A(dropout(x))) for each adapter in use.

    layer = LoRALinear(model.decoder.blocks[0].attn.qkv)      # wraps the projection as it is
    layer.add("math", AdapterSettings(rank=8, alpha=16), {"q_proj": (0, 512), "v_proj": (640, 768)})

The base projection is never changed: a float nn.Linear, a QuantizedLinear or a ConcatenatedLinear
of GGUF blocks alike. The low-rank product runs beside it in float32 and is added to the output
rows its part covers, so one quantized base can carry several adapters at once and a batch can mix
them (`rows`: each row's adapter, as a server's batch of requests asks; Punica and S-LoRA group the
rows of one adapter the same way). Merging (merge_into_base) is for a float base only: a quantized
block rounded again would not be the file's.

Our q/k/v (and Phi-3's gate/up) are one fused projection; an adapter trained on transformers'
separate q_proj, k_proj, v_proj has one (A, B) per part, each adding into that part's rows of the
fused output. A part is named by the Hugging Face module it stands for ("q_proj", "c_attn"), so a
PEFT folder written back has transformers' names.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from flashformer.kernels.quantized import ConcatenatedLinear, QuantizedLinear


def lora_scaling(rank: int, alpha: float, use_rslora: bool = False) -> float:
    """PEFT's scale of the low-rank product: alpha / r, or alpha / sqrt(r) (rank-stabilized LoRA,
    whose update keeps its size as the rank grows)."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


@dataclass(frozen=True)
class AdapterSettings:
    """What one adapter is, whatever modules it covers: the fields of PEFT's adapter_config.json
    that change the product (and dropout, which changes training only)."""

    rank: int
    alpha: float
    use_rslora: bool = False
    dropout: float = 0.0

    @property
    def scaling(self) -> float:
        return lora_scaling(self.rank, self.alpha, self.use_rslora)


class LowRank(nn.Module):
    """One adapter's factors on one projection: a (A, B) pair per part (a fused projection's q, k or
    v rows; the whole output for an unfused one). A: (r, in_features), B: (rows, r), as PEFT stores
    lora_A.weight and lora_B.weight."""

    def __init__(self, in_features: int, settings: AdapterSettings, parts: dict[str, tuple[int, int]]):
        super().__init__()
        self.settings, self.parts = settings, dict(parts)  # part -> (first row, end row) of the output
        self.A = nn.ParameterDict()
        self.B = nn.ParameterDict()
        for part, (start, stop) in self.parts.items():
            # PEFT's initialization: A as nn.Linear's (Kaiming uniform), B zero: the adapter starts at 0
            a = torch.empty(settings.rank, in_features)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            self.A[part] = nn.Parameter(a)
            self.B[part] = nn.Parameter(torch.zeros(stop - start, settings.rank))
        self.dropout = nn.Dropout(settings.dropout) if settings.dropout > 0 else nn.Identity()

    def delta(self, x: Tensor, out_features: int) -> Tensor:
        """scaling · B A x for every part, placed in its rows: (..., in) -> (..., out_features)."""
        x = self.dropout(x.float())
        pieces, at = [], 0
        for part, (start, stop) in sorted(self.parts.items(), key=lambda item: item[1]):
            if start > at:  # rows no part of this adapter covers
                pieces.append(x.new_zeros(*x.shape[:-1], start - at))
            pieces.append((x @ self.A[part].t()) @ self.B[part].t())  # (..., r) -> (..., rows)
            at = stop
        if at < out_features:
            pieces.append(x.new_zeros(*x.shape[:-1], out_features - at))
        return torch.cat(pieces, dim=-1) * self.settings.scaling  # (..., out_features)

    def weight_delta(self) -> dict[str, Tensor]:
        """scaling · B A as one (out rows covered, in) matrix per part, stacked into the base's rows
        by merge_into_base."""
        return {part: (self.B[part] @ self.A[part]) * self.settings.scaling for part in self.parts}


class LoRALinear(nn.Module):
    """A projection and the adapters beside it (see the module docstring). `active`: the adapters
    every row uses (all added, as PEFT adds several active adapters), or `rows` for a batch whose
    rows use different ones."""

    def __init__(self, base: nn.Module):
        super().__init__()
        if not isinstance(base, nn.Linear | QuantizedLinear | ConcatenatedLinear):
            raise TypeError(f"LoRALinear: expected a linear projection to adapt, got {type(base).__name__}")
        self.base = base
        self.adapters = nn.ModuleDict()
        self.active: tuple[str, ...] = ()
        self.rows: tuple[tuple[str, ...], Tensor] | None = None  # (names, each row's index into them)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def add(self, name: str, settings: AdapterSettings, parts: dict[str, tuple[int, int]]) -> LowRank:
        """A new adapter (PEFT's initialization: B = 0, so it changes nothing yet), made active."""
        if name in self.adapters:
            raise ValueError(f"adapter {name!r} is already loaded on this projection")
        for part, (start, stop) in parts.items():
            if not 0 <= start < stop <= self.out_features:
                raise ValueError(
                    f"adapter {name!r}: part {part!r} covers rows [{start}, {stop}), outside the "
                    f"projection's {self.out_features} output rows"
                )
        low_rank = LowRank(self.in_features, settings, parts)
        self.adapters[name] = low_rank
        self.active = (*self.active, name)
        return low_rank

    def forward(self, x: Tensor) -> Tensor:  # (B, L, in) -> (B, L, out)
        y = self.base(x)
        if self.rows is not None:
            return y + self._rows_delta(x, *self.rows).to(y.dtype)
        for name in self.active:
            y = y + self.adapters[name].delta(x, self.out_features).to(y.dtype)
        return y

    def _rows_delta(self, x: Tensor, names: tuple[str, ...], row_adapter: Tensor) -> Tensor:
        """Each row's own adapter (row_adapter: (B,) per batch row, or (B, L) per token as a packed
        step of several sequences needs; an index into names, -1 = none): the rows of one adapter
        multiplied together, the others left at zero."""
        shape = x.shape[:-1]  # (B, L)
        selector = row_adapter.view(*row_adapter.shape, *[1] * (len(shape) - row_adapter.dim())).expand(shape)
        delta = x.new_zeros(*shape, self.out_features, dtype=torch.float32)  # (B, L, out)
        for index in row_adapter.unique().tolist():
            if index >= 0 and names[index] in self.adapters:  # an adapter may skip this projection
                chosen = selector == index  # (B, L) bool
                delta[chosen] = self.adapters[names[index]].delta(x[chosen], self.out_features)  # (n, out)
        return delta

    def merge_into_base(self) -> nn.Linear:
        """The base with every active adapter's scaling · B A added to its weight (a float base only):
        what `export --merge-lora` writes."""
        if not isinstance(self.base, nn.Linear):
            raise ValueError(
                f"merging an adapter needs a float projection; this one is {type(self.base).__name__} "
                f"(load the base with quantize=None)"
            )
        with torch.no_grad():
            for name in self.active:
                adapter = self.adapters[name]
                for part, delta in adapter.weight_delta().items():
                    start, stop = adapter.parts[part]
                    self.base.weight[start:stop] += delta.to(self.base.weight.dtype)
        return self.base

    def extra_repr(self) -> str:
        return f"adapters={list(self.adapters)}, active={list(self.active)}"


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Every adapted projection of `model`, by its module name."""
    return {name: module for name, module in model.named_modules() if isinstance(module, LoRALinear)}


def wrap(model: nn.Module, name: str) -> LoRALinear:
    """The LoRALinear at `name` (the projection wrapped in place, once)."""
    module = model.get_submodule(name)
    if isinstance(module, LoRALinear):
        return module
    wrapped = LoRALinear(module)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, wrapped)
    return wrapped


def set_active(model: nn.Module, names: list[str] | tuple[str, ...]) -> None:
    """Use these adapters (loaded ones; () = the base alone) on every row from now on."""
    layers = lora_layers(model)
    loaded = {name for layer in layers.values() for name in layer.adapters}
    unknown = sorted(set(names) - loaded)
    if unknown:
        raise ValueError(f"adapters {unknown} are not loaded; loaded: {sorted(loaded)}")
    for layer in layers.values():
        layer.active = tuple(n for n in names if n in layer.adapters)


def remove_adapter(model: nn.Module, name: str) -> None:
    """Take adapter `name` off every projection (a server unloading it); the wrappers stay, as
    plain projections while no adapter is left on them."""
    layers = [layer for layer in lora_layers(model).values() if name in layer.adapters]
    if not layers:
        raise ValueError(f"no adapter named {name!r} is loaded on this model")
    for layer in layers:
        del layer.adapters[name]
        layer.active = tuple(n for n in layer.active if n != name)


@contextlib.contextmanager
def adapter_per_row(model: nn.Module, names: tuple[str, ...], row_adapter: Tensor) -> Iterator[None]:
    """Within the block, batch row b uses adapter names[row_adapter[b]] (-1: the base alone): one
    forward over a batch whose requests chose different adapters. row_adapter may also be (B, L),
    one index per token, for a packed step whose row holds several sequences."""
    layers = lora_layers(model).values()
    loaded = {name for layer in layers for name in layer.adapters}
    unknown = sorted(set(names) - loaded)
    if unknown:
        raise ValueError(f"adapters {unknown} are not loaded; loaded: {sorted(loaded)}")
    if (
        row_adapter.dim() not in (1, 2)
        or row_adapter.is_floating_point()
        or not all(-1 <= i < len(names) for i in row_adapter.flatten().tolist())
    ):
        raise ValueError(
            f"row_adapter: expected a (B,) or (B, L) integer tensor of indices into names ({len(names)}) "
            f"or -1; got {row_adapter.tolist()}"
        )
    for layer in layers:
        layer.rows = (names, row_adapter)
    try:
        yield
    finally:
        for layer in layers:
            layer.rows = None


def merge_adapters(model: nn.Module) -> nn.Module:
    """`model` with its active adapters merged into its float projections and the wrappers gone:
    a plain model again, that save_pretrained writes as transformers reads it."""
    for name, layer in lora_layers(model).items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer.merge_into_base())
    return model


def adapter_parameters(model: nn.Module, name: str) -> dict[str, Tensor]:
    """One adapter's parameters under their names in the model's state dict (what a LoRA run's
    checkpoint holds)."""
    found = {}
    for module_name, layer in lora_layers(model).items():
        if name in layer.adapters:
            for key, tensor in layer.adapters[name].named_parameters():
                found[f"{module_name}.adapters.{name}.{key}"] = tensor  # its name in the state dict
    return found
