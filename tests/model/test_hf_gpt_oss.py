"""flashformer.model.hf's gpt_oss family: a folder transformers writes from a random
GptOssForCausalLM (sinks, biases and router nudged from init) loads into its logits within 1e-4
of the largest logit, over 24 tokens, more than the sliding window of 8, and into its greedy
tokens; it saves back into a folder transformers reads; the native decoder declines it, and
experts quantized otherwise than MXFP4 (tests/checkpoints/test_mxfp4_folder.py) are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import relative_error
from helpers.gpt_oss import YARN, tiny_gpt_oss

import flashformer

IDS = torch.randint(3, 275, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"swiglu_limit": 0.05, "swiglu_alpha": 2.5},  # the clamps bite: most gate/up values pass 0.05
        {"rope_parameters": dict(YARN, truncate=True, attention_factor=1.3)},
    ],
    ids=["gpt-oss-20b", "clamped", "yarn-truncated"],
)
def test_folder_loads_into_transformers_logits_and_saves_back(tmp_path, overrides):
    reference = tiny_gpt_oss(**overrides)
    reference.save_pretrained(tmp_path / "theirs")
    ours = flashformer.from_pretrained(tmp_path / "theirs")
    config = ours.config
    assert config.layer_types == ("sliding_attention", "full_attention") and config.sliding_window == 8
    assert (config.n_expert, config.n_expert_used, config.expert_gating) == (8, 2, "topk_softmax")
    assert config.attention_sinks and config.rope_scaling.kind == "yarn"
    with torch.no_grad():
        expected = reference(IDS).logits
        assert relative_error(ours(IDS).logits, expected) < 1e-4

    ours.save_pretrained(tmp_path / "ours")
    back = type(reference).from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    with torch.no_grad():
        assert relative_error(back(IDS).logits, expected) < 1e-4


def test_every_part_changes_the_logits(tmp_path):
    """The window, the sinks, YaRN's attention factor and the router's bias each matter at these
    sizes: with one of them undone the logits move by far more than the tolerance."""
    reference = tiny_gpt_oss()
    reference.save_pretrained(tmp_path)
    ours = flashformer.from_pretrained(tmp_path)
    with torch.no_grad():
        expected = ours(IDS).logits
        changes = {
            "window": lambda m: setattr(m.decoder.block(0).attn, "window", None),
            "sinks": lambda m: m.decoder.block(1).attn.sinks.fill_(-1e4),
            "yarn factor": lambda m: setattr(m.decoder.positions, "cos_sin_factor", 1.0),
            "router bias": lambda m: m.decoder.block(0).ffn.router.bias.mul_(20),
        }
        for name, change in changes.items():
            model = flashformer.from_pretrained(tmp_path)
            change(model)
            assert relative_error(model(IDS).logits, expected) > 1e-3, name


def test_greedy_tokens_equal_transformers(tmp_path):
    reference = tiny_gpt_oss()
    reference.save_pretrained(tmp_path)
    ours = flashformer.from_pretrained(tmp_path)
    prompt = torch.randint(3, reference.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=None)
    got = ours.generate(prompt, max_new_tokens=10, do_sample=False)
    assert got.tolist() == expected.tolist()  # 16 tokens, past the window of 8


def test_the_native_decoder_declines_and_says_why(tmp_path):
    from flashformer.model.native import native_decoder, native_unsupported

    tiny_gpt_oss().save_pretrained(tmp_path)
    ours = flashformer.from_pretrained(tmp_path).eval()
    assert native_decoder(ours) is None
    assert "attention sinks (gpt-oss)" in native_unsupported(ours)


def test_a_paged_cache_refuses_sinks(tmp_path):
    class Paged:
        paged = True

    tiny_gpt_oss().save_pretrained(tmp_path)
    attn = flashformer.from_pretrained(tmp_path).decoder.block(0).attn
    with pytest.raises(NotImplementedError, match=r"attention sinks \(config.attention_sinks\)"):
        attn(torch.zeros(1, 1, 64), kv_cache=Paged())


def test_other_quantized_experts_are_refused_by_name(tmp_path):
    tiny_gpt_oss().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    hf = json.loads(path.read_text())
    hf["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    path.write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="says quant_method 'mxfp4', but the weights hold no MXFP4 experts"):
        flashformer.from_pretrained(tmp_path)
    hf["quantization_config"] = {"quant_method": "fp8"}
    path.write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="gpt_oss experts quantized as fp8 .* are not supported"):
        flashformer.from_pretrained(tmp_path)


def test_dense_families_refuse_gpt_oss_parts_on_save(tmp_path):
    model = flashformer.build("llama-tiny", attention_sinks=True)
    with pytest.raises(ValueError, match="attention_sinks=True cannot be saved as a Hugging Face llama"):
        model.save_pretrained(tmp_path)
    plain = flashformer.build("llama-tiny", n_expert=4, n_expert_used=2, hf_model_type="gpt_oss")
    with pytest.raises(ValueError, match="swiglu_limit=None cannot be saved as a Hugging Face gpt_oss"):
        plain.save_pretrained(tmp_path)
