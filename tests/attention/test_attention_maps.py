"""output_attentions=True: every layer's attention probabilities, against
transformers' eager attention on the same checkpoint, with padding."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import VOCAB, hf_config, perturbed
from transformers import BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM, T5ForConditionalGeneration

import flashformer

transformers.logging.set_verbosity_error()
BATCH, LENGTH, DECODER_LENGTH = 2, 11, 7
CASES = {
    "bert": lambda: BertForMaskedLM(hf_config("bert")),
    "gpt2": lambda: GPT2LMHeadModel(hf_config("gpt2")),
    "t5": lambda: T5ForConditionalGeneration(hf_config("t5")),
    "llama": lambda: LlamaForCausalLM(hf_config("llama")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_attention_maps_match_transformers(name, tmp_path):
    torch.manual_seed(0)
    theirs = perturbed(CASES[name]())
    theirs.save_pretrained(tmp_path)
    theirs = type(theirs).from_pretrained(tmp_path, attn_implementation="eager").eval()
    ours = flashformer.from_pretrained(tmp_path)

    ids = torch.randint(0, VOCAB, (BATCH, LENGTH))
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, 8:] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, output_attentions=True)
    if name == "t5":
        kwargs["decoder_input_ids"] = ids[:, :DECODER_LENGTH]
    with torch.no_grad():
        expected, got = theirs(**kwargs), ours(**kwargs)
        exact = theirs.double()(**kwargs)  # the reference: transformers in float64

    kinds = [("attentions", "decoder_attentions" if name == "t5" else "attentions")]
    if name == "t5":
        kinds += [("encoder_attentions", "encoder_attentions"), ("cross_attentions", "cross_attentions")]
    for ours_name, theirs_name in kinds:
        mine, reference, float64 = (
            getattr(got, ours_name),
            getattr(expected, theirs_name),
            getattr(exact, theirs_name),
        )
        assert len(mine) == len(reference), (
            f"{name} {ours_name}: {len(mine)} layers, transformers {len(reference)}"
        )
        for layer, (a, b, c) in enumerate(zip(mine, reference, float64)):
            assert a.shape == b.shape, (
                f"{name} {ours_name} layer {layer}: {tuple(a.shape)} vs {tuple(b.shape)}"
            )
            # float32 against float64: within twice transformers' own float32 error (and 1e-5 absolute)
            error, theirs_error = (a.double() - c).abs().max().item(), (b.double() - c).abs().max().item()
            assert error <= max(2 * theirs_error, 1e-5), (
                f"{name} {ours_name} layer {layer}: probabilities {error:.2e} from float64, "
                f"transformers' float32 {theirs_error:.2e}"
            )
    assert got.attentions[0].sum(-1)[0].allclose(torch.ones(1)), "rows of real queries sum to 1"


def test_maps_are_not_recorded_by_default_and_backend_is_untouched():
    model = flashformer.build("gpt2-tiny", attention_backend="flash").eval()
    ids = torch.randint(0, 1000, (1, 9))
    with torch.no_grad():
        plain = model(ids)
        recorded = model(ids, output_attentions=True)
    assert plain.attentions is None
    assert len(recorded.attentions) == model.config.n_layers
    assert recorded.attentions[0].shape == (1, model.config.n_heads, 9, 9)
    assert torch.allclose(plain.logits, recorded.logits, atol=1e-5)  # eager and flash agree
    assert model.decoder.blocks[0].attn.backend == "flash"
