"""GGUF files of the qwen3moe architecture (checkpoints.gguf.qwen3.Qwen3Moe): Qwen3 MoE's
router and 3-D expert tensors, float and quantized.

The files are written here from a random transformers Qwen3MoeForCausalLM with llama.cpp's
converter's tensor names and metadata keys (tests/helpers/gguf.py; a file of the converter itself
was checked by hand to load the same way). Float: logits equal the transformers model's within
1e-4 of the largest logit. Quantized experts (quantize="gguf"): each expert's projection is the
file's blocks, which dequantized are the float load's weights bit for bit, and the logits equal
the float load's within the quantized layers' float32-activation bound (as tests/model/
test_quantize.py holds a dense model to)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import relative_error
from helpers.gguf import ids_for, qwen3moe_metadata, qwen3moe_tensors, tiny_qwen3_moe, write_gguf

import flashformer
from flashformer.checkpoints.gguf import GGUFError, read_gguf
from flashformer.kernels.quantized import QuantizedLinear
from flashformer.model.experts import MixtureOfExperts


def write_tiny(
    tmp_path, expert_types=("F32", "F32", "F32"), metadata_changes=None, tensor_changes=None, **sizes
):
    """(the transformers model, its GGUF file)."""
    model = tiny_qwen3_moe(**sizes)
    metadata = {**qwen3moe_metadata(model), **(metadata_changes or {})}
    tensors = {**qwen3moe_tensors(model, expert_types), **(tensor_changes or {})}
    return model, write_gguf(tmp_path / "qwen3moe.gguf", "qwen3moe", metadata, tensors)


def test_float_logits_equal_transformers(tmp_path):
    model, path = write_tiny(tmp_path)
    checkpoint = read_gguf(path, show_progress=False)
    assert checkpoint.config["num_experts"] == 8 and checkpoint.config["norm_topk_prob"] is True
    down = checkpoint.tensors["model.layers.1.mlp.experts.5.down_proj.weight"]
    assert torch.equal(down, model.state_dict()["model.layers.1.mlp.experts.down_proj"][5])  # expert 5's own
    ours = flashformer.from_pretrained(path, quantize=None)
    assert isinstance(ours.decoder.block(0).ffn, MixtureOfExperts)
    ids = ids_for(model)
    with torch.no_grad():
        assert relative_error(ours(ids).logits, model(ids).logits) < 1e-4


def test_transformers_gguf_loader_reads_the_same_file_into_the_same_logits(tmp_path):
    """A second reference: transformers' own GGUF reader (it takes the expert width and head_dim
    from no key of the file, so they are given)."""
    from transformers import AutoModelForCausalLM

    model, path = write_tiny(tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, attn_implementation="eager", moe_intermediate_size=32, head_dim=32
    ).eval()
    ours = flashformer.from_pretrained(path, quantize=None)
    ids = ids_for(model, seed=2)
    with torch.no_grad():
        assert relative_error(ours(ids).logits, theirs(ids).logits) < 1e-4


# Q8_0 from gguf's quantizer; K-quants (random codes with sane scales: gguf cannot quantize to
# them) need rows of 256, so that model is 256 wide with experts of 256
QUANTIZED = {
    "Q8_0": (("Q8_0", "Q8_0", "Q8_0"), {}),
    "K": (("Q4_K", "Q5_K", "Q6_K"), dict(hidden_size=256, moe_intermediate_size=256, head_dim=64)),
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
        for projection in ("gate", "up", "down"):
            layer = getattr(expert, projection)
            assert isinstance(layer, QuantizedLinear), (e, projection)
            want = getattr(float_model.decoder.block(1).ffn.experts[e], projection).weight
            assert torch.equal(layer.dequantize(), want), (e, projection)
    ids = ids_for(model)
    with torch.no_grad():
        got, want = quantized(ids).logits, float_model(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-5


def test_greedy_tokens_of_the_quantized_file_equal_its_float_load(tmp_path):
    model, path = write_tiny(tmp_path, ("Q8_0", "Q8_0", "Q8_0"))
    quantized, tokenizer = flashformer.load(path, activations="float32")
    float_model = flashformer.from_pretrained(path, quantize=None)
    prompt = torch.tensor([tokenizer.encode("the and 12")])
    got = quantized.generate(prompt, max_new_tokens=6, do_sample=False)
    want = float_model.generate(prompt, max_new_tokens=6, do_sample=False)
    assert got.tolist() == want.tolist() and got.shape[1] == prompt.shape[1] + 6


WRONG_EXPERTS = np.zeros((4, 32, 64), dtype=np.float32)  # 4 experts, where the metadata says 8


@pytest.mark.parametrize(
    "metadata_changes, tensor_changes, message",
    [
        (
            {"qwen3moe.expert_used_count": 9},
            {},
            r"qwen3moe.expert_used_count=9 must be in \[1, qwen3moe.expert_count=8\]",
        ),
        (
            {"qwen3moe.expert_weights_scale": 2.5},
            {},
            r"metadata qwen3moe.expert_weights_scale=2.5 is not supported",
        ),
        (
            {},
            {"blk.0.ffn_up_exps.weight": (WRONG_EXPERTS, "F32")},
            r"'blk.0.ffn_up_exps.weight' .* has shape \(4, 32, 64\); the metadata implies \(8, 32, 64\)",
        ),
        (
            {},
            {"blk.0.ffn_gate_up_exps.weight": (np.zeros((8, 64, 64), dtype=np.float32), "F32")},
            r"gate and up projections are one tensor \(ffn_gate_up_exps",
        ),
    ],
)
def test_what_the_file_cannot_mean_is_refused_by_name(tmp_path, metadata_changes, tensor_changes, message):
    _, path = write_tiny(tmp_path, metadata_changes=metadata_changes, tensor_changes=tensor_changes)
    with pytest.raises(GGUFError, match=message):
        read_gguf(path, show_progress=False)


def test_a_dense_qwen3_file_with_experts_is_still_refused(tmp_path):
    """qwen3 reads no experts: its expert_count is refused, as before qwen3moe."""
    from test_gguf_qwen3_gemma import write_tiny as write_dense

    _, path = write_dense(tmp_path, "qwen3", metadata_changes={"qwen3.expert_count": 8})
    with pytest.raises(GGUFError, match=r"qwen3.expert_count=8 is not supported"):
        read_gguf(path, show_progress=False)
