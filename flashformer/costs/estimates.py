"""One model's costs from the formulas, in one Estimate: estimate() gathers flops.py's FLOPs,
memory.py's bytes and traffic.py's HBM traffic for a (model, n, c, B), and resolve_config turns
what a user names (a ModelConfig, a preset, a config file or folder) into a ModelConfig."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashformer.costs import flops as _flops
from flashformer.costs import memory as _memory
from flashformer.costs import traffic as _traffic
from flashformer.costs.flops import GROUPS, Pass, component_group
from flashformer.costs.memory import Saved, attention_peak_bytes, parameter_count
from flashformer.model import hf
from flashformer.model.config import RECURRENT_ARCHS, ModelConfig
from flashformer.model.presets import PRESETS, preset

BACKENDS = ("eager", "flash")


@dataclass
class Estimate:
    """The figures of one (model, n, c, B). FLOPs are those of the whole batch;
    bytes too. `attention` is the causal convention of the FLOPs (flops.py)."""

    config: ModelConfig
    seq_len: int
    cache_len: int
    batch: int
    decoder_len: int  # T5's decoder tokens (its encoder reads seq_len); = seq_len otherwise
    attention: str
    dtype: torch.dtype
    sram_bytes: int

    layer_flops: dict[str, dict[str, int]]  # stack kind ("encoder", "decoder") -> one layer's components
    flops: dict[str, int]  # the whole model's forward, per component
    forward_flops: int
    backward_flops: int
    recomputed_flops: int  # activation checkpointing's second forward of the blocks
    train_step_flops: int  # forward + backward + recomputed
    decode_step_flops: int | None  # one new token after cache_len cached ones; None for an encoder
    decode_flops: dict[str, int]

    parameters: int
    weight_bytes: int
    gradient_bytes: int
    optimizer_bytes: int  # AdamW's two moments, in the parameters' dtype
    kv_cache_bytes: int  # a cache of cache_len positions (+ T5's cross-attention cache); 0 without
    kv_cache_self_bytes: int
    kv_cache_cross_bytes: int
    activations: dict[str, Saved] = field(default_factory=dict)  # backend -> kept for the backward
    attention_peak: dict[str, dict[str, int]] = field(default_factory=dict)  # one call's peak
    hbm_traffic_bytes: dict[str, int] = field(default_factory=dict)  # one forward's attention

    @property
    def activation_bytes(self) -> dict[str, int]:
        return {backend: saved.total for backend, saved in self.activations.items()}

    @property
    def train_memory_bytes(self) -> dict[str, int]:
        """Weights + gradients + optimizer state + activations, per attention backend."""
        fixed = self.weight_bytes + self.gradient_bytes + self.optimizer_bytes
        return {backend: fixed + saved.total for backend, saved in self.activations.items()}

    def grouped_flops(self) -> dict[str, int]:
        """The forward FLOPs in four groups: projections, attention, feed-forward, embeddings and head."""
        groups = dict.fromkeys(GROUPS, 0)
        for name, value in self.flops.items():
            groups[component_group(name)] += value
        return groups


def estimate(
    config_or_preset,
    seq_len: int,
    cache_len: int = 0,
    batch: int = 1,
    *,
    decoder_len: int | None = None,
    attention: str = "flash",
    dtype="float32",
    sram_bytes: int = 192 * 1024,
) -> Estimate:
    """FLOPs, memory and memory traffic of a model, from the formulas.

    config_or_preset: a ModelConfig, a preset name, or a config file / checkpoint folder.
    seq_len: n tokens in the forward pass (T5: the encoder's input).
    cache_len: c tokens in the KV cache before them (decoders); the KV cache
        figure is that of a cache holding c positions.
    decoder_len: T5's decoder tokens (default: seq_len).
    attention: the causal convention of the attention FLOPs, "flash", "eager" or "exact".
    dtype: of weights, gradients, optimizer state, activations and cache.
    sram_bytes: the on-chip memory M of the IO model (default 192 KiB, an A100 SM's).
    """
    config = resolve_config(config_or_preset)
    if "conv" in (config.layer_types or ()):
        raise ValueError(
            "estimate() holds the exact-attention Transformer's formulas; a model with conv layers "
            "(LFM2's short convolutions, layer_types 'conv') has its own in flashformer.costs.alternatives"
        )
    if config.arch in RECURRENT_ARCHS or config.attention_kind == "linear":
        raise ValueError(
            f"estimate() holds the exact-attention Transformer's formulas; a {config.arch!r} model with "
            f"attention_kind={config.attention_kind!r} has its own in flashformer.costs.alternatives"
        )
    _positive("seq_len", seq_len)
    _positive("cache_len", cache_len, minimum=0)
    _positive("batch", batch)
    _positive("sram_bytes", sram_bytes)
    _flops.check_convention(attention)
    dtype = _dtype(dtype)
    element = torch.empty((), dtype=dtype).element_size()
    if decoder_len is not None and config.arch != "encoder-decoder":
        raise ValueError(f"decoder_len is for encoder-decoder models; this one is an {config.arch!r}")
    if cache_len and config.arch == "encoder":
        raise ValueError(f"an encoder keeps no KV cache; got cache_len={cache_len}")
    dec_len = seq_len if decoder_len is None else _positive("decoder_len", decoder_len)
    p = Pass(batch, seq_len, cache_len, dec_len, attention)

    layer, flops = _flops.forward_flops(config, p)
    forward = sum(flops.values())
    backward = _flops.backward_flops(config, p, flops)
    recomputed = _flops.recomputed_flops(config, p, flops)
    decode = _flops.decode_step_flops(config, batch, cache_len, seq_len) if config.arch != "encoder" else {}

    parameters = parameter_count(config)
    self_cache, cross_cache = _memory.kv_cache_bytes(config, batch, cache_len, seq_len, element)
    s = _flops.Shapes.of(config)
    _, _, q_len, k_len, causal = _flops.attention_calls(config, p)[0]
    peak = {
        backend: {
            mode: attention_peak_bytes(
                backend,
                batch,
                s.heads,
                q_len,
                k_len,
                s.head_dim,
                kv_heads=s.kv_heads,
                causal=causal,
                train=train,
            )
            for mode, train in (("forward", False), ("train", True))
        }
        for backend in BACKENDS
    }
    return Estimate(
        config=config,
        seq_len=seq_len,
        cache_len=cache_len,
        batch=batch,
        decoder_len=dec_len,
        attention=attention,
        dtype=dtype,
        sram_bytes=sram_bytes,
        layer_flops=layer,
        flops=flops,
        forward_flops=forward,
        backward_flops=backward,
        recomputed_flops=recomputed,
        train_step_flops=forward + backward + recomputed,
        decode_step_flops=sum(decode.values()) if decode else None,
        decode_flops=decode,
        parameters=parameters,
        weight_bytes=parameters * element,
        gradient_bytes=parameters * element,
        optimizer_bytes=2 * parameters * element,
        kv_cache_bytes=self_cache + cross_cache,
        kv_cache_self_bytes=self_cache,
        kv_cache_cross_bytes=cross_cache,
        activations={backend: _memory.activation_bytes(config, p, backend, element) for backend in BACKENDS},
        attention_peak=peak,
        hbm_traffic_bytes=_traffic.model_attention_traffic(config, p, sram_bytes, element),
    )


# ---- inputs ----


def resolve_config(config_or_preset) -> ModelConfig:
    """A ModelConfig from a ModelConfig, a preset name, a config file (YAML or
    JSON with a `model:` section, as `flashformer train` reads; a checkpoint's
    config.json; a Hugging Face config.json) or a folder holding config.json."""
    if isinstance(config_or_preset, ModelConfig):
        return config_or_preset
    if not isinstance(config_or_preset, str | Path):
        raise TypeError(
            "config_or_preset must be a ModelConfig, a preset name or a path; "
            f"got {type(config_or_preset).__name__}"
        )
    if str(config_or_preset) in PRESETS:
        return preset(str(config_or_preset))
    path = Path(config_or_preset)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"config_or_preset {str(config_or_preset)!r} is neither a preset {sorted(PRESETS)} "
            "nor a config file or folder"
        )
    text = path.read_text()
    if path.suffix == ".json":
        values = json.loads(text)
    else:
        import yaml

        values = yaml.safe_load(text) or {}
    if isinstance(values.get("model"), dict):
        fields = dict(values["model"])
        name = fields.pop("preset", None)
        return preset(name, **fields) if name else ModelConfig.from_dict(fields)
    if "model_type" in values:
        return hf.config_from_hf(values, path.parent)
    raise ValueError(f"{path}: expected a 'model' section or a Hugging Face 'model_type'")


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"dtype must be a torch.dtype or its name (e.g. 'float32'); got {dtype!r}")


def _positive(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")
    return value
