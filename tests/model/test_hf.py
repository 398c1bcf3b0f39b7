"""Hugging Face checkpoints: transformers models from small configs with every
parameter perturbed (its init leaves norms at 1 and biases at 0, which would
hide mapping mistakes), saved, loaded by flashformer: logits and hidden states
within 1e-4 in float32, with padding and token types; then saved by
flashformer and loaded back by transformers."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers import VOCAB, hf_config, perturbed
from safetensors.torch import load_file, save_file
from transformers import (
    BertForMaskedLM,
    BertModel,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    Phi3ForCausalLM,
    Qwen2ForCausalLM,
    T5ForConditionalGeneration,
)

import flashformer

transformers.logging.set_verbosity_error()
TOLERANCE = 1e-4
BATCH, LENGTH = 3, 13


def inputs():
    torch.manual_seed(2)
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH))
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, 9:] = 0  # right padding
    mask[2, 4:] = 0
    return ids, mask


def bert(**changes):
    return hf_config("bert", **changes)


def gpt2(**changes):
    return hf_config("gpt2", **changes)


def t5(**changes):
    return hf_config("t5", **changes)


def llama(**changes):
    return hf_config("llama", **changes)


LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,
}

CASES = {
    "bert-mlm": lambda: BertForMaskedLM(bert()),
    "bert-base-model": lambda: BertModel(bert(hidden_act="gelu_new")),  # pooler, no head
    "gpt2": lambda: GPT2LMHeadModel(gpt2()),
    "gpt2-untied-relu": lambda: GPT2LMHeadModel(gpt2(tie_word_embeddings=False, activation_function="relu")),
    "t5-v1.0": lambda: T5ForConditionalGeneration(t5()),
    "t5-v1.1": lambda: T5ForConditionalGeneration(
        t5(feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    ),
    "llama": lambda: LlamaForCausalLM(llama(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "llama3-scaling-tied": lambda: LlamaForCausalLM(llama(rope_parameters=LLAMA3, tie_word_embeddings=True)),
    "llama-mqa-bias-head-dim": lambda: LlamaForCausalLM(
        llama(num_key_value_heads=1, head_dim=12, attention_bias=True, mlp_bias=True, rope_theta=1e6)
    ),
    # q/k/v biases, no o_proj bias; tied head as Qwen2.5-0.5B
    "qwen2-tied": lambda: Qwen2ForCausalLM(
        hf_config(
            "qwen2", tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
        )
    ),
    # fused qkv_proj and gate_up_proj, 12 of 16 channels rotated (Phi-4-mini's 0.75)
    "phi3-partial-rotary": lambda: Phi3ForCausalLM(
        hf_config(
            "phi3",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
        )
    ),
}


def untie_t5_head(model, folder):
    """transformers ties T5's head whatever the config says; a v1.1 checkpoint
    has its own lm_head, so the test writes one (transformers then keeps it)."""
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = torch.randn_like(weights["shared.weight"])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.update(tie_word_embeddings=False, scale_decoder_outputs=False)
    (folder / "config.json").write_text(json.dumps(config))
    return type(model).from_pretrained(folder).eval()


def hf_outputs(model, ids, mask):
    """(logits or None, last hidden state) of a transformers model."""
    with torch.no_grad():
        if isinstance(model, T5ForConditionalGeneration):
            decoder_ids, decoder_mask = ids[:, :9], mask[:, :9]
            out = model(
                input_ids=ids,
                attention_mask=mask,
                decoder_input_ids=decoder_ids,
                decoder_attention_mask=decoder_mask,
            )
            hidden = model.decoder(
                input_ids=decoder_ids,
                attention_mask=decoder_mask,
                encoder_hidden_states=out.encoder_last_hidden_state,
                encoder_attention_mask=mask,
            ).last_hidden_state
            return out.logits, hidden, out.encoder_last_hidden_state
        types = (
            torch.arange(LENGTH).repeat(BATCH, 1) % 3
            if isinstance(model, BertForMaskedLM | BertModel)
            else None
        )
        kwargs = {"token_type_ids": types} if types is not None else {}
        if isinstance(model, BertModel):
            out = model(input_ids=ids, attention_mask=mask, **kwargs)
            return None, out.last_hidden_state, out.pooler_output
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **kwargs)
        return out.logits, out.hidden_states[-1], None


def our_outputs(model, ids, mask):
    with torch.no_grad():
        if isinstance(model, flashformer.EncoderDecoderModel):
            out = model(
                ids, attention_mask=mask, decoder_input_ids=ids[:, :9], decoder_attention_mask=mask[:, :9]
            )
            return out.logits, out.last_hidden_state, out.encoder_last_hidden_state
        if isinstance(model, flashformer.EncoderModel):
            out = model(ids, attention_mask=mask, token_type_ids=torch.arange(LENGTH).repeat(BATCH, 1) % 3)
            return out.logits, out.last_hidden_state, out.pooler_output
        out = model(ids, attention_mask=mask)
        return out.logits, out.last_hidden_state, None


def assert_close(ours, theirs, what):
    for name, a, b in zip(("logits", "last hidden state", "encoder / pooler output"), ours, theirs):
        if b is None:
            continue
        error = (a - b).abs().max().item()
        assert error <= TOLERANCE, f"{what}: {name} differs by {error:.2e}"


@pytest.fixture(scope="module", params=sorted(CASES))
def checkpoint(request, tmp_path_factory):
    """(case name, transformers model, its folder)."""
    torch.manual_seed(0)
    model = perturbed(CASES[request.param]())
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    if request.param == "t5-v1.1":
        model = untie_t5_head(model, folder)
    return request.param, model, folder


def test_loaded_model_matches_transformers(checkpoint):
    name, hf_model, folder = checkpoint
    ours = flashformer.from_pretrained(folder)
    ids, mask = inputs()
    assert_close(our_outputs(ours, ids, mask), hf_outputs(hf_model, ids, mask), name)
    # as a built model's: GPT-2's transposed Conv1D weights must not stay transposed views
    assert [n for n, p in ours.named_parameters() if not p.is_contiguous()] == []
    if name == "t5-v1.1":
        assert not ours.config.tie_word_embeddings and not ours.config.scale_decoder_output
    if name == "t5-v1.0":
        assert ours.config.tie_word_embeddings and ours.config.scale_decoder_output


def test_saved_model_loads_into_transformers_with_the_same_outputs(checkpoint, tmp_path):
    name, hf_model, folder = checkpoint
    flashformer.from_pretrained(folder).save_pretrained(tmp_path)
    reloaded = type(hf_model).from_pretrained(tmp_path).eval()
    ids, mask = inputs()
    assert_close(
        hf_outputs(reloaded, ids, mask), hf_outputs(hf_model, ids, mask), f"{name} saved by flashformer"
    )
    again = flashformer.from_pretrained(tmp_path)
    assert_close(our_outputs(again, ids, mask), hf_outputs(hf_model, ids, mask), f"{name} reloaded")


def test_losses_match_transformers(checkpoint):
    name, hf_model, folder = checkpoint
    if name == "bert-base-model":
        return  # no head, no loss
    ours = flashformer.from_pretrained(folder)
    ids, mask = inputs()
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        if name.startswith("t5"):
            # T5 starts the decoder with the pad token (0) and feeds the labels shifted right
            targets = labels[:, :9].contiguous()
            decoder_ids = torch.cat((torch.zeros(BATCH, 1, dtype=torch.long), targets[:, :8]), 1).clamp(min=0)
            theirs = hf_model(
                input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, labels=targets
            ).loss
            mine = ours(ids, attention_mask=mask, labels=targets).loss
        elif name.startswith("bert"):
            theirs = hf_model(input_ids=ids, attention_mask=mask, labels=labels).loss
            mine = ours(ids, attention_mask=mask, labels=labels).loss
        else:
            theirs = hf_model(input_ids=ids, attention_mask=mask, labels=labels).loss
            mine = ours(ids, attention_mask=mask, labels=labels).loss
    assert abs(mine.item() - theirs.item()) <= TOLERANCE


def test_left_padding_and_a_padded_decoder_match_at_real_tokens(tmp_path):
    torch.manual_seed(0)
    hf_model = perturbed(LlamaForCausalLM(llama()))
    hf_model.save_pretrained(tmp_path)
    ours = flashformer.from_pretrained(tmp_path)
    ids, _ = inputs()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        theirs, mine = (
            hf_model(input_ids=ids, attention_mask=mask).logits,
            ours(ids, attention_mask=mask).logits,
        )
    real = mask.bool()
    assert (theirs[real] - mine[real]).abs().max() <= TOLERANCE


# ---- file layouts and old names ----


def _gpt2_state(tmp_path):
    torch.manual_seed(0)
    hf_model = perturbed(GPT2LMHeadModel(gpt2()))
    hf_model.save_pretrained(tmp_path / "reference")
    state = {k: v.clone() for k, v in hf_model.state_dict().items()}
    return hf_model, state


def test_pytorch_model_bin_with_old_mask_buffers_and_no_lm_head(tmp_path):
    hf_model, state = _gpt2_state(tmp_path)
    del state["lm_head.weight"]  # tied: absent from the file
    for i in range(2):  # buffers that files from older transformers versions carry
        state[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 40, 40))
        state[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    folder = tmp_path / "bin"
    folder.mkdir()
    torch.save(state, folder / "pytorch_model.bin")
    (folder / "config.json").write_text((tmp_path / "reference" / "config.json").read_text())
    ours = flashformer.from_pretrained(folder)
    ids, mask = inputs()
    assert_close(our_outputs(ours, ids, mask), hf_outputs(hf_model, ids, mask), "pytorch_model.bin")


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_sharded_checkpoints(tmp_path, kind):
    hf_model, state = _gpt2_state(tmp_path)
    names = sorted(state)
    shards = {f"model-0000{i + 1}-of-00002.{kind}": names[i::2] for i in range(2)}
    folder = tmp_path / "sharded"
    folder.mkdir()
    for shard, shard_names in shards.items():
        part = {name: state[name].contiguous() for name in shard_names}
        if kind == "safetensors":
            part.pop("lm_head.weight", None)  # shares wte's storage; tied, so absent is fine
            save_file(part, folder / shard, metadata={"format": "pt"})
        else:
            torch.save(part, folder / shard)
    weight_map = {name: shard for shard, shard_names in shards.items() for name in shard_names}
    if kind == "safetensors":
        weight_map.pop("lm_head.weight")
    index = "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
    (folder / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text((tmp_path / "reference" / "config.json").read_text())
    ours = flashformer.from_pretrained(folder)
    ids, mask = inputs()
    assert_close(our_outputs(ours, ids, mask), hf_outputs(hf_model, ids, mask), f"sharded {kind}")


def test_bert_gamma_beta_names(tmp_path):
    torch.manual_seed(0)
    hf_model = perturbed(BertForMaskedLM(bert()))
    hf_model.save_pretrained(tmp_path / "reference")
    weights = load_file(tmp_path / "reference" / "model.safetensors")
    renamed = {
        name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): t
        for name, t in weights.items()
    }
    assert any(name.endswith("gamma") for name in renamed)
    folder = tmp_path / "old"
    folder.mkdir()
    save_file(renamed, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text((tmp_path / "reference" / "config.json").read_text())
    ids, mask = inputs()
    assert_close(
        our_outputs(flashformer.from_pretrained(folder), ids, mask),
        hf_outputs(hf_model, ids, mask),
        "gamma/beta",
    )


def test_bfloat16_dtype_on_load(tmp_path):
    torch.manual_seed(0)
    perturbed(LlamaForCausalLM(llama())).save_pretrained(tmp_path)
    model = flashformer.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.decoder.positions.inv_freq.dtype == torch.float32  # frequencies stay exact


# ---- what is not supported is refused ----


def _write(tmp_path, model, **config_changes):
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(config_changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "make, changes, message",
    [
        (
            lambda: BertModel(bert()),
            {"position_embedding_type": "relative_key"},
            r"position_embedding_type='relative_key'",
        ),
        (
            lambda: GPT2LMHeadModel(gpt2()),
            {"scale_attn_by_inverse_layer_idx": True},
            r"scale_attn_by_inverse_layer_idx",
        ),
        (
            lambda: LlamaForCausalLM(llama()),
            {"rope_parameters": {"rope_type": "longrope", "factor": 2.0}},
            r"LongRoPE needs rope_parameters\.short_factor, a list; got None",
        ),
        (lambda: LlamaForCausalLM(llama()), {"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
        (
            lambda: Qwen2ForCausalLM(hf_config("qwen2")),
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None},
            r"use_sliding_window=True .* gives layers \[1\]",
        ),
        (
            lambda: Phi3ForCausalLM(hf_config("phi3")),
            {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
            r"rope type 'yarn' is not supported for phi3",
        ),
        (lambda: Phi3ForCausalLM(hf_config("phi3")), {"sliding_window": 16}, r"sliding_window=16 is shorter"),
        (
            lambda: T5ForConditionalGeneration(t5()),
            {"feed_forward_proj": "gated-gelu-x"},
            r"feed_forward_proj",
        ),
        (lambda: BertModel(bert()), {"model_type": "roberta"}, r"model_type 'roberta' is not supported"),
        (lambda: BertModel(bert()), {"hidden_act": "gelu_10"}, r"hidden_act='gelu_10'"),
    ],
)
def test_unsupported_config_options_are_refused(tmp_path, make, changes, message):
    folder = _write(tmp_path, make(), **changes)
    with pytest.raises(ValueError, match=message):
        flashformer.from_pretrained(folder)


def test_unknown_heads_are_refused(tmp_path):
    from transformers import BertForQuestionAnswering

    # (the sequence and token classifiers load: tests/test_heads.py)
    folder = _write(tmp_path, BertForQuestionAnswering(bert()))
    with pytest.raises(ValueError, match=r"no place for.*qa_outputs\.weight"):
        flashformer.from_pretrained(folder)


def test_missing_tensors_are_named(tmp_path):
    folder = _write(tmp_path, GPT2LMHeadModel(gpt2()))
    weights = load_file(folder / "model.safetensors")
    del weights["transformer.h.1.mlp.c_fc.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensors: \['h.1.mlp.c_fc.weight'\]"):
        flashformer.from_pretrained(folder)


def test_configs_without_a_counterpart_are_not_saved(tmp_path):
    with pytest.raises(
        ValueError, match=r"ModelConfig.position='rope' cannot be saved as a Hugging Face gpt2"
    ):
        flashformer.build("gpt2-tiny", position="rope").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"share_layers=True"):
        flashformer.build("bert-tiny", share_layers=True).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"no Hugging Face counterpart"):
        flashformer.build("gpt2-tiny", hf_model_type=None).save_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["bert-tiny", "gpt2-tiny", "t5-tiny", "llama-tiny"])
def test_presets_save_as_transformers_models(tmp_path, name):
    """A model built by flashformer (not loaded) saves into transformers with its outputs."""
    model = flashformer.build(name).eval()
    model.save_pretrained(tmp_path)
    architecture = json.loads((tmp_path / "config.json").read_text())["architectures"][0]
    theirs = getattr(transformers, architecture).from_pretrained(tmp_path).eval()
    ids, mask = torch.randint(0, 1000, (2, 11)), torch.ones(2, 11, dtype=torch.long)
    mask[1, 7:] = 0
    with torch.no_grad():
        if name.startswith("t5"):
            a = model(ids, attention_mask=mask, decoder_input_ids=ids[:, :6]).logits
            b = theirs(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :6]).logits
        else:
            a, b = model(ids, attention_mask=mask).logits, theirs(input_ids=ids, attention_mask=mask).logits
    assert (a - b).abs().max() <= TOLERANCE
