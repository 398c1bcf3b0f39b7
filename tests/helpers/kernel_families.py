"""One call of every family of C++ kernels (extension.KERNEL_FAMILIES), for the tests that read
which ISA's code each ran (extension.kernels_ran): the quantized products of every packing with
int8 and float activations, one x row and a prompt's 40 (the panels, AMX's tiles), and the native
decoder's prefill of a tiny float LLaMA over a q8_0 / float16 cache (the float products, the row
operations, attention and the cache's widening)."""

from __future__ import annotations

import numpy as np
import torch

import flashformer
from flashformer.generate.sampling import settings_from
from flashformer.generate.session import make_session
from flashformer.kernels.quantized import QuantizedLinear

# bytes per block and the offsets of its float16 scales (gguf's block layouts)
_BLOCKS = {"Q5_0": (22, 32, (0,)), "Q4_K": (144, 256, (0, 2)), "MXFP4": (17, 32, ())}


def _gguf_linear(type_name: str, n: int, k: int, activations: str) -> QuantizedLinear:
    nbytes, values, halves = _BLOCKS[type_name]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(n, k // values, nbytes), dtype=np.uint8)
    for at in halves:
        raw[..., at : at + 2] = np.float16(0.01 if values == 256 else 0.05).reshape(1).view(np.uint8)
    if type_name == "MXFP4":
        raw[..., 0] = 122  # the e8m0 scale byte: 2^-5
    return QuantizedLinear.from_gguf_blocks(type_name, raw.reshape(n, -1), (n, k), activations=activations)


def run_every_family() -> None:
    torch.manual_seed(0)
    x = torch.randn(40, 256)  # (M, K): 40 rows reach the panels and AMX's tiles
    weight = torch.randn(48, 256)
    for activations in ("int8", "float32"):
        layers = [
            QuantizedLinear.from_float(weight, mode, activations=activations) for mode in ("int4", "int8")
        ]
        layers += [_gguf_linear(name, 48, 256, activations) for name in _BLOCKS]
        for layer in layers:
            layer(x[:1]), layer(x)
    model = flashformer.build("llama-tiny", d_model=128, n_heads=4, n_kv_heads=2, vocab_size=97).eval()
    ids = torch.randint(3, 97, (1, 9), generator=torch.Generator().manual_seed(1))
    settings = settings_from(model, max_new_tokens=2, cache_type_k="q8_0", cache_type_v="f16")
    session = make_session(model, ids, None, settings)
    assert session.native is not None, "the tiny LLaMA runs on the native decoder"
    session.prefill()
