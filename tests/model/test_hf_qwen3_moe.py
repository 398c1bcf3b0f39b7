"""flashformer.model.hf's qwen3_moe family: a folder transformers writes from a random
Qwen3MoeForCausalLM loads into its logits (within 1e-4 of the largest logit) and its greedy
tokens, saves back into a folder transformers reads, and the options not implemented are
refused by name."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import relative_error
from helpers.gguf import tiny_qwen3_moe

import flashformer


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_folder_loads_into_transformers_logits_and_saves_back(tmp_path, norm_topk_prob):
    reference = tiny_qwen3_moe(norm_topk_prob=norm_topk_prob)
    reference.save_pretrained(tmp_path / "theirs")
    ours = flashformer.from_pretrained(tmp_path / "theirs")
    config = ours.config
    assert (config.n_expert, config.n_expert_used, config.expert_ffn_hidden) == (8, 2, 32)
    assert config.expert_weights_norm is norm_topk_prob and config.qk_norm
    ids = torch.randint(0, reference.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids).logits
        assert relative_error(ours(ids).logits, expected) < 1e-4

    ours.save_pretrained(tmp_path / "ours")
    back = type(reference).from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    with torch.no_grad():
        assert relative_error(back(ids).logits, expected) < 1e-4


def test_greedy_tokens_equal_transformers(tmp_path):
    reference = tiny_qwen3_moe()
    reference.save_pretrained(tmp_path)
    ours = flashformer.from_pretrained(tmp_path)
    prompt = torch.randint(3, reference.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None)
    got = ours.generate(prompt, max_new_tokens=8, do_sample=False)
    assert got.tolist() == expected.tolist()


def test_the_native_decoder_declines_and_says_why(tmp_path):
    from flashformer.model.native import native_decoder, native_unsupported

    tiny_qwen3_moe().save_pretrained(tmp_path)
    ours = flashformer.from_pretrained(tmp_path).eval()
    assert native_decoder(ours) is None
    assert "mixture of experts (8 experts, 2 per token)" in native_unsupported(ours)


@pytest.mark.parametrize(
    "key, value",
    [("decoder_sparse_step", 2), ("mlp_only_layers", [0]), ("num_experts", 0), ("use_sliding_window", True)],
)
def test_unimplemented_options_are_refused_by_name(tmp_path, key, value):
    tiny_qwen3_moe().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    hf = json.loads(path.read_text())
    hf.pop("num_local_experts" if key == "num_experts" else key, None)
    hf[key] = value
    path.write_text(json.dumps(hf))
    message = re.escape(f"{key}={value!r} is not supported for ")
    with pytest.raises(ValueError, match=message + "qwen3(_moe)? models"):
        flashformer.from_pretrained(tmp_path)


def test_dense_families_refuse_experts_on_save(tmp_path):
    model = flashformer.build("llama-tiny", n_expert=4, n_expert_used=2, ffn_bias=False)
    with pytest.raises(ValueError, match="n_expert=4 cannot be saved as a Hugging Face llama"):
        model.save_pretrained(tmp_path)


def test_int8_quantizes_each_expert_and_keeps_the_router_float(tmp_path):
    """Each expert's projections become int8 layers, the router stays float32 (a rounding could
    change which experts a token runs); the logits equal those of the float model holding the
    dequantized weights, within tests/model/test_quantize.py's bound for float32 activations."""
    from flashformer.kernels.quantized import QuantizedLinear

    tiny_qwen3_moe().save_pretrained(tmp_path)
    model = flashformer.from_pretrained(tmp_path, quantize="int8", activations="float32")
    twin = flashformer.from_pretrained(tmp_path)
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert not any(name.endswith("router") for name in quantized)
    assert sum(".experts." in name for name in quantized) == 2 * 8 * 3
    with torch.no_grad():
        for name, module in quantized.items():
            twin.get_submodule(name).weight.copy_(module.dequantize())
        twin.embeddings.tokens.weight.copy_(model.embeddings.tokens.dequantize())
        ids = torch.randint(0, model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
        got, want = model(ids).logits, twin(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max() + 1e-5
