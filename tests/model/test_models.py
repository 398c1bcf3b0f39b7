"""The three model families built from configs: outputs, losses, input checks,
the KV-cache hook, layer sharing, checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import TestCache

import flashformer
from flashformer.model.config import ModelConfig
from flashformer.model.models import DecoderModel, EncoderDecoderModel, EncoderModel
from flashformer.model.positional import RopeScaling
from flashformer.model.presets import PRESETS, preset

TINY = ["bert-tiny", "gpt2-tiny", "t5-tiny", "llama-tiny"]


def run(model, ids, **kwargs):
    if isinstance(model, EncoderDecoderModel):
        kwargs.setdefault("decoder_input_ids", ids[:, :5])
    return model(ids, **kwargs)


@pytest.mark.parametrize("name", TINY)
def test_presets_build_and_give_shaped_outputs(name):
    model = flashformer.build(name).eval()
    ids = torch.randint(0, 1000, (2, 9))
    out = run(model, ids)
    length = 5 if name.startswith("t5") else 9
    assert out.logits.shape == (2, length, 1000)
    assert out.last_hidden_state.shape == (2, length, 64)
    assert out.loss is None
    expected_class = {
        "bert": EncoderModel,
        "gpt2": DecoderModel,
        "t5": EncoderDecoderModel,
        "llama": DecoderModel,
    }
    assert isinstance(model, expected_class[name.split("-")[0]])


def test_full_presets_have_the_published_sizes():
    # the originals' counts: GPT-2 124,439,808 (tied head); t5-small 60,506,624; BERT-base
    # with both pretraining heads 110,106,428, less the next-sentence head (768 * 2 + 2) that
    # EncoderModel does not have
    assert _count("gpt2") == 124_439_808
    assert _count("t5-small") == 60_506_624
    assert _count("bert-base") == 110_106_428 - (768 * 2 + 2)


def _count(name):
    with torch.device("meta"):
        return flashformer.build(name).num_parameters()


def test_decoder_loss_is_next_token_cross_entropy():
    model = flashformer.build("gpt2-tiny").eval()
    ids = torch.randint(0, 1000, (2, 9))
    labels = ids.clone()
    labels[0, 4] = -100
    out = model(ids, labels=labels)
    logits = out.logits.double()
    terms = [
        F.cross_entropy(logits[b, t], labels[b, t + 1])
        for b in range(2)
        for t in range(8)
        if labels[b, t + 1] != -100
    ]
    assert abs(out.loss.item() - torch.stack(terms).mean().item()) < 1e-5


def test_encoder_decoder_loss_shifts_labels_into_decoder_inputs():
    model = flashformer.build("t5-tiny").eval()
    ids, labels = torch.randint(0, 1000, (2, 9)), torch.randint(0, 1000, (2, 6))
    labels[1, 4:] = -100
    out = model(ids, labels=labels)
    shifted = torch.cat((torch.zeros(2, 1, dtype=torch.long), labels[:, :-1]), dim=1).clamp(
        min=0
    )  # -100 -> pad 0
    again = model(ids, decoder_input_ids=shifted)
    assert torch.equal(out.logits, again.logits)
    expected = F.cross_entropy(again.logits.reshape(-1, 1000), labels.reshape(-1), ignore_index=-100)
    assert abs(out.loss.item() - expected.item()) < 1e-6


# ---- bad inputs: ValueError before any compute ----


def _bad_calls():
    ids = torch.randint(0, 1000, (2, 9))
    return [
        (
            "gpt2-tiny",
            dict(input_ids=torch.tensor([[1, 1000]])),
            r"input_ids must be in \[0, vocab_size=1000\).*1000",
        ),
        ("gpt2-tiny", dict(input_ids=torch.tensor([[1, -3]])), r"input_ids must be in.*-3"),
        (
            "llama-tiny",
            dict(input_ids=ids.float()),
            r"input_ids must hold integer token ids; got dtype torch.float32",
        ),
        (
            "gpt2-tiny",
            dict(input_ids=torch.zeros(1, 129, dtype=torch.long)),
            r"position 128, beyond the 128 learned",
        ),
        (
            "bert-tiny",
            dict(input_ids=ids, attention_mask=torch.ones(2, 8)),
            r"attention_mask must have shape \(2, 9\)",
        ),
        (
            "gpt2-tiny",
            dict(input_ids=ids[0]),
            r"input_ids must have shape \(batch, length\); got shape \(9,\)",
        ),
        (
            "bert-tiny",
            dict(input_ids=ids, token_type_ids=torch.full((2, 9), 2)),
            r"type_vocab_size=2\); got 2",
        ),
        (
            "gpt2-tiny",
            dict(input_ids=ids, token_type_ids=torch.zeros(2, 9, dtype=torch.long)),
            r"no token types",
        ),
        ("gpt2-tiny", dict(input_ids=ids, labels=torch.full((2, 9), 1000)), r"labels must be in.*got 1000"),
        ("gpt2-tiny", dict(input_ids=ids, labels=ids[:, :4]), r"labels must have shape \(2, 9\)"),
        ("t5-tiny", dict(input_ids=ids), r"needs decoder_input_ids \(or labels"),
        (
            "t5-tiny",
            dict(input_ids=ids, decoder_input_ids=ids.float()),
            r"decoder_input_ids must hold integer",
        ),
        (
            "t5-tiny",
            dict(input_ids=ids, decoder_input_ids=ids, decoder_attention_mask=torch.ones(2, 3)),
            r"decoder_attention_mask must have shape \(2, 9\)",
        ),
    ]


@pytest.mark.parametrize("name, kwargs, message", _bad_calls())
def test_bad_inputs_raise_before_any_compute(name, kwargs, message):
    model = flashformer.build(name)
    calls = []
    model.embeddings.register_forward_pre_hook(lambda module, args: calls.append(1))
    with pytest.raises(ValueError, match=message):
        model(**kwargs)
    assert calls == []


def test_bad_configs_name_the_field():
    with pytest.raises(ValueError, match=r"ModelConfig.norm must be one of"):
        ModelConfig(norm="batchnorm")
    with pytest.raises(ValueError, match=r"n_heads \(6\) must be a multiple of n_kv_heads \(4\)"):
        ModelConfig(d_model=48, n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match=r"unknown preset 'gpt5'"):
        flashformer.build("gpt5")
    with pytest.raises(ValueError, match=r"unknown ModelConfig fields: \['layers'\]"):
        flashformer.build("gpt2-tiny", layers=3)


def test_config_round_trips_through_a_dict():
    config = preset("llama-tiny", rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64))
    assert ModelConfig.from_dict(config.to_dict()) == config
    assert set(PRESETS) >= {"bert-base", "gpt2", "t5-small", "llama-small", *TINY}


# ---- the KV-cache hook ----


@pytest.mark.parametrize(
    "name, changes",
    [
        ("gpt2-tiny", {}),
        ("llama-tiny", {"rope_scaling": RopeScaling("llama3", 4.0, 1.0, 4.0, 16)}),
        ("llama-tiny", {"position": "alibi"}),
        ("gpt2-tiny", {"position": "sinusoidal"}),
        ("t5-tiny", {}),
    ],
)
def test_decoding_with_a_cache_gives_the_full_sequence_outputs(name, changes):
    """Prefill 5 tokens then feed 1, then 3: the logits equal one full pass,
    so positions, masks and biases all follow the cache offset."""
    model = flashformer.build(name, **changes).eval()
    ids = torch.randint(0, 1000, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 0] = 0  # a padded first token stays masked in every later step
    with torch.no_grad():
        if isinstance(model, EncoderDecoderModel):
            source = torch.randint(0, 1000, (2, 7))
            memory = model.encode(source)
            full = model(decoder_input_ids=ids, decoder_attention_mask=mask, encoder_outputs=memory).logits

            def step(start, end, caches):
                return model(
                    decoder_input_ids=ids[:, start:end],
                    decoder_attention_mask=mask[:, :end],
                    encoder_outputs=memory,
                    kv_caches=caches,
                    cache_position=start,
                ).logits
        else:
            full = model(ids, attention_mask=mask).logits

            def step(start, end, caches):
                return model(
                    ids[:, start:end], attention_mask=mask[:, :end], kv_caches=caches, cache_position=start
                ).logits

        caches = [TestCache() for _ in range(model.config.n_decoder_layers)]
        pieces = [step(start, end, caches) for start, end in ((0, 5), (5, 6), (6, 9))]
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-5


# ---- sharing, checkpointing, dropout ----


def test_albert_style_sharing_uses_one_block_for_every_layer():
    shared = flashformer.build("bert-tiny", share_layers=True, n_layers=4).eval()
    unshared = flashformer.build("bert-tiny", n_layers=4).eval()
    block_size = sum(p.numel() for p in unshared.encoder.blocks[0].parameters())
    assert unshared.num_parameters() - shared.num_parameters() == 3 * block_size
    # the same computation as four blocks holding equal weights
    with torch.no_grad():
        for block in unshared.encoder.blocks:
            block.load_state_dict(shared.encoder.blocks[0].state_dict())
        for name in ("embeddings", "pooler", "mlm_head"):
            getattr(unshared, name).load_state_dict(getattr(shared, name).state_dict())
    ids = torch.randint(0, 1000, (2, 9))
    assert torch.equal(shared(ids).logits, unshared(ids).logits)


@pytest.mark.parametrize("name", ["gpt2-tiny", "t5-tiny"])
def test_activation_checkpointing_gives_the_same_gradients(name):
    torch.manual_seed(0)
    plain = flashformer.build(name, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0).train()
    checkpointed = flashformer.build(name, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.decoder.activation_checkpointing = True
    checkpointed.train()
    ids = torch.randint(0, 1000, (2, 9))
    for model in (plain, checkpointed):
        run(model, ids, labels=ids[:, :5] if name.startswith("t5") else ids).loss.backward()
    for (name_a, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name_a


def test_dropout_only_in_training():
    model = flashformer.build("bert-tiny")
    ids = torch.randint(0, 1000, (2, 9))
    model.train()
    assert not torch.equal(model(ids).logits, model(ids).logits)
    model.eval()
    assert torch.equal(model(ids).logits, model(ids).logits)


@pytest.mark.parametrize("name", TINY)
def test_bf16_autocast_training_step(name):
    model = flashformer.build(name, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    ids = torch.randint(0, 1000, (2, 9))
    labels = ids[:, :5] if name.startswith("t5") else ids
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = run(model, ids, labels=labels)
    low.loss.backward()
    full = run(model, ids, labels=labels)
    assert low.logits.dtype == torch.bfloat16
    assert abs(low.loss.item() - full.loss.item()) < 0.02 * full.loss.item()
    for parameter_name, p in model.named_parameters():
        if not parameter_name.startswith("pooler"):  # the pooler does not feed the loss
            assert p.grad is not None and torch.isfinite(p.grad).all(), parameter_name
