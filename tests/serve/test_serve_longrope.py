"""A LongRoPE model (a tiny Phi-4-mini: original context 32) served: requests on either side of the
switch to the long factors run together in one step, and each gets the tokens the library gives it
alone, through the native decoder (it chooses per sequence) and through the modules' packed step
(a quantized model without the native decoder: the runner gives each side a forward of its own)."""

from __future__ import annotations

import pytest
import torch
from helpers.dense_2026 import ORIGINAL_CONTEXT, tiny_phi4_mini
from helpers.engine import run_requests
from helpers.gguf import tiny_vocabulary

import flashformer
from flashformer.checkpoints.gguf.tokenizer import tokenizer_from_metadata
from flashformer.model.native import native_decoder
from flashformer.serve.engine import Engine
from flashformer.serve.request import SamplingParams

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("phi4_mini_served")
    tiny_phi4_mini().save_pretrained(path)
    return path


@pytest.mark.parametrize("native", [True, False])
def test_sequences_on_either_side_of_the_switch_get_their_library_tokens(folder, native):
    model = flashformer.from_pretrained(folder, quantize=None if native else "int8").eval()
    assert native_decoder(model) is not None  # int8 has a native form: native=False keeps it out
    generator = torch.Generator().manual_seed(7)
    # past the original context from the prompt on, crossing it while decoding, and within it
    prompts = [
        torch.randint(3, 275, (n,), generator=generator).tolist() for n in (ORIGINAL_CONTEXT + 4, 26, 6)
    ]
    expected = []  # the library's tokens and their log-probabilities, each prompt alone
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, eos_token_id=[], native=native,
            return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = [float(torch.log_softmax(step[0], -1)[t]) for step, t in zip(out.logits, tokens)]
        expected.append((tokens, logprobs))
    engine = Engine(
        model, tokenizer_from_metadata(tiny_vocabulary()), max_batch=4, num_blocks=64, block_size=8,
        prefill_chunk=64, native=native,
    )  # fmt: skip
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=0)
    got = run_requests(engine, [(prompt, params) for prompt in prompts])
    for served, (tokens, logprobs) in zip(got, expected):
        assert served["tokens"] == tokens
        # the logits themselves, which the tokens of so small a model may not show
        assert max(abs(a[1] - b) for a, b in zip(served["logprobs"], logprobs)) < 1e-4
