"""PEFT's LoRA folders (adapter_config.json + adapter_model.safetensors) onto our models, and back.

    name = load_peft(model, "adapters/math")                 # float or quantized base alike
    save_peft(model, "math", "out/math-peft")                # PeftModel.from_pretrained reads it

PEFT names a module by transformers' name ("model.layers.0.self_attn.q_proj"); ours fuse some of
them (q/k/v in one projection, Phi-3's gate/up). The family's naming rules (model/hf/) say where
each of their modules lives in ours: which projection, which of its output rows. A file's tensor
that finds no place, a shape that is not the one the config and the base imply, or an option
that changes the product and is not implemented (DoRA, biases, per-module ranks) is refused with
the file, the module and what was expected: a different model is never served silently.

What PEFT does that matters here: the product is added as scaling · B(A(x)) whatever
fan_in_fan_out says (that flag only tells PEFT how to merge into GPT-2's transposed Conv1D
weights); A is (r, in_features), B (out_features, r); scaling is lora_alpha / r, or
lora_alpha / sqrt(r) with use_rslora.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from flashformer.adapters.lora import AdapterSettings, LoRALinear, lora_layers, wrap
from flashformer.files import publish_folder
from flashformer.kernels.quantized import ConcatenatedLinear, QuantizedLinear
from flashformer.model import hf
from flashformer.model.hf.convert import fused_part_rows

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel's prefix before transformers' module names
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<factor>[AB])\.weight$")
# adapter_config.json's options that change the product, at the values we implement
_PLAIN = {"bias": ("none",), "use_dora": (False, None), "lora_bias": (False, None)}
# PEFT's task type per architecture (the PeftModel class it wraps the model in); None: the plain
# PeftModel (BERT's masked LM has no task type of its own)
TASK_TYPES = {"decoder": "CAUSAL_LM", "encoder-decoder": "SEQ_2_SEQ_LM", "encoder": None}
_EMPTY = ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform", "layer_replication")


class AdapterError(ValueError):
    """An adapter that does not fit its base or cannot be read; the message names the file, the
    module and what was expected."""


@dataclass(frozen=True)
class Target:
    """Where one of transformers' modules lives in our model: our projection and its output rows."""

    module: str  # our module name: decoder.blocks.0.attn.qkv
    rows: tuple[int, int]  # [start, stop) of its output
    in_features: int


def _linear_sizes(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a projection, float or quantized; None for anything else."""
    if isinstance(module, LoRALinear | nn.Linear | QuantizedLinear | ConcatenatedLinear):
        return module.in_features, module.out_features
    return None


def targets(model: nn.Module) -> dict[str, Target]:
    """transformers' module name (as a checkpoint names it: "model.layers.0.self_attn.q_proj") ->
    where it lives in `model`, for every projection the family's rules map."""
    config = model.config
    if config.hf_model_type is None:
        raise AdapterError("this model has no Hugging Face counterpart (ModelConfig.hf_model_type is None)")
    layout = hf.family(config.hf_model_type)
    part_rows = fused_part_rows(layout, config)
    found = {}
    for rule in layout.rules(config):
        if not rule.ours.endswith(".weight") or rule.kind not in ("copy", "t", "cat"):
            continue
        ours = rule.ours.removesuffix(".weight")
        sizes = _linear_sizes(model.get_submodule(ours))
        if sizes is None:  # a norm's or an embedding's weight
            continue
        at = 0
        for theirs in rule.theirs:
            rows = part_rows[theirs] if rule.kind == "cat" else sizes[1]
            (full,) = layout.add_prefix({theirs: None}, config)
            found[full.removesuffix(".weight")] = Target(ours, (at, at + rows), sizes[0])
            at += rows
    return found


def part_name(module: str) -> str:
    """A part's name inside our projection: the last word of transformers' module ("q_proj")."""
    return module.rsplit(".", 1)[-1]


def matches(name: str, target_modules: str | list[str]) -> bool:
    """PEFT's rule: a regex string matches the whole name; a list matches a name equal to one of
    its entries or ending in "." + one of them."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith("." + t) for t in target_modules)


def read_config(folder: Path) -> tuple[AdapterSettings, dict]:
    """(the adapter's settings, the raw config) of adapter_config.json, its options checked."""
    path = folder / CONFIG
    if not path.is_file():
        raise AdapterError(f"{folder}: no {CONFIG} (a PEFT adapter folder holds {CONFIG} and {WEIGHTS})")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise AdapterError(f"{path}: not valid JSON ({error})") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type={raw['peft_type']!r}; expected 'LORA'")
    for key, allowed in _PLAIN.items():
        if raw.get(key, allowed[0]) not in allowed:
            raise AdapterError(f"{path}: {key}={raw[key]!r} is not supported (supported: {allowed[0]!r})")
    for key in _EMPTY:
        if raw.get(key):
            raise AdapterError(f"{path}: {key}={raw[key]!r} is not supported (supported: empty)")
    for key in ("r", "lora_alpha"):
        if not isinstance(raw.get(key), int | float) or raw[key] <= 0:
            raise AdapterError(f"{path}: {key}={raw.get(key)!r}; expected a positive number")
    if raw["r"] != int(raw["r"]):
        raise AdapterError(f"{path}: r={raw['r']!r}; expected a positive integer")
    settings = AdapterSettings(
        rank=int(raw["r"]),
        alpha=float(raw["lora_alpha"]),
        use_rslora=bool(raw.get("use_rslora", False)),
        dropout=float(raw.get("lora_dropout") or 0.0),
    )
    return settings, raw


def read_tensors(folder: Path) -> dict[str, Tensor]:
    path = folder / WEIGHTS
    if not path.is_file():
        raise AdapterError(f"{folder}: no {WEIGHTS}")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as error:
        raise AdapterError(f"{path}: cannot be read as safetensors ({error})") from None


def load_peft(model: nn.Module, folder: str | Path, name: str | None = None) -> str:
    """Add the PEFT adapter in `folder` beside `model`'s projections (float or quantized) and make
    it active; returns its name (`name`, or the folder's name). Nothing of the model changes
    unless every tensor fits (AdapterError otherwise)."""
    folder = Path(folder)
    name = name or folder.resolve().name
    settings, raw = read_config(folder)
    tensors = read_tensors(folder)
    where = targets(model)
    weights_path = folder / WEIGHTS
    factors: dict[str, dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(
                f"{weights_path}: tensor {key!r} is not a LoRA factor "
                f"(expected {PREFIX}<module>.lora_A.weight / .lora_B.weight)"
            )
        module = match["module"]
        if module not in where:
            raise AdapterError(
                f"{weights_path}: module {module!r} is not a projection of this "
                f"{model.config.hf_model_type} base ({model.config.n_layers} layers; its projections "
                f"are named like {next(iter(where))!r})"
            )
        factors.setdefault(module, {})[match["factor"]] = tensor
    if not factors:
        raise AdapterError(f"{weights_path}: holds no LoRA factor")
    for module, pair in factors.items():
        _check_pair(weights_path, module, pair, where[module], settings)
    by_projection: dict[str, dict[str, str]] = {}  # ours -> {part: their module}
    for module in factors:
        by_projection.setdefault(where[module].module, {})[part_name(module)] = module
    for ours in by_projection:
        if name in getattr(model.get_submodule(ours), "adapters", {}):
            raise AdapterError(f"{folder}: an adapter named {name!r} is loaded already")
    for ours, parts in by_projection.items():
        layer = wrap(model, ours)
        low_rank = layer.add(name, settings, {part: where[module].rows for part, module in parts.items()})
        with torch.no_grad():
            for part, module in parts.items():
                low_rank.A[part].copy_(factors[module]["A"].float())
                low_rank.B[part].copy_(factors[module]["B"].float())
        low_rank.to(_device(layer.base))
    return name


def add_lora(
    model: nn.Module, name: str, settings: AdapterSettings, target_modules: str | list[str]
) -> list[str]:
    """A new adapter (PEFT's initialization: A random, B zero) on every projection whose
    transformers name `target_modules` matches as PEFT matches it ("q_proj" or a regex); returns
    the modules it covers. Draws from torch's global generator (seed it for a reproducible A)."""
    where = targets(model)
    chosen = [module for module in where if matches(module, target_modules)]
    if not chosen:
        names = sorted({part_name(module) for module in where})
        raise AdapterError(
            f"target modules {target_modules!r} match no projection of this model; it has {names}"
        )
    by_projection: dict[str, dict[str, tuple[int, int]]] = {}
    for module in chosen:
        by_projection.setdefault(where[module].module, {})[part_name(module)] = where[module].rows
    for ours, parts in by_projection.items():
        layer = wrap(model, ours)
        layer.add(name, settings, parts).to(_device(layer.base))
    return chosen


def load_adapters(model: nn.Module, adapters) -> list[str]:
    """load(..., adapters=...)'s argument onto `model`: a folder, a list of folders (each named by
    its folder's name) or {name: folder}; all of them active. Returns the names."""
    if isinstance(adapters, str | Path):
        adapters = [adapters]
    if isinstance(adapters, dict):
        items = list(adapters.items())
    elif isinstance(adapters, list | tuple):
        items = [(None, folder) for folder in adapters]
    else:
        raise TypeError(
            f"adapters: expected a folder, a list of folders or {{name: folder}}; got {type(adapters).__name__}"
        )
    return [load_peft(model, folder, name) for name, folder in items]


def _check_pair(path: Path, module: str, pair: dict, target: Target, settings: AdapterSettings) -> None:
    for factor in "AB":
        if factor not in pair:
            raise AdapterError(f"{path}: module {module!r} has no lora_{factor}.weight")
    rows = target.rows[1] - target.rows[0]
    expected = {"A": (settings.rank, target.in_features), "B": (rows, settings.rank)}
    for factor, shape in expected.items():
        got = tuple(pair[factor].shape)
        if got != shape:
            raise AdapterError(
                f"{path}: module {module!r}: lora_{factor}.weight has shape {got}; expected {shape} "
                f"(rank r={settings.rank} in {CONFIG}; the base's {module} maps {target.in_features} "
                f"inputs to {rows} outputs)"
            )


def _device(module: nn.Module) -> torch.device:
    tensor = next(iter([*module.parameters(), *module.buffers()]), None)
    return torch.device("cpu") if tensor is None else tensor.device


# ---- writing ----


def save_peft(
    model: nn.Module, name: str, folder: str | Path, base_model_name_or_path: str | None = None
) -> Path:
    """Write adapter `name` as a PEFT folder that PeftModel.from_pretrained loads onto the
    matching transformers model; whole or not at all (written beside, then renamed into place)."""
    folder = Path(folder)
    where = {(t.module, t.rows): full for full, t in targets(model).items()}
    tensors, modules, settings = {}, set(), None
    for ours, layer in lora_layers(model).items():
        if name not in layer.adapters:
            continue
        low_rank = layer.adapters[name]
        settings = low_rank.settings
        for part, rows in low_rank.parts.items():
            full = where[(ours, rows)]
            modules.add(part_name(full))
            tensors[f"{PREFIX}{full}.lora_A.weight"] = low_rank.A[part].detach().float().cpu().contiguous()
            tensors[f"{PREFIX}{full}.lora_B.weight"] = low_rank.B[part].detach().float().cpu().contiguous()
    if settings is None:
        raise ValueError(f"no adapter named {name!r} is loaded on this model")
    config = {
        "peft_type": "LORA",
        "task_type": TASK_TYPES[model.config.arch],
        "base_model_name_or_path": base_model_name_or_path,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "use_rslora": settings.use_rslora,
        "lora_dropout": settings.dropout,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": model.config.hf_model_type == "gpt2",  # GPT-2's Conv1D: (in, out) weights
        "inference_mode": True,
    }
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
        publish_folder(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
