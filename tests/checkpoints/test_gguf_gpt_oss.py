"""GGUF files of the gpt-oss architecture (checkpoints.gguf.gpt_oss.GptOss): sinks, biases,
sliding and full layers, YaRN, the router's bias and the 3-D expert tensors with their biases,
float and quantized.

The files are written here from a random transformers GptOssForCausalLM with llama.cpp's
converter's tensor names and metadata keys (tests/helpers/gpt_oss.py; a file of the converter
itself, convert_hf_to_gguf.py of the vendored llama.cpp, was checked by hand to load into the
same logits). Float: logits equal the transformers model's within 1e-4 of the largest logit over
24 tokens (the window is 8). Quantized experts (quantize="gguf"): each expert's projection is the
file's blocks, which dequantized are the float load's weights bit for bit, and the logits equal
the float load's within the quantized layers' float32-activation bound; MXFP4 experts (the type
gpt-oss ships in) as Q8_0's and the K-quants'. Types no kernel reads are refused by name."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
import torch
from helpers import relative_error
from helpers.gguf import add_metadata, ids_for, write_gguf
from helpers.gpt_oss import gpt_oss_metadata, gpt_oss_tensors, tiny_gpt_oss
from helpers.llama_cpp_tools import llama_cpp_tool, printed_mean_kld, run_llama_perplexity

import flashformer
from flashformer.checkpoints.gguf import GGUFError, read_gguf
from flashformer.cli import commands as cli
from flashformer.kernels.block_types import TYPES
from flashformer.kernels.quantized import QuantizedLinear
from flashformer.model.experts import MixtureOfExperts


def write_tiny(
    tmp_path, expert_types=("F32", "F32", "F32"), metadata_changes=None, tensor_changes=None, **sizes
):
    """(the transformers model, its GGUF file)."""
    model = tiny_gpt_oss(**sizes)
    metadata = {**gpt_oss_metadata(model), **(metadata_changes or {})}
    tensors = {**gpt_oss_tensors(model, expert_types), **(tensor_changes or {})}
    return model, write_gguf(tmp_path / "gpt-oss.gguf", "gpt-oss", metadata, tensors)


@pytest.mark.parametrize("float_type", ["F32", "F16", "BF16"])
def test_float_logits_equal_transformers(tmp_path, float_type):
    model, path = write_tiny(tmp_path, (float_type,) * 3)
    checkpoint = read_gguf(path, show_progress=False)
    config = checkpoint.config
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 8
    assert config["rope_parameters"]["rope_type"] == "yarn" and config["rope_parameters"]["truncate"] is False
    up_bias = checkpoint.tensors["model.layers.1.mlp.experts.5.up_proj.bias"]
    assert torch.equal(up_bias, model.state_dict()["model.layers.1.mlp.experts.gate_up_proj_bias"][5, 1::2])
    ours = flashformer.from_pretrained(path, quantize=None)
    assert isinstance(ours.decoder.block(0).ffn, MixtureOfExperts)
    ids = ids_for(model)
    reference = model
    if float_type != "F32":  # the experts' weights as the file rounds them
        rounded = {"F16": torch.float16, "BF16": torch.bfloat16}[float_type]
        reference = tiny_gpt_oss()
        with torch.no_grad():
            for name, parameter in reference.named_parameters():
                if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                    parameter.copy_(parameter.to(rounded).float())
    with torch.no_grad():
        assert relative_error(ours(ids).logits, reference(ids).logits) < 1e-4


def test_greedy_tokens_equal_transformers(tmp_path):
    model, path = write_tiny(tmp_path)
    ours, _ = flashformer.load(path)
    prompt = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None)
    assert ours.generate(prompt, max_new_tokens=10, do_sample=False).tolist() == expected.tolist()


# Q8_0 from gguf's quantizer; K-quants (random codes with sane scales: gguf cannot quantize to
# them) need rows of 256, so that model is 256 wide with experts of 256
QUANTIZED = {
    "Q8_0": (("Q8_0", "Q8_0", "Q8_0"), {}),
    "K": (("Q4_K", "Q5_K", "Q6_K"), dict(hidden_size=256, intermediate_size=256, head_dim=64)),
    "MXFP4": (("MXFP4", "MXFP4", "MXFP4"), {}),  # gpt-oss's own type, from gguf's quantizer
}


@pytest.mark.parametrize("kind", QUANTIZED)
def test_quantized_experts_multiply_the_files_own_blocks(tmp_path, kind):
    types, sizes = QUANTIZED[kind]
    model, path = write_tiny(tmp_path, types, **sizes)
    float_model = flashformer.from_pretrained(path, quantize=None)
    quantized = flashformer.from_pretrained(path, activations="float32")  # quantize="gguf": the default
    moe = quantized.decoder.block(1).ffn
    assert not isinstance(moe.router, QuantizedLinear)  # F32 in the file, as llama.cpp keeps it
    for e, expert in enumerate(moe.experts):
        float_expert = float_model.decoder.block(1).ffn.experts[e]
        for projection, type_name in zip(("gate", "up", "down"), types):
            layer = getattr(expert, projection)
            assert isinstance(layer, QuantizedLinear), (e, projection)
            assert layer.fmt == TYPES[type_name].layout, (e, projection)  # the file's type, not repacked
            assert torch.equal(layer.dequantize(), getattr(float_expert, projection).weight), (e, projection)
            assert torch.equal(layer.bias, getattr(float_expert, projection).bias), (e, projection)
    ids = ids_for(model)
    with torch.no_grad():
        got, want = quantized(ids).logits, float_model(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-5


@pytest.mark.skipif(
    llama_cpp_tool("llama-quantize") is None or llama_cpp_tool("llama-perplexity") is None,
    reason="no llama.cpp build with llama-quantize and llama-perplexity",
)
def test_llama_cpps_mxfp4_mix_within_twice_its_own_error(tmp_path):
    """llama-quantize's MXFP4_MOE mix of a tiny F32 file (experts MXFP4, the rest Q8_0), as
    gpt-oss is downloaded: the experts are the file's MXFP4 blocks, and our KL-divergence to the
    F32 file's logits is within 2x llama-perplexity's own on the same tokens (seen 0.306 and
    0.327, the head's logits widened so that the quantization shows)."""
    model = tiny_gpt_oss()
    with torch.no_grad():
        model.lm_head.weight.mul_(30)
    metadata = {**gpt_oss_metadata(model), "tokenizer.ggml.pre": "gpt-2"}  # llama.cpp's name of GPT-2's
    f32 = write_gguf(tmp_path / "f32.gguf", "gpt-oss", metadata, gpt_oss_tensors(model))
    mxfp4 = tmp_path / "mxfp4.gguf"
    done = subprocess.run([str(llama_cpp_tool("llama-quantize")), str(f32), str(mxfp4), "MXFP4_MOE"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    experts = flashformer.from_pretrained(mxfp4).decoder.block(0).ffn.experts
    assert {getattr(expert, p).fmt for expert in experts for p in ("gate", "up", "down")} == {"mxfp4"}
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog; Paris is the capital of France.\n" * 4)
    perplexity, theirs, ours = (
        llama_cpp_tool("llama-perplexity"),
        tmp_path / "theirs.kld",
        tmp_path / "ours.kld",
    )
    run_llama_perplexity(perplexity, f32, "-f", str(text), "--kl-divergence-base", str(theirs))
    their_kld = printed_mean_kld(
        run_llama_perplexity(perplexity, mxfp4, "--kl-divergence-base", str(theirs), "--kl-divergence")
    )
    cli.main(["eval", "kld", str(f32), "--save-base", str(ours), "--tokens-of", str(theirs), "--no-progress"])
    out = tmp_path / "kld.json"
    cli.main(["eval", "kld", str(mxfp4), "--base", str(ours), "--out", str(out), "--no-progress"])
    our_kld = json.loads(out.read_text())["kld"]["mean"]
    assert 0 < our_kld <= 2 * their_kld, (our_kld, their_kld)


def test_the_native_decoder_declines_the_file(tmp_path):
    from flashformer.model.native import native_decoder, native_unsupported

    _, path = write_tiny(tmp_path, ("Q8_0",) * 3)
    model, _ = flashformer.load(path)
    assert native_decoder(model) is None
    assert "attention sinks (gpt-oss)" in native_unsupported(model)


def test_other_block_types_are_refused_by_name(tmp_path):
    """A type gguf knows and no kernel here reads (IQ4_NL: 32 values in 18 bytes) is refused,
    and the message names the tensor and the type."""
    iq4_nl = np.zeros((8, 32, 64 // 32 * 18), dtype=np.uint8)  # (experts, rows, bytes of a row)
    import gguf

    tensors = gpt_oss_tensors(tiny_gpt_oss())

    writer = gguf.GGUFWriter(str(tmp_path / "iq4_nl.gguf"), "gpt-oss")
    add_metadata(writer, gpt_oss_metadata(tiny_gpt_oss()))
    for name, (values, _) in tensors.items():
        if name == "blk.0.ffn_down_exps.weight":
            writer.add_tensor(name, iq4_nl, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        else:
            writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        GGUFError, match=r"'blk.0.ffn_down_exps.weight' has type IQ4_NL, which flashformer does not read"
    ):
        read_gguf(tmp_path / "iq4_nl.gguf", show_progress=False)


@pytest.mark.parametrize(
    "metadata_changes, message",
    [
        (
            {"gpt-oss.expert_used_count": 9},
            r"gpt-oss.expert_used_count=9 must be in \[1, gpt-oss.expert_count=8\]",
        ),
        ({"gpt-oss.rope.scaling.type": "linear"}, r"gpt-oss.rope.scaling.type='linear' is not supported"),
        ({"gpt-oss.rope.scaling.yarn_ext_factor": 0.5}, r"yarn_ext_factor=0.5 is not supported"),
        (
            {"gpt-oss.expert_weights_scale": 2.5},
            r"metadata gpt-oss.expert_weights_scale=2.5 is not supported",
        ),
    ],
)
def test_what_the_file_cannot_mean_is_refused_by_name(tmp_path, metadata_changes, message):
    _, path = write_tiny(tmp_path, metadata_changes=metadata_changes)
    with pytest.raises(GGUFError, match=message):
        read_gguf(path, show_progress=False)
