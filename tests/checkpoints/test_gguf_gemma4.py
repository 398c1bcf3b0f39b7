"""GGUF files of the gemma4 architecture (checkpoints.gguf.gemma4.Gemma4): two head widths,
proportional RoPE as rope_freqs divisors, per-layer inputs, KV-shared layers with double-wide
feed-forwards, float and quantized.

Files written here with the converter's names and keys (tests/helpers/gemma4.py) run without
llama.cpp; where a llama.cpp tree and build are at hand, its own converter, quantizer and
llama-perplexity make and judge the files: float logits equal transformers' within 1e-4 of the
largest logit, and the Q8_0 and Q4_K_M files' KL divergence from the float model (over
llama-perplexity's own base logits of the F32 file) is within twice llama.cpp's own on the same
file."""

from __future__ import annotations

import re
import subprocess
import types

import pytest
import torch
from helpers import relative_error
from helpers.gemma4 import (
    convert,
    gemma4_folder,
    gemma4_metadata,
    gemma4_tensors,
    llama_cpp_binary,
    llama_cpp_tree,
    tiny_gemma4,
)
from helpers.gguf import write_gguf
from transformers import AutoTokenizer

import flashformer
from flashformer.checkpoints.gguf import GGUFError
from flashformer.eval.base_logits import read_base_logits
from flashformer.eval.kld import kl_divergence


def ids(model, length: int = 24) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("weight_type", ["F32", "F16"])
def test_float_logits_equal_transformers(tmp_path, weight_type):
    reference = tiny_gemma4()
    if weight_type == "F16":  # the file's rounding is the reference's too
        with torch.no_grad():
            for parameter in reference.parameters():
                parameter.copy_(parameter.half().float())
    tensors = gemma4_tensors(reference, weight_type)
    path = write_gguf(tmp_path / "g.gguf", "gemma4", gemma4_metadata(reference), tensors)
    ours = flashformer.from_pretrained(path, quantize=None)
    assert ours.config.global_head_dim == 512 and ours.config.rotary_fraction == 0.25
    with torch.no_grad():
        assert relative_error(ours(ids(reference)).logits, reference(ids(reference)).logits) < 1e-4


def test_kv_sharing_llama_cpp_would_read_otherwise_is_refused(tmp_path):
    """Layers s, s, f, s | s, f: llama.cpp's layer 4 (sliding) would read layer 2 (full)."""
    reference = tiny_gemma4(layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)
    path = write_gguf(tmp_path / "g.gguf", "gemma4", gemma4_metadata(reference), gemma4_tensors(reference))
    with pytest.raises(
        GGUFError,
        match=r"layer 4 \(sliding_attention\) reads the keys and values of layer 2 in llama.cpp but of layer 3",
    ):
        flashformer.from_pretrained(path, quantize=None)


def test_rope_divisors_other_than_proportional_ropes_are_refused(tmp_path):
    reference = tiny_gemma4()
    tensors = gemma4_tensors(reference)
    tensors["rope_freqs.weight"] = (tensors["rope_freqs.weight"][0] * 0 + 2.0, "F32")
    path = write_gguf(tmp_path / "g.gguf", "gemma4", gemma4_metadata(reference), tensors)
    with pytest.raises(GGUFError, match="rope_freqs.weight' holds divisors other than proportional"):
        flashformer.from_pretrained(path, quantize=None)


# ---- llama.cpp's own converter, quantizer and llama-perplexity ----

BINARIES = ("llama-quantize", "llama-perplexity")
needs_llama_cpp = pytest.mark.skipif(
    llama_cpp_tree() is None or any(llama_cpp_binary(b) is None for b in BINARIES),
    reason="no llama.cpp tree with the gemma4 converter and a build with llama-quantize and llama-perplexity",
)


def perplexity(model_path, *options) -> str:
    """llama-perplexity's output; its closing statistics are sometimes lost (its logger exits
    first): run again, up to 5 times."""
    for _ in range(5):
        command = [str(llama_cpp_binary("llama-perplexity")), "-m", str(model_path), "-c", "32", "-b", "32"]
        done = subprocess.run([*command, "-t", "2", *options], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        output = done.stdout + done.stderr
        if "--kl-divergence" not in options or re.search(r"Mean +KLD:", output):
            return output
    raise AssertionError(f"llama-perplexity printed no KLD: {output[-2000:]}")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(folder, transformers model, the converter's F32 file)."""
    folder = tmp_path_factory.mktemp("gemma4")
    model = gemma4_folder(folder / "hf")
    return folder, model, convert(folder / "hf", folder / "f32.gguf")


@pytest.fixture(scope="module")
def base_logits(converted):
    """llama-perplexity's base logits of the F32 file (chunks of 32 tokens of a short text)."""
    folder, _, f32 = converted
    text = folder / "text.txt"
    text.write_text(TEXT)
    perplexity(f32, "-f", str(text), "--kl-divergence-base", str(folder / "base.kld"))
    return folder / "base.kld"


WORDS = "the quick brown fox jumps over the lazy dog in the garden where there are trees. Ünï 日本".split()
TEXT = " ".join(WORDS[(7 * i) % len(WORDS)] + "\n" * (i % 13 == 0) * (1 + i % 3) for i in range(160))


@needs_llama_cpp
def test_the_files_tokenizer_encodes_as_transformers_does(converted):
    folder, _, f32 = converted
    ours = flashformer.load(f32)[1]
    theirs = AutoTokenizer.from_pretrained(folder / "hf")
    assert ours.encode(TEXT) == [2, *theirs.encode(TEXT, add_special_tokens=False)]  # the file adds BOS
    assert ours.decode(ours.encode(TEXT), skip_special_tokens=True) == TEXT


@needs_llama_cpp
@pytest.mark.slow
def test_the_files_tokenizer_encodes_as_llama_cpp_does(converted, base_logits):
    tokens = read_base_logits(base_logits).tokens.reshape(-1).tolist()  # llama-perplexity's
    assert flashformer.load(converted[2])[1].encode(TEXT)[: len(tokens)] == tokens


@needs_llama_cpp
def test_the_converters_file_gives_transformers_logits(converted):
    _, model, f32 = converted
    ours = flashformer.from_pretrained(f32, quantize=None)
    assert ours.config.layer_d_ff == (96,) * 4 + (192,) * 2 and ours.config.kv_shared_layers == 2
    with torch.no_grad():
        assert relative_error(ours(ids(model)).logits, model(ids(model)).logits) < 1e-4
        prompt = ids(model, 6)[:1]
        theirs = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert ours.generate(prompt, max_new_tokens=12, do_sample=False)[0].tolist() == theirs[0].tolist()


@needs_llama_cpp
@pytest.mark.slow
@pytest.mark.parametrize("mix", ["Q8_0", "Q4_K_M"])
def test_quantized_files_are_within_twice_llama_cpps_own_divergence(converted, base_logits, mix):
    folder, _, f32 = converted
    base_path = base_logits
    quantized = folder / f"{mix}.gguf"
    done = subprocess.run(
        [str(llama_cpp_binary("llama-quantize")), str(f32), str(quantized), mix, "2"], capture_output=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = float(
        re.search(r"Mean +KLD: +(-?[\d.]+)", perplexity(quantized, "--kl-divergence-base", str(base_path),
                                                          "--kl-divergence")).group(1)
    )  # fmt: skip
    base = read_base_logits(base_path)
    tokenizer = types.SimpleNamespace(bos_token_id=2, add_bos_token=True)  # llama-perplexity's BOS per chunk
    float_kld = kl_divergence(flashformer.from_pretrained(f32, quantize=None), tokenizer, base).kld.mean()
    ours = kl_divergence(flashformer.from_pretrained(quantized), tokenizer, base).kld.mean()
    print(f"{mix}: KLD ours {ours:.6f}, llama.cpp {theirs:.6f}; float {float_kld:.2e}")
    assert float_kld < 1e-4  # llama.cpp's float model is ours (the base file keeps 16 bits)
    assert 0 < ours <= 2 * theirs


def test_quantized_per_layer_table_and_projections_run_on_their_blocks(tmp_path):
    """Q8_0 wherever a row splits into blocks of 32 (the per-layer table of 6 x 16 columns too):
    those layers hold the file's blocks, and with float32 activations the logits are the float
    load's (the same dequantized weights) within float32 rounding."""
    from flashformer.kernels.quantized import QuantizedEmbedding, QuantizedLinear

    reference = tiny_gemma4(hidden_size_per_layer_input=16)
    tensors = {
        name: (values, "Q8_0" if values.ndim == 2 and values.shape[1] % 32 == 0 else "F32")
        for name, (values, _) in gemma4_tensors(reference).items()
    }
    path = write_gguf(tmp_path / "q8.gguf", "gemma4", gemma4_metadata(reference), tensors)
    floats = flashformer.from_pretrained(path, quantize=None)
    blocks = flashformer.from_pretrained(path, activations="float32")  # quantize="gguf": the default
    assert isinstance(blocks.per_layer_inputs.tokens, QuantizedEmbedding)
    assert isinstance(blocks.per_layer_inputs.projection, QuantizedLinear)
    assert isinstance(blocks.decoder.blocks[5].per_layer.gate, QuantizedLinear)
    with torch.no_grad():
        assert relative_error(blocks(ids(reference)).logits, floats(ids(reference)).logits) < 1e-4
