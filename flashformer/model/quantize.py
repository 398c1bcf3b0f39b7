"""Quantized models: a decoder's projections, token embedding and LM head as
weight-only int8 / int4 layers (kernels.quantized), for decoding on the CPU.

    model = flashformer.from_pretrained("model.gguf", quantize="gguf")   # the file's own blocks
    model = flashformer.from_pretrained("folder", quantize="int8")       # any float model, quantized here

Modes:
- "gguf": a GGUF file's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 and K-quant (Q4_K,
  Q5_K, Q6_K) tensors are used as they are (repacked or kept, never re-rounded):
  the weights multiplied are llama.cpp's, bit for bit. The K-quants are the
  file's own bytes, used in place from its memory map; the others are repacked
  (docs/models.md, "Memory-mapped weights"). Projections fused here (q/k/v,
  gate/up) run as one layer per run of a packed type, their outputs joined, and
  as one layer per K-quant part (stacking would copy them). Tensors the file
  stores otherwise (F16, F32, other K-quants) stay float32.
- "int8": symmetric int8 per output row; "int4": 4-bit groups of 32 with a
  scale and a minimum (GGUF's Q4_1), quantized from the float weights with
  llama.cpp's rounding.

What a quantized layer's input is, `activations` (ACTIVATION_SCHEMES): "int8" everywhere (each
kernel quantizes its input per block, as llama.cpp does), "float32" everywhere (exact with respect
to the quantized weights, about half the speed), "int8-float32-head": int8 but the output head's
input, or "int8-int8x2-head" (the default): int8 but the head's input int8x2, x's int8 blocks
plus their rounding error's (~15 bits; kernels/quantized.py). The head's rounding error lands on
the logits with nothing after it to dilute it (on SmolLM2 a third of the KL divergence int8
inputs cause, from one of 151 layers); a prompt runs only its last row through the head, and a
decode step's head product streams its weights at the memory's speed with two x rows as with one
(float inputs cost SmolLM2's Q8_0 head 1.6x its int8 time: docs/benchmarks.md, "Activations").

Norms, biases, learned positions and a mixture of experts' routers stay float32 (llama.cpp's
quantizer keeps the routers F32 too: a rounding could change which experts a token runs); each
expert's projections are quantized as any other layer, a GGUF file's 3-D expert tensors sliced
per expert, never dequantized. With int8 activations (either int8 scheme) the
KV cache is float16, as llama.cpp's is by default (`model.kv_cache_dtype`;
set it to None for the float32 cache that float32 activations keep). The tied LM head reads the
quantized embedding's bytes (in SmolLM2 the embedding is a fifth of the bytes
a decode step reads). A quantized model's weights do not train (integer buffers: train() refuses
it while any of its own parameters would) and saving it as a Hugging Face folder is refused; a
LoRA adapter beside its frozen layers trains (their input's gradient goes through the
dequantized weight).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from flashformer.kernels.quantized import GGUF_TYPES, ConcatenatedLinear, QuantizedEmbedding, QuantizedLinear
from flashformer.model import hf

MODES = ("int8", "int4", "gguf")
HEAD = "lm_head"
ROUTER = ".ffn.router"  # a mixture of experts' router: float32 unless a GGUF file stores it quantized


def _int8_but_the_head(head: str):
    """A scheme: every layer's input int8 but the output head's, `head`."""
    return lambda name: head if name == HEAD else "int8"


# What each quantized layer's input is, per scheme: a layer's name -> its kernel's activations
# (kernels.quantized.ACTIVATIONS). "int8-float32-head": every layer int8 but the output head (see
# docs/models.md, "Quantized decoding", for why the head).
ACTIVATION_SCHEMES = {
    "int8": lambda name: "int8",
    "float32": lambda name: "float32",
    "int8-float32-head": _int8_but_the_head("float32"),
    "int8-int8x2-head": _int8_but_the_head("int8x2"),
}
# The default: int8 as llama.cpp runs it but the head's input ~15 bits (int8x2), which on SmolLM2
# and Gemma 3 brings the KL divergence below llama.cpp's on the same file at int8's speed
# (docs/benchmarks.md, "Activations")
DEFAULT_ACTIVATIONS = "int8-int8x2-head"


def quantize(model, mode: str, checkpoint=None, activations: str = DEFAULT_ACTIVATIONS):
    """`model` with its projections, embedding and head quantized in place; returns it.

    checkpoint: the GGUFCheckpoint the model was loaded from (mode "gguf" reads its blocks).
    activations: a scheme of ACTIVATION_SCHEMES: "int8" (quantized per block of 32 inside the
    kernel, as llama.cpp does), "float32" (exact with respect to the quantized weights),
    "int8-float32-head" or "int8-int8x2-head" (the default: int8 but the head's input float32 or
    int8x2).
    """
    if mode not in MODES:
        raise ValueError(f"quantize must be one of {MODES} or None; got {mode!r}")
    if activations not in ACTIVATION_SCHEMES:
        raise ValueError(f"activations must be one of {tuple(ACTIVATION_SCHEMES)}; got {activations!r}")
    config = model.config
    if config.arch != "decoder":
        raise ValueError(
            f"quantize={mode!r}: quantized layers serve decoders (GPT-2, LLaMA); got arch {config.arch!r}"
        )
    if mode == "gguf" and checkpoint is None:
        raise ValueError(
            "quantize='gguf' uses a GGUF file's own blocks: give a .gguf file or a folder of MXFP4 experts "
            "(or quantize='int8'/'int4')"
        )
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("quantize: the model must be float32 (quantized layers take float32 activations)")
    activations_of = ACTIVATION_SCHEMES[activations]
    make = (
        _from_gguf(model, checkpoint, activations_of) if mode == "gguf" else _from_float(mode, activations_of)
    )
    embedding = make.embedding(model.embeddings.tokens, "embeddings.tokens")
    if embedding is not None:
        model.embeddings.tokens = embedding
    per_layer = getattr(model, "per_layer_inputs", None)  # Gemma 4's second table: one row a token
    if (
        per_layer is not None
        and (table := make.embedding(per_layer.tokens, "per_layer_inputs.tokens")) is not None
    ):
        per_layer.tokens = table
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and (
            name.startswith(("decoder.", "per_layer_inputs.")) or name == HEAD
        ):
            quantized = make.linear(name, module)
            if quantized is not None:
                _replace(model, name, quantized)
    if config.tie_word_embeddings and isinstance(model.embeddings.tokens, QuantizedEmbedding):
        model.lm_head = QuantizedLinear.from_embedding(model.embeddings.tokens, activations_of(HEAD))
    model.quantization = mode
    # keys and values in float16 with int8 activations (llama.cpp's default cache type): a decode
    # step of 8 rows over ~170 keys reads 64 MB of float32 cache in SmolLM2, two thirds of the
    # 97 MB of weights it reads
    model.kv_cache_dtype = None if activations == "float32" else torch.float16
    return model.eval()


def is_quantized(model) -> bool:
    return getattr(model, "quantization", None) is not None


class _from_float:
    """Quantizes float weights: every projection, the embedding and an untied head."""

    def __init__(self, mode: str, activations_of):
        self.mode, self.activations_of = mode, activations_of

    def embedding(self, embedding: nn.Embedding, name: str):
        return QuantizedEmbedding.from_float(embedding, self.mode)

    def linear(self, name: str, linear: nn.Linear):
        if name.endswith(ROUTER):  # a rounding could change which experts a token runs
            return None
        return QuantizedLinear.from_float(linear, self.mode, activations=self.activations_of(name))


class _from_gguf:
    """Takes a GGUF file's blocks where a kernel reads their type, through the Hugging Face
    family's naming rules (ours <- theirs, q/k/v stacked in one projection)."""

    def __init__(self, model, checkpoint, activations_of):
        layout = hf.family(model.config.hf_model_type)
        self.blocks = layout.strip_prefix(dict(checkpoint.quantized))  # their name -> QuantizedTensor
        self.rules = {rule.ours: rule for rule in layout.rules(model.config)}
        self.activations_of, self.source, self.kept = activations_of, checkpoint.path, set()

    def _usable(self, names) -> list | None:
        tensors = [self.blocks.get(name) for name in names]
        if all(t is not None and t.ggml_type in GGUF_TYPES for t in tensors):
            return tensors
        self.kept |= {t.ggml_type for t in tensors if t is not None and t.ggml_type not in GGUF_TYPES}
        if self.kept:
            warnings.warn(
                f"{self.source}: tensors of type {sorted(self.kept)} stay float32 (no quantized kernel reads them)",
                stacklevel=4,
            )
        return None

    def embedding(self, embedding: nn.Embedding, name: str):
        tensors = self._usable(self.rules[f"{name}.weight"].theirs)
        if tensors is None:
            return None
        (t,) = tensors
        return QuantizedEmbedding.from_gguf_blocks(t.ggml_type, t.blocks, t.shape)

    def linear(self, name: str, linear: nn.Linear):
        rule = self.rules[f"{name}.weight"]
        tensors = self._usable(rule.theirs)
        if tensors is None:
            return None
        bias, activations = linear.bias, self.activations_of(name)
        parts = [
            QuantizedLinear.from_gguf_blocks(t.ggml_type, t.blocks, t.shape, activations=activations)
            for t in tensors
        ]
        merged = parts[0] if len(parts) == 1 else QuantizedLinear.cat(parts)
        if bias is not None:
            bias = bias.detach().float()
            if isinstance(merged, ConcatenatedLinear):  # each part its slice (the native decoder's form)
                sizes = [part.out_features for part in merged.parts]
                for part, piece in zip(merged.parts, bias.split(sizes)):
                    part.bias = piece.contiguous()
            else:
                merged.bias = bias.contiguous()
        return merged


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)
