"""GGUF smollm3 files (checkpoints.gguf.smollm3): written here from a random transformers
SmolLM3 as llama.cpp's converter writes them (its LlamaModel: q/k rows permuted), read into
transformers' logits, with llama.cpp's fixed NoPE step (every fourth layer); and written back by
our writer."""

from __future__ import annotations

import pytest
import torch
from helpers.dense_2026 import smollm3_metadata, smollm3_tensors, tiny_smollm3
from helpers.gguf import cycle_types, tiny_vocabulary, write_gguf

import flashformer
from flashformer.checkpoints.gguf import GGUFError, read_gguf
from flashformer.checkpoints.gguf.tokenizer import tokenizer_from_metadata
from flashformer.checkpoints.gguf.writer import write_gguf as write_our_gguf
from flashformer.model.hf.convert import to_hf


def _file(tmp_path, model, metadata_changes=None):
    metadata = {**smollm3_metadata(model), **(metadata_changes or {})}
    return write_gguf(
        tmp_path / "smollm3.gguf", "smollm3", metadata, smollm3_tensors(model, cycle_types("F32"))
    )


def _ids(length: int = 40) -> torch.Tensor:
    return torch.randint(0, 275, (2, length), generator=torch.Generator().manual_seed(0))


def test_float_logits_equal_transformers(tmp_path):
    model = tiny_smollm3(n_layers=8)  # layers 3 and 7 rotate nothing
    ours = flashformer.from_pretrained(_file(tmp_path, model), quantize=None)
    assert ours.config.nope_layers == (3, 7)
    with torch.no_grad():
        expected = model(_ids()).logits
        assert (ours(_ids()).logits - expected).abs().max() / expected.abs().max() < 1e-4


def test_greedy_of_the_file_picks_transformers_tokens(tmp_path):
    model = tiny_smollm3()
    ours, _ = flashformer.load(_file(tmp_path, model))
    prompt = _ids(10)[:1]
    expected = model.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None)
    assert torch.equal(ours.generate(prompt, max_new_tokens=16, do_sample=False, eos_token_id=None), expected)


def test_our_writer_writes_what_we_read(tmp_path):
    reference = tiny_smollm3(n_layers=8)
    reference.save_pretrained(tmp_path / "folder")
    hf, tensors = to_hf(flashformer.from_pretrained(tmp_path / "folder"))
    tokenizer = tokenizer_from_metadata(tiny_vocabulary())
    out = tmp_path / "ours.gguf"
    types = write_our_gguf(out, hf, tensors.__getitem__, tokenizer, "f16", show_progress=False)
    assert read_gguf(out, show_progress=False).metadata["general.architecture"] == "smollm3"
    with torch.no_grad():  # the reference rounded as the file rounds it: matrices to float16
        for parameter in reference.parameters():
            if parameter.dim() == 2:
                parameter.copy_(parameter.half().float())
        assert set(types.values()) == {"F16", "F32"}
        expected = reference(_ids()).logits
        got = flashformer.from_pretrained(out, quantize=None)(_ids()).logits
        assert (got - expected).abs().max() / expected.abs().max() < 1e-4


def test_nope_layers_llama_cpp_cannot_read_are_refused_on_write(tmp_path):
    reference = tiny_smollm3(no_rope_layers=[0, 1, 1, 1, 1])
    reference.save_pretrained(tmp_path / "folder")
    hf, tensors = to_hf(flashformer.from_pretrained(tmp_path / "folder"))
    with pytest.raises(ValueError, match="no_rope_layers=.* cannot be written to GGUF smollm3"):
        write_our_gguf(
            tmp_path / "x.gguf", hf, tensors.__getitem__, tokenizer_from_metadata(tiny_vocabulary())
        )


def test_unread_keys_are_refused_by_name(tmp_path):
    with pytest.raises(GGUFError, match="smollm3.attention.sliding_window=8 is not supported"):
        flashformer.from_pretrained(
            _file(tmp_path, tiny_smollm3(), {"smollm3.attention.sliding_window": 8}), quantize=None
        )
