"""GGUF files of the qwen3, gemma, gemma2 and gemma3 architectures (checkpoints.gguf.qwen3 and
.gemma) on the float path.

Small files are written here from random transformers models the way llama.cpp's converter
writes them (F32 tensors, gemma's norms as 1 + w, no q/k row permutation); the reference is
transformers' own GGUF loader reading the same file (qwen3, gemma2, gemma3; it reads no gemma 1
file, so there the transformers model the file was written from). Then the real Gemma 3 270M
Q4_K_M file, end to end (slow). Keys or tensors that would change the computation and are not
implemented must be refused with GGUFError naming them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.gguf import (
    gemma3_path,
    new_decoder_metadata,
    new_decoder_tensors,
    tiny_new_decoder,
    transformers_gguf_overrides,
    write_gguf,
)

import flashformer
from flashformer.checkpoints.gguf import GGUFError, read_gguf

# the file cannot say query_pre_attn_scalar: llama.cpp scales by 1/sqrt(head_dim) below 27B
GGUF_OVERRIDES = {
    "qwen3": {},
    "gemma": {},
    "gemma2": {"query_pre_attn_scalar": 32},
    "gemma3": {"query_pre_attn_scalar": 32},
}


def write_tiny(tmp_path, arch: str, metadata_changes: dict | None = None, tensor_changes: dict | None = None):
    """(the transformers model, the GGUF file written from it)."""
    model = tiny_new_decoder(arch, **GGUF_OVERRIDES[arch])
    metadata = {**new_decoder_metadata(model, arch), **(metadata_changes or {})}
    tensors = {**new_decoder_tensors(model, arch), **(tensor_changes or {})}
    return model, write_gguf(tmp_path / f"{arch}.gguf", arch, metadata, tensors)


def their_gguf_model(path, model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, attn_implementation="eager", **transformers_gguf_overrides(model)
    ).eval()


@pytest.mark.parametrize("arch", ["qwen3", "gemma", "gemma2", "gemma3"])
def test_logits_equal_transformers(tmp_path, arch):
    model, path = write_tiny(tmp_path, arch)
    reference = model if arch == "gemma" else their_gguf_model(path, model)
    ours = flashformer.from_pretrained(path, quantize=None)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = reference(ids).logits, ours(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


def test_gemma_norms_are_read_as_transformers_weights(tmp_path):
    """The file's 1 + w comes back as w under transformers' names, as its GGUF loader gives it."""
    model, path = write_tiny(tmp_path, "gemma3")
    checkpoint = read_gguf(path, show_progress=False)
    for name in (
        "model.norm.weight",
        "model.layers.1.post_feedforward_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
    ):
        torch.testing.assert_close(checkpoint.tensors[name], model.state_dict()[name], atol=1e-6, rtol=0)
    assert checkpoint.config["layer_types"] == model.config.layer_types
    assert checkpoint.config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0


def test_gemma3_layer_pattern_default_and_flags(tmp_path):
    """Without attention.sliding_window_pattern, llama.cpp's period of 6 (layers 0-4 slide);
    a list of flags gives each layer's own."""
    model = tiny_new_decoder("gemma3", **GGUF_OVERRIDES["gemma3"])
    metadata = new_decoder_metadata(model, "gemma3")
    del metadata["gemma3.attention.sliding_window_pattern"]
    path = write_gguf(tmp_path / "default.gguf", "gemma3", metadata, new_decoder_tensors(model, "gemma3"))
    assert read_gguf(path, show_progress=False).config["layer_types"] == ["sliding_attention"] * 5 + [
        "full_attention"
    ]
    flags = [True, False, False, True, True, False]
    metadata["gemma3.attention.sliding_window_pattern"] = flags
    path = write_gguf(tmp_path / "flags.gguf", "gemma3", metadata, new_decoder_tensors(model, "gemma3"))
    assert [
        t == "sliding_attention" for t in read_gguf(path, show_progress=False).config["layer_types"]
    ] == flags


def test_gemma3_linear_rope_scaling_is_on_the_full_layers_only(tmp_path):
    _, path = write_tiny(
        tmp_path, "gemma3", {"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
    )
    config = flashformer.from_pretrained(path).config
    assert config.rope_scaling.kind == "linear" and config.rope_scaling.factor == 8.0
    assert config.rope_theta == 1e6 and config.rope_local_theta == 10000.0


@pytest.mark.parametrize(
    "arch, changes, named",
    [
        ("gemma3", {"gemma3.attn_logit_softcapping": 50.0}, "gemma3.attn_logit_softcapping"),
        ("gemma3", {"gemma3.rope.scaling.type": "yarn"}, "gemma3.rope.scaling.type='yarn'"),
        (
            "gemma2",
            {"gemma2.rope.scaling.type": "linear", "gemma2.rope.scaling.factor": 2.0},
            "gemma2.rope.scaling",
        ),
        ("gemma", {"gemma.attention.sliding_window": 8}, "gemma.attention.sliding_window"),
        ("qwen3", {"qwen3.rope.dimension_count": 16}, "qwen3.rope.dimension_count=16"),
        ("qwen3", {"qwen3.expert_count": 8}, "qwen3.expert_count=8"),
        (
            "gemma3",
            {"gemma3.attention.sliding_window_pattern": [True, False]},
            "gemma3.attention.sliding_window_pattern",
        ),
    ],
)
def test_keys_that_change_the_computation_are_refused_by_name(tmp_path, arch, changes, named):
    _, path = write_tiny(tmp_path, arch, changes)
    with pytest.raises(GGUFError, match=named.replace("[", r"\[").replace("(", r"\(")) as error:
        read_gguf(path, show_progress=False)
    assert str(path) in str(error.value)


def test_tensors_the_model_has_no_place_for_are_refused(tmp_path):
    """A q bias in a qwen3 file, a quantized gemma norm: named, never ignored or misread."""
    bias = (np.zeros(128, dtype=np.float32), "F32")
    _, path = write_tiny(tmp_path, "qwen3", tensor_changes={"blk.0.attn_q.bias": bias})
    with pytest.raises(GGUFError, match="blk.0.attn_q.bias"):
        read_gguf(path, show_progress=False)
    model = tiny_new_decoder("gemma2")
    tensors = new_decoder_tensors(model, "gemma2")
    tensors["output_norm.weight"] = (np.ones(64, dtype=np.float32), "Q8_0")
    path = write_gguf(tmp_path / "bad.gguf", "gemma2", new_decoder_metadata(model, "gemma2"), tensors)
    with pytest.raises(GGUFError, match="'output_norm.weight' is stored as Q8_0"):
        read_gguf(path, show_progress=False)


# ---- the real Gemma 3 270M file ----


@pytest.mark.slow
def test_real_gemma3_greedy_continuation_equals_transformers():
    """flashformer.load on the Q4_K_M file (float path: gguf's dequantized weights, as
    transformers reads them) against transformers' GGUF load of the same file, prompt tokenized
    by transformers' tokenizer of the file. Logits within 1e-5 of the largest logit's magnitude
    (about 2e-4 here): float32 carries 24 bits, so 18 layers of sums of 640-2048 terms taken in
    another order differ by some 1e-6 relative (3e-5 absolute measured), and the gap between the
    two best tokens of a step is orders of magnitude larger; then 16 greedy tokens equal."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gemma3_path()
    model, _ = flashformer.load(path, quantize=None)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    theirs = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        expected, got = theirs(ids).logits, model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5 * expected.abs().max().item(), rtol=0)
    ours = model.generate(ids, max_new_tokens=16, do_sample=False)
    reference = theirs.generate(ids, max_new_tokens=16, do_sample=False)
    assert ours.tolist() == reference.tolist()
