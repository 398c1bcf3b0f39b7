"""flashformer.checkpoints.gguf: GGUF files read as Hugging Face checkpoints.

The reference is transformers' own GGUF loader reading the same file (AutoModelForCausalLM with
gguf_file=), on the real SmolLM2-135M-Instruct Q4_1 file and on small files written here with
gguf.GGUFWriter as llama.cpp's converter writes them; for an all-F32 file also the transformers
model the file was written from. Damaged or unsupported files must raise an error naming the
file and the tensor (or metadata key)."""

from __future__ import annotations

import collections
import functools

import gguf
import numpy as np
import pytest
import torch
from helpers.gguf import (
    cycle_types,
    gpt2_metadata,
    gpt2_tensors,
    llama_metadata,
    llama_tensors,
    smollm2_checkpoint,
    smollm2_model,
    smollm2_tokenizer,
    tiny_gpt2,
    tiny_llama,
    transformers_gguf_model,
    transformers_smollm2_model,
    write_gguf,
)

import flashformer
from flashformer.checkpoints.gguf import SUPPORTED_TYPES, GGUFError, read_file, read_gguf
from flashformer.checkpoints.gguf.packaged_models import smollm2_path

# ---- the real model ----


def test_smollm2_config_is_the_model_card():
    config = smollm2_checkpoint().config
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (
        30,
        576,
        1536,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["rope_theta"] == 100000.0 and config["rope_parameters"]["rope_type"] == "default"
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    theirs = transformers_smollm2_model().config
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
    ):
        assert config[key] == getattr(theirs, key), key


def test_smollm2_tensors_equal_transformers_gguf_load():
    ours = smollm2_checkpoint().tensors
    theirs = transformers_smollm2_model().state_dict()
    assert set(theirs) - set(ours) == {"lm_head.weight"}  # tied: transformers' head is the embedding
    assert set(ours) <= set(theirs)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.shape == theirs[name].shape, name
        assert torch.equal(tensor, theirs[name]), name  # both are gguf's dequantizer, bit for bit


def test_smollm2_keeps_the_raw_blocks():
    checkpoint = smollm2_checkpoint()
    quantized = checkpoint.quantized
    assert collections.Counter(q.ggml_type for q in quantized.values()) == {"Q4_1": 210, "Q8_0": 1}
    assert quantized["model.embed_tokens.weight"].ggml_type == "Q8_0"
    q = quantized["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (576, 576) and (q.block_size, q.block_bytes) == (32, 20)
    assert q.blocks.dtype == torch.uint8 and q.blocks.shape == (576, 576 // 32 * 20)
    for name, record in quantized.items():
        assert torch.equal(record.dequantize(), checkpoint.tensors[name]), name
        permuted = ".q_proj." in name or ".k_proj." in name
        assert (record.row_permutation is not None) == permuted, name


def _q4_1_row(blocks: torch.Tensor) -> torch.Tensor:
    """One row of Q4_1 decoded by the format's definition: per 32 inputs, float16 scale d and
    minimum m, then 16 bytes whose low nibbles are inputs 0..15 and high nibbles 16..31; w = d*q + m."""
    raw = blocks.numpy().reshape(-1, 20)
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)  # (groups, 1)
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    codes = np.concatenate([raw[:, 4:] & 0x0F, raw[:, 4:] >> 4], axis=1).astype(np.float32)  # (groups, 32)
    return torch.from_numpy((d * codes + m).reshape(-1))


def test_q4_1_blocks_are_groups_of_32_inputs_with_scale_and_minimum():
    checkpoint = smollm2_checkpoint()
    for name in ("model.layers.3.mlp.down_proj.weight", "model.layers.3.self_attn.k_proj.weight"):
        record = checkpoint.quantized[name]
        for row in (0, 1, 100, record.shape[0] - 1):
            assert torch.equal(_q4_1_row(record.blocks[row]), checkpoint.tensors[name][row]), (name, row)


def test_smollm2_file_rows_are_permuted_whole():
    """The q/k un-permutation moves whole rows of blocks: blocks[i] is the file's row permutation[i]."""
    raw = read_file(smollm2_path()).tensors["blk.5.attn_k.weight"]
    record = smollm2_checkpoint().quantized["model.layers.5.self_attn.k_proj.weight"]
    file_blocks = torch.from_numpy(np.array(raw.data))
    assert torch.equal(record.blocks, file_blocks[record.row_permutation])
    assert not torch.equal(record.blocks, file_blocks)


def test_smollm2_end_to_end_logits_and_greedy_answer():
    """flashformer.from_pretrained on the file equals transformers' GGUF model, and answers the question."""
    tokenizer = smollm2_tokenizer()
    ours = smollm2_model()
    theirs = transformers_smollm2_model()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = torch.tensor([tokenizer.apply_chat_template(messages, add_generation_prompt=True)])  # (1, P)
    with torch.no_grad():
        assert (ours(prompt).logits - theirs(prompt).logits).abs().max() < 1e-4
    output = ours.generate(prompt, max_new_tokens=20, eos_token_id=tokenizer.stop_token_ids)
    answer = tokenizer.decode(output[0, prompt.shape[1] :].tolist())
    assert answer == "The capital of France is Paris."


# ---- synthetic files, checked against transformers reading them ----

CASES = {
    # GQA (4 query heads on 2 KV heads), separate output head, the float and legacy block types,
    # and MXFP4 (gpt-oss's experts' type, read the same way in any 2-D tensor)
    "llama": (
        tiny_llama,
        llama_metadata,
        llama_tensors,
        ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"),
    ),
    # K-quants need 256 inputs per block: a wider model, tied head
    "llama_k": (
        functools.partial(tiny_llama, tie=True, hidden=256, ff=512),
        llama_metadata,
        llama_tensors,
        ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
    ),
    "gpt2": (tiny_gpt2, gpt2_metadata, gpt2_tensors, ("Q8_0", "F16", "Q4_1", "F32", "Q4_0", "BF16")),
}


@functools.cache
def _case(name: str, tmp_root):
    build, metadata, tensors, types = CASES[name]
    model = build()
    path = write_gguf(
        tmp_root / f"{name}.gguf", name.split("_")[0], metadata(model), tensors(model, cycle_types(*types))
    )
    return path, read_gguf(path, show_progress=False), transformers_gguf_model(path)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return lambda name: _case(name, root)


@pytest.mark.parametrize("name", sorted(CASES))
def test_synthetic_tensors_equal_transformers(case, name):
    path, checkpoint, theirs = case(name)
    theirs = theirs.state_dict()
    tied = checkpoint.config["tie_word_embeddings"]
    assert set(theirs) - set(checkpoint.tensors) == ({"lm_head.weight"} if tied else set())
    for hf_name, tensor in checkpoint.tensors.items():
        assert torch.equal(tensor, theirs[hf_name]), hf_name
    for hf_name, record in checkpoint.quantized.items():
        values = record.dequantize()
        assert torch.equal(values.t() if record.hf_transposed else values, checkpoint.tensors[hf_name]), (
            hf_name
        )


@pytest.mark.parametrize("name", sorted(CASES))
def test_synthetic_logits_equal_transformers(case, name, tmp_path):
    path, checkpoint, theirs = case(name)
    ours = flashformer.from_pretrained(path, quantize=None)
    input_ids = torch.randint(
        0, checkpoint.config["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        expected = theirs(input_ids).logits
        assert (ours(input_ids).logits - expected).abs().max() < 1e-4
    assert expected.abs().max() > 0.1  # a real signal, not a model of zeros


def test_every_supported_type_is_covered(case):
    stored = {raw.ggml_type for name in CASES for raw in read_file(case(name)[0]).tensors.values()}
    assert stored == set(SUPPORTED_TYPES)


def test_gqa_config_and_untied_head(case):
    _, checkpoint, _ = case("llama")
    config = checkpoint.config
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["tie_word_embeddings"] is False and "lm_head.weight" in checkpoint.tensors


def test_all_f32_file_gives_back_the_model_it_was_written_from(tmp_path):
    """Independent of transformers' GGUF reader: the un-permuted q/k rows are the original ones."""
    model = tiny_llama(heads=4, kv_heads=1, seed=3)  # MQA: k permuted over one head, q over four
    path = write_gguf(
        tmp_path / "f32.gguf", "llama", llama_metadata(model), llama_tensors(model, lambda name: "F32")
    )
    checkpoint = read_gguf(path, show_progress=False)
    original = model.state_dict()
    assert set(checkpoint.tensors) == set(original)
    for name, tensor in checkpoint.tensors.items():
        assert torch.equal(tensor, original[name]), name
    assert checkpoint.quantized == {}


def test_gpt2_conv1d_weights_come_back_transposed(case):
    _, checkpoint, _ = case("gpt2")
    assert checkpoint.tensors["transformer.h.0.attn.c_attn.weight"].shape == (64, 192)  # (in, out): Conv1D
    transposed = {name: r for name, r in checkpoint.quantized.items() if r.hf_transposed}
    assert transposed, "no quantized Conv1D weight in the gpt2 case"
    for name, record in transposed.items():
        assert record.shape == checkpoint.tensors[name].shape[::-1], name  # blocks stay (out, in)


def test_dequantize_false_keeps_only_blocks(case, tmp_path):
    path, full, _ = case("llama")
    blocks_only = read_gguf(path, dequantize=False, show_progress=False)
    assert set(blocks_only.quantized) == set(full.quantized)
    assert set(blocks_only.tensors) == set(full.tensors) - set(full.quantized)
    for name, record in blocks_only.quantized.items():
        assert torch.equal(record.blocks, full.quantized[name].blocks), name
    with pytest.raises(ValueError, match="dequantize=True"):
        blocks_only.save_pretrained(tmp_path)


# ---- files that must be refused, naming the file and the tensor ----


@pytest.fixture(scope="module")
def parts():
    """Metadata and tensors of a small valid llama file, to damage one thing at a time."""
    model = tiny_llama()
    return llama_metadata(model), llama_tensors(model, cycle_types("Q8_0", "F16"))


def _write(tmp_path, metadata, tensors, arch="llama"):
    return write_gguf(tmp_path / "bad.gguf", arch, metadata, tensors)


def test_valid_parts_read(parts, tmp_path):
    assert read_gguf(_write(tmp_path, *parts), show_progress=False).config["model_type"] == "llama"


def test_truncated_data_names_the_cut_tensor(parts, tmp_path):
    path = _write(tmp_path, *parts)
    last = list(parts[1])[-1]
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(GGUFError, match=rf"bad\.gguf is truncated: the data of tensor '{last}'"):
        read_gguf(path)


def test_truncated_smollm2_names_the_embedding(tmp_path):
    path = tmp_path / "SmolLM2-cut.gguf"
    path.write_bytes(smollm2_path().read_bytes()[:2_000_000])  # inside token_embd, the first tensor
    with pytest.raises(
        GGUFError, match=r"SmolLM2-cut\.gguf is truncated: the data of tensor 'token_embd\.weight'"
    ):
        read_gguf(path)


def test_truncated_header_says_so(parts, tmp_path):
    path = _write(tmp_path, *parts)
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(GGUFError, match=r"bad\.gguf is truncated: its header"):
        read_gguf(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match=r"model\.gguf is not a GGUF file: it starts with b'PK"):
        read_gguf(path)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        read_gguf(tmp_path / "missing.gguf")


def test_unknown_architecture(parts, tmp_path):
    metadata = {key.replace("llama.", "falcon."): value for key, value in parts[0].items()}
    path = _write(tmp_path, metadata, parts[1], arch="falcon")
    with pytest.raises(
        GGUFError, match=r"bad\.gguf: architecture 'falcon' is not supported \(supported: "
    ) as error:
        read_gguf(path)
    for arch in ("gemma", "gemma2", "gemma3", "gpt2", "llama", "phi3", "qwen2", "qwen3"):
        assert f" {arch}," in str(error.value) or f" {arch})" in str(error.value), arch


def test_unsupported_tensor_type(parts, tmp_path):
    path = _write(tmp_path, *parts)
    name = next(name for name, (_, kind) in parts[1].items() if kind == "F16")
    # rewrite the tensor's declared type in the tensor table (after its name, dim count and 2 dims)
    data = bytearray(path.read_bytes())
    encoded = name.encode()
    type_at = data.index(len(encoded).to_bytes(8, "little") + encoded) + 8 + len(encoded) + 4 + 2 * 8
    assert int.from_bytes(data[type_at : type_at + 4], "little") == gguf.GGMLQuantizationType.F16
    data[type_at : type_at + 4] = int(gguf.GGMLQuantizationType.I16).to_bytes(
        4, "little"
    )  # gguf knows it, we don't
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=rf"bad\.gguf: tensor '{name}' has type I16"):
        read_gguf(path)
    data[type_at : type_at + 4] = (99).to_bytes(4, "little")  # a type id no one knows
    path.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=rf"bad\.gguf: tensor '{name}' cannot be read"):
        read_gguf(path)


def test_embedding_rows_disagreeing_with_the_vocabulary(parts, tmp_path):
    tensors = dict(parts[1])
    values, kind = tensors["token_embd.weight"]
    tensors["token_embd.weight"] = (values[:-1], kind)
    with pytest.raises(
        GGUFError,
        match=r"bad\.gguf: tensor 'token_embd\.weight' .* has shape \(274, 64\); the metadata implies \(275, 64\)",
    ):
        read_gguf(_write(tmp_path, parts[0], tensors))


def test_head_count_disagreeing_with_the_k_projection(parts, tmp_path):
    metadata = dict(parts[0], **{"llama.attention.head_count_kv": 1})
    with pytest.raises(
        GGUFError,
        match=r"tensor 'blk\.0\.attn_k\.weight' .* has shape \(32, 64\); the metadata implies \(16, 64\)",
    ):
        read_gguf(_write(tmp_path, metadata, parts[1]))


def test_heads_that_do_not_group(parts, tmp_path):
    metadata = dict(parts[0], **{"llama.attention.head_count_kv": 3})
    with pytest.raises(GGUFError, match="4 query heads cannot share 3 KV heads"):
        read_gguf(_write(tmp_path, metadata, parts[1]))


def test_missing_tensor(parts, tmp_path):
    tensors = {name: value for name, value in parts[1].items() if name != "blk.1.ffn_up.weight"}
    with pytest.raises(GGUFError, match=r"bad\.gguf: tensor 'blk\.1\.ffn_up\.weight' is missing"):
        read_gguf(_write(tmp_path, parts[0], tensors))


def test_unexpected_tensor(parts, tmp_path):
    tensors = dict(parts[1], **{"blk.0.attn_extra.weight": (np.zeros((4, 32), np.float32), "F32")})
    with pytest.raises(GGUFError, match=r"bad\.gguf: tensor 'blk\.0\.attn_extra\.weight' has no place"):
        read_gguf(_write(tmp_path, parts[0], tensors))


def test_missing_metadata_key(parts, tmp_path):
    metadata = {key: value for key, value in parts[0].items() if key != "llama.embedding_length"}
    with pytest.raises(GGUFError, match=r"bad\.gguf: the metadata lacks 'llama\.embedding_length'"):
        read_gguf(_write(tmp_path, metadata, parts[1]))


def test_vocab_size_disagreeing_with_the_token_list(parts, tmp_path):
    metadata = dict(parts[0], **{"llama.vocab_size": 300})
    with pytest.raises(GGUFError, match="llama.vocab_size=300 but tokenizer.ggml.tokens lists 275 tokens"):
        read_gguf(_write(tmp_path, metadata, parts[1]))


def test_unsupported_llama_variants_are_refused(parts, tmp_path):
    for key, value in (
        ("llama.expert_count", 8),
        ("llama.rope.dimension_count", 8),
        ("llama.rope.scaling.type", "yarn"),
    ):
        with pytest.raises(GGUFError, match=key.replace(".", r"\.")):
            read_gguf(_write(tmp_path, dict(parts[0], **{key: value}), parts[1]))
    tensors = dict(parts[1], **{"rope_freqs.weight": (np.full(8, 2.0, np.float32), "F32")})
    with pytest.raises(GGUFError, match="rope_freqs.weight"):  # every frequency divided: not Llama 3's rule
        read_gguf(_write(tmp_path, parts[0], tensors))
    with pytest.raises(GGUFError, match=r"metadata llama\.attention\.sliding_window=4 is not supported"):
        read_gguf(_write(tmp_path, dict(parts[0], **{"llama.attention.sliding_window": 4}), parts[1]))


def test_linear_rope_scaling_reaches_the_config(parts, tmp_path):
    metadata = dict(parts[0], **{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    config = read_gguf(_write(tmp_path, metadata, parts[1]), show_progress=False).config
    assert config["rope_parameters"] == {"rope_type": "linear", "rope_theta": 50000.0, "factor": 4.0}
