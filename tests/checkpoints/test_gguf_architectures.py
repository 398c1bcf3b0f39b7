"""GGUF architectures beside llama and gpt2: qwen2, phi3, and llama files carrying Llama 3's
per-frequency RoPE divisors (rope_freqs.weight).

Tiny random transformers models are written as all-F32 GGUF files the way llama.cpp's converter
writes them; flashformer's model of each file must give the logits of transformers' GGUF load of
the same file, and of the model the file was written from. transformers' GGUF loader reads
neither phi3's rope.dimension_count nor rope_freqs.weight, so for those two the config it cannot
read is passed to it (the file's weights still come from its own reader)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from helpers.gguf import (
    LLAMA3_ROPE,
    cycle_types,
    llama3_rope_freqs,
    llama_metadata,
    llama_tensors,
    phi3_metadata,
    phi3_tensors,
    qwen2_metadata,
    qwen2_tensors,
    tiny_llama3,
    tiny_phi3,
    tiny_qwen2,
    write_gguf,
)

import flashformer
from flashformer.checkpoints.gguf import GGUFError, read_gguf
from flashformer.checkpoints.gguf.rope_freqs import llama3_rope_parameters


def llama3_tensors(model, types):
    """A Llama 3.1-style file: llama's tensors and the converter's rope_freqs.weight."""
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    return dict(
        llama_tensors(model, types),
        **{"rope_freqs.weight": (llama3_rope_freqs(LLAMA3_ROPE, head_dim), "F32")},
    )


def _phi3_rotary(config):
    config.rope_parameters["partial_rotary_factor"] = 0.75


def _llama3_rope(config):
    config.rope_parameters = dict(LLAMA3_ROPE)


# name: (the transformers model, its GGUF metadata, its GGUF tensors, what transformers' GGUF config lacks)
CASES = {
    "qwen2": (tiny_qwen2, qwen2_metadata, qwen2_tensors, None),
    "qwen2_untied": (functools.partial(tiny_qwen2, tie=False), qwen2_metadata, qwen2_tensors, None),
    "phi3": (tiny_phi3, phi3_metadata, phi3_tensors, None),
    "phi3_partial_rotary": (
        functools.partial(tiny_phi3, 0.75, tie=True),
        phi3_metadata,
        phi3_tensors,
        _phi3_rotary,
    ),
    "llama_rope_freqs": (tiny_llama3, llama_metadata, llama3_tensors, _llama3_rope),
}
F32 = cycle_types("F32")


@functools.cache
def _case(name: str, root):
    from transformers import AutoConfig, AutoModelForCausalLM

    build, metadata, tensors, fix_config = CASES[name]
    model = build()
    path = write_gguf(root / f"{name}.gguf", name.split("_")[0], metadata(model), tensors(model, F32))
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    if fix_config is not None:
        fix_config(config)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config).eval()
    return path, model, theirs


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_architectures")
    return lambda name: _case(name, root)


def _inputs(length: int = 40) -> torch.Tensor:
    """Past phi3's window (8) and llama3's original context (64 / 4 = 16: the kept waves)."""
    return torch.randint(0, 275, (2, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_equal_transformers_gguf_load(case, name):
    path, original, theirs = case(name)
    ours = flashformer.from_pretrained(path, quantize=None)
    ids = _inputs()
    with torch.no_grad():
        expected = theirs(ids).logits
        assert (ours(ids).logits - expected).abs().max() < 1e-4
        assert (original(ids).logits - expected).abs().max() < 1e-4  # the file is the model it came from
    assert expected.abs().max() > 0.1


@pytest.mark.parametrize("name", sorted(CASES))
def test_tensors_equal_transformers_gguf_load(case, name):
    path, _, theirs = case(name)
    checkpoint = read_gguf(path, show_progress=False)
    state = theirs.state_dict()
    tied = checkpoint.config["tie_word_embeddings"]
    assert set(state) - set(checkpoint.tensors) == ({"lm_head.weight"} if tied else set())
    for hf_name, tensor in checkpoint.tensors.items():
        assert torch.equal(tensor, state[hf_name]), hf_name


@pytest.mark.parametrize("name", sorted(CASES))
def test_checkpoint_saves_as_the_transformers_model(case, name, tmp_path):
    """The config.json written for the file (partial rotary, llama3 rope scaling recovered from
    rope_freqs.weight) makes transformers compute what the original model computes."""
    from transformers import AutoModelForCausalLM

    path, original, _ = case(name)
    read_gguf(path, show_progress=False).save_pretrained(tmp_path)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = _inputs()
    with torch.no_grad():
        assert (saved(ids).logits - original(ids).logits).abs().max() < 1e-4


def test_transformers_gguf_loader_ignores_what_flashformer_reads(case):
    """Why the reference gets its config passed: without it, transformers computes full rotary
    for phi3 and unscaled RoPE for Llama 3 files, both visibly different."""
    from transformers import AutoModelForCausalLM

    for name in ("phi3_partial_rotary", "llama_rope_freqs"):
        path, original, _ = case(name)
        plain = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
        with torch.no_grad():
            assert (plain(_inputs()).logits - original(_inputs()).logits).abs().max() > 1e-3, name


def test_llama3_parameters_are_recovered_from_the_divisors(case):
    path, _, _ = case("llama_rope_freqs")
    rope = read_gguf(path, show_progress=False).config["rope_parameters"]
    assert rope == LLAMA3_ROPE
    ours = flashformer.from_pretrained(path).config.rope_scaling
    assert (ours.kind, ours.factor, ours.high_freq_factor, ours.original_max_seq_len) == (
        "llama3",
        8.0,
        4.0,
        64,
    )


def test_qwen2_and_phi3_configs(case):
    qwen2 = flashformer.from_pretrained(case("qwen2")[0]).config
    assert (qwen2.attention_bias, qwen2.attention_out_bias, qwen2.tie_word_embeddings) == (True, False, True)
    phi3 = flashformer.from_pretrained(case("phi3_partial_rotary")[0]).config
    assert (phi3.rotary_fraction, phi3.fused_gate_up, phi3.head_dim) == (0.75, True, 16)


# ---- refused by name ----


@pytest.fixture(scope="module")
def parts():
    """Metadata and tensors of valid qwen2, phi3 and Llama 3 files, to damage one thing at a time."""
    qwen2, phi3, llama3 = tiny_qwen2(), tiny_phi3(), tiny_llama3()
    return {
        "qwen2": (qwen2_metadata(qwen2), qwen2_tensors(qwen2, F32)),
        "phi3": (phi3_metadata(phi3), phi3_tensors(phi3, F32)),
        "llama": (llama_metadata(llama3), llama3_tensors(llama3, F32)),
    }


def _read(tmp_path, arch, metadata, tensors):
    return read_gguf(write_gguf(tmp_path / "bad.gguf", arch, metadata, tensors), show_progress=False)


def test_qwen2_key_not_read_is_refused(parts, tmp_path):
    metadata, tensors = parts["qwen2"]
    with pytest.raises(
        GGUFError, match=r"bad\.gguf: metadata qwen2\.rope\.scaling\.type='yarn' is not supported"
    ):
        _read(tmp_path, "qwen2", dict(metadata, **{"qwen2.rope.scaling.type": "yarn"}), tensors)


def test_qwen2_without_its_q_bias_is_refused(parts, tmp_path):
    metadata, tensors = parts["qwen2"]
    tensors = {name: value for name, value in tensors.items() if name != "blk.1.attn_q.bias"}
    with pytest.raises(GGUFError, match=r"bad\.gguf: tensor 'blk\.1\.attn_q\.bias' is missing"):
        _read(tmp_path, "qwen2", metadata, tensors)


def test_phi3_longrope_that_cannot_be_read_is_refused(parts, tmp_path):
    """LongRoPE itself is read (tests/checkpoints/test_gguf_phi4_mini.py): half of it is not."""
    metadata, tensors = parts["phi3"]
    long = {"rope_factors_long.weight": (np.ones(8, np.float32), "F32")}
    with pytest.raises(GGUFError, match=r"bad\.gguf: tensor 'rope_factors_long\.weight' without its pair"):
        _read(tmp_path, "phi3", metadata, dict(tensors, **long))
    with pytest.raises(
        GGUFError, match=r"phi3\.rope\.scaling\.attn_factor without the LongRoPE factor tensors"
    ):
        _read(tmp_path, "phi3", dict(metadata, **{"phi3.rope.scaling.attn_factor": 1.19}), tensors)
    odd = {
        name: (np.ones(7, np.float32), "F32")
        for name in ("rope_factors_long.weight", "rope_factors_short.weight")
    }
    with pytest.raises(GGUFError, match=r"'rope_factors_short\.weight' has shape \(7,\); .* implies \(8,\)"):
        _read(tmp_path, "phi3", metadata, dict(tensors, **odd))


def test_phi3_odd_rotary_dimension_is_refused(parts, tmp_path):
    metadata, tensors = parts["phi3"]
    with pytest.raises(GGUFError, match=r"phi3\.rope\.dimension_count=7 is not supported"):
        _read(tmp_path, "phi3", dict(metadata, **{"phi3.rope.dimension_count": 7}), tensors)


def test_rope_freqs_llama3_cannot_express_is_refused(parts, tmp_path):
    metadata, tensors = parts["llama"]
    divisors = np.linspace(1.0, 3.0, 16, dtype=np.float32)[::-1].copy()  # falls where Llama 3's rises
    with pytest.raises(
        GGUFError, match=r"bad\.gguf: tensor 'rope_freqs\.weight' holds per-frequency RoPE divisors"
    ):
        _read(tmp_path, "llama", metadata, dict(tensors, **{"rope_freqs.weight": (divisors, "F32")}))


def test_rope_freqs_of_ones_is_plain_rope(parts, tmp_path):
    metadata, tensors = parts["llama"]
    ones = {"rope_freqs.weight": (np.ones(16, np.float32), "F32")}
    assert (
        _read(tmp_path, "llama", metadata, dict(tensors, **ones)).config["rope_parameters"]["rope_type"]
        == "default"
    )


@pytest.mark.parametrize(
    "head_dim, theta, factor",
    [(128, 500000.0, 8.0), (64, 500000.0, 32.0)],  # Llama 3.1 8B, Llama 3.2 1B
    ids=["llama-3.1-8b", "llama-3.2-1b"],
)
def test_real_llama3_shapes_recover_their_rope_parameters(head_dim, theta, factor):
    rope = dict(
        LLAMA3_ROPE,
        rope_theta=theta,
        factor=factor,
        original_max_position_embeddings=8192,
    )
    divisors = torch.from_numpy(llama3_rope_freqs(rope, head_dim))
    recovered = llama3_rope_parameters(divisors, head_dim, theta, "test.gguf")
    assert recovered == {k: v for k, v in rope.items() if k != "rope_theta"}


@pytest.mark.parametrize("name", ["qwen2_untied", "phi3_partial_rotary"])
def test_gguf_blocks_run_in_place(name, tmp_path):
    """quantize="gguf" takes Q8_0 blocks through the families' rules: q/k/v with qwen2's biases,
    phi3's fused qkv and gate_up; with float32 activations it is the dequantized model."""
    build, metadata, tensors, _ = CASES[name]
    model = build()
    path = write_gguf(
        tmp_path / f"{name}.gguf", name.split("_")[0], metadata(model), tensors(model, cycle_types("Q8_0"))
    )
    dequantized = flashformer.from_pretrained(path, quantize=None)
    blocks = flashformer.from_pretrained(path, quantize="gguf", activations="float32")
    assert type(blocks.decoder.blocks[0].attn.qkv).__name__ == "QuantizedLinear"
    with torch.no_grad():
        assert (blocks(_inputs()).logits - dequantized(_inputs()).logits).abs().max() < 1e-5
