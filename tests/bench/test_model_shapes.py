"""bench/model_shapes.py: Llama 3's shapes as the exporter's tensor tables, checked against the
published models (parameter counts of their model cards, sizes of llama.cpp's Q4_K_M files of
them), without writing a large file; a tiny shape written whole and read back; and
`bench generate --write-shape`'s flags, refused or passed on before any work."""

from __future__ import annotations

import argparse

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType

import flashformer
from flashformer.bench import generate, model_shapes
from flashformer.bench.common import resolved_quantize
from flashformer.bench.model_shapes import SHAPES, Shape, parameter_count, weight_shapes
from flashformer.checkpoints.gguf import read_file
from flashformer.checkpoints.gguf.architectures import ARCHITECTURES
from flashformer.checkpoints.gguf.writer import tensor_type

# parameters as the models' cards and safetensors indexes give them (the tied 1B and 3B count
# their embedding once)
PUBLISHED_PARAMETERS = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "qwen2.5-0.5b": 494_032_768,  # 0.49B, of which 0.36B not the embedding (its card)
}
# sizes of the Q4_K_M files llama-quantize makes of them, as the hub lists them (GB, rounded):
# the tensors and a 128,256-token tokenizer (a few MB of strings that our small one lacks)
PUBLISHED_Q4_K_M_GB = {"llama-3.2-1b": 0.808, "llama-3.2-3b": 2.02, "llama-3.1-8b": 4.92}


@pytest.mark.parametrize("name", list(SHAPES))
def test_each_shape_has_its_published_parameter_count(name):
    assert parameter_count(SHAPES[name]) == PUBLISHED_PARAMETERS[name]


def test_the_tensor_tables_have_each_models_weights():
    for name, layers, head, d, kv, ff in (
        ("llama-3.2-1b", 16, False, 2048, 512, 8192),
        ("llama-3.2-3b", 28, False, 3072, 1024, 8192),
        ("llama-3.1-8b", 32, True, 4096, 1024, 14336),
    ):
        shapes = weight_shapes(SHAPES[name])
        assert len(shapes) == 2 + head + 9 * layers, name  # embedding, final norm, [head], 9 a layer
        assert ("lm_head.weight" in shapes) == head, name
        assert shapes["model.embed_tokens.weight"] == (128256, d)
        last = f"model.layers.{layers - 1}"
        assert shapes[f"{last}.self_attn.q_proj.weight"] == (d, d)  # heads * head_dim = hidden in all three
        assert shapes[f"{last}.self_attn.k_proj.weight"] == (kv, d)
        assert shapes[f"{last}.mlp.gate_proj.weight"] == (ff, d)
        assert shapes[f"{last}.mlp.down_proj.weight"] == (d, ff)
        assert f"model.layers.{layers}.input_layernorm.weight" not in shapes


@pytest.mark.parametrize("name", list(PUBLISHED_Q4_K_M_GB))
def test_our_q4_k_m_mix_is_the_size_of_llama_quantizes(name):
    """The types the writer picks (writer.tensor_type) for every tensor, summed as ggml's block
    sizes: within 2% below the published file (which adds its tokenizer)."""
    shape = SHAPES[name]
    specs = [spec for spec in ARCHITECTURES["llama"].tensors(shape.hf_config()) if spec.hf is not None]
    total = 0
    for spec in specs:
        block, block_bytes = gguf.GGML_QUANT_SIZES[
            GGMLQuantizationType[tensor_type(spec, "q4_k_m", shape.layers, shape.tied)]
        ]
        count = 1
        for dim in spec.shape:
            count *= dim
        total += count // block * block_bytes
    published = PUBLISHED_Q4_K_M_GB[name] * 1e9
    assert 0.98 * published < total < published * 1.005, (name, total)


TINY = Shape(256, 2, 2, 1, 128, 512, tied=False, rope_factor=8.0, vocab=4096, positions=1024)


def test_a_tiny_shape_is_written_whole_and_read_back(tmp_path):
    path = tmp_path / "tiny.gguf"
    result = model_shapes.write_shape("tiny", path, show_progress=False, shape=TINY)
    file = read_file(path)
    expected = {spec.gguf: spec.shape for spec in ARCHITECTURES["llama"].tensors(TINY.hf_config())}
    assert set(file.tensors) == set(expected)  # rope_freqs.weight included: Llama 3's scaling
    assert result["bytes"] == path.stat().st_size and list(tmp_path.iterdir()) == [path]
    assert result["types"]["output.weight"] == "Q6_K" and result["types"]["blk.0.attn_q.weight"] == "Q4_K"
    assert file.metadata["llama.context_length"] == 1024
    model, tokenizer = flashformer.load(path, quantize="gguf")  # as bench generate loads it
    assert model.config.rope_scaling.factor == 8.0 and model.config.max_seq_len == 1024
    ids = torch.tensor([tokenizer.encode("Once upon a time")])
    assert model.generate(ids, max_new_tokens=2, eos_token_id=[]).shape == (1, ids.shape[1] + 2)


def test_a_tiny_qwen2_shape_has_its_biases_and_is_read_back(tmp_path):
    tiny = Shape(
        128, 2, 4, 2, 32, 256, tied=True, rope_factor=1.0, vocab=4096, positions=2048, family="qwen2"
    )
    path = tmp_path / "tiny-qwen2.gguf"
    model_shapes.write_shape("tiny-qwen2", path, show_progress=False, shape=tiny)
    file = read_file(path)
    assert file.metadata["general.architecture"] == "qwen2" and file.metadata["qwen2.context_length"] == 2048
    assert "blk.1.attn_k.bias" in file.tensors and "output.weight" not in file.tensors  # tied
    model, _ = flashformer.load(path, quantize="gguf")
    assert model.config.attention_bias and model.config.rope_theta == 1e6 and model.config.max_seq_len == 2048


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    return parser.parse_args(list(flags))


def test_write_shape_takes_a_name_and_a_path_and_the_1b_flag_is_its_alias(tmp_path, monkeypatch):
    written = []
    monkeypatch.setattr(generate, "write_shape", lambda name, path: written.append((name, path)))
    existing = tmp_path / "8b.gguf"
    existing.write_bytes(b"GGUF")  # its magic: what tells a GGUF file from a folder
    args = parse("--write-shape", "llama-3.1-8b", str(existing))
    path = generate.write_shape_once(args)
    assert path == str(existing) and not written  # there already: not rewritten
    assert resolved_quantize(path, args.quantize) == "gguf" and args.transformers is False  # its own blocks
    args = parse("--write-shape", "llama-3.1-8b", str(existing), "--quantize", "int8")
    generate.write_shape_once(args)
    assert args.quantize == "int8"

    calls = []
    monkeypatch.setattr(generate, "write_shape_once", lambda a: calls.append(a.write_shape) or str(existing))
    monkeypatch.setattr(
        generate.generate_model, "run", lambda model, config, *rest: {"points": [{"error": "-"}]}
    )
    monkeypatch.setattr(generate.generate_model, "table", lambda payload: "")
    generate.main_from_args(parse("--write-1b-shape", str(tmp_path / "1b.gguf")))
    assert calls == [["llama-3.2-1b", str(tmp_path / "1b.gguf")]]


def test_write_shape_refuses_an_unknown_name_or_a_model_beside_it_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(generate, "write_shape", lambda *a: pytest.fail("wrote a file"))
    with pytest.raises(ValueError, match="llama-3.1-8b.*got 'llama-70b'"):
        generate.write_shape_once(parse("--write-shape", "llama-70b", str(tmp_path / "x.gguf")))
    args = parse("--write-shape", "llama-3.1-8b", str(tmp_path / "x.gguf"), "--model", "other.gguf")
    with pytest.raises(ValueError, match="not both"):
        generate.write_shape_once(args)
    args = parse("--write-shape", "llama-3.2-1b", "a.gguf", "--write-1b-shape", "b.gguf")
    with pytest.raises(ValueError, match="not both"):
        generate.main_from_args(args)
