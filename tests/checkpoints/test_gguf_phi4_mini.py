"""GGUF phi3 files with LongRoPE (Phi-4-mini, Phi-3.5-mini, Phi-3-128k), written here from a random
transformers Phi3ForCausalLM as llama.cpp's converter writes them (rope_factors_short/long tensors,
rope.scaling.attn_factor, a partial rotary of 0.75): the float load gives transformers' logits
within and past the original context, and its greedy tokens with the cache past it."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.dense_2026 import ORIGINAL_CONTEXT, phi4_mini_metadata, phi4_mini_tensors, tiny_phi4_mini
from helpers.gguf import cycle_types, write_gguf

import flashformer
from flashformer.checkpoints.gguf import read_gguf


@pytest.fixture(scope="module")
def phi4_mini(tmp_path_factory):
    model = tiny_phi4_mini()
    path = tmp_path_factory.mktemp("phi4_mini") / "phi4-mini.gguf"
    return model, write_gguf(
        path, "phi3", phi4_mini_metadata(model), phi4_mini_tensors(model, cycle_types("F32"))
    )


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 275, (2, length), generator=torch.Generator().manual_seed(seed))


def test_the_file_reads_as_transformers_longrope_config(phi4_mini):
    model, path = phi4_mini
    rope = read_gguf(path, show_progress=False).config["rope_parameters"]
    assert rope["rope_type"] == "longrope" and rope["partial_rotary_factor"] == 0.75
    assert rope["original_max_position_embeddings"] == ORIGINAL_CONTEXT
    for name in ("short_factor", "long_factor"):
        assert torch.equal(torch.tensor(rope[name]), torch.tensor(model.config.rope_parameters[name]))
    assert rope["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(8) / math.log(32)), rel=1e-6)


@pytest.mark.parametrize("length", [ORIGINAL_CONTEXT, 3 * ORIGINAL_CONTEXT])
def test_float_logits_equal_transformers(phi4_mini, length):
    model, path = phi4_mini
    ours = flashformer.from_pretrained(path, quantize=None)
    with torch.no_grad():
        expected = model(_ids(length)).logits
        assert (ours(_ids(length)).logits - expected).abs().max() / expected.abs().max() < 1e-4


def test_greedy_of_the_file_picks_transformers_tokens_past_the_original_context(phi4_mini):
    model, path = phi4_mini
    ours, _ = flashformer.load(path)
    prompt = _ids(20, seed=3)[:1]
    expected = model.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None)
    assert torch.equal(ours.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=None), expected)
