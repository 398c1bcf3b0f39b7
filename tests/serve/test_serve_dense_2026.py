"""SmolLM3 (NoPE layers) and Phi-4-mini (LongRoPE, original context 32) served: tiny random models
of transformers' own classes with heads of 32 (one q8_0 block a head). Concurrent greedy requests
through the native decoder and the paged pool get the library's tokens, with a long system prompt
found in the prefix cache (for Phi-4-mini, prompts on either side of the original context share
it); speculative decoding (prompt lookup, the model as its own draft) keeps greedy's tokens; a
q8_0 pool decodes natively as generate() does over a static q8_0 cache; a JSON schema holds the
answer, through the openai client."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from helpers import perturbed, relative_error
from helpers.dense_2026 import CITY, ORIGINAL_CONTEXT, PHI4_MINI_SHAPED, VOCAB, tiny_phi4_mini, tiny_smollm3
from helpers.engine import run_requests
from helpers.gguf import tiny_vocabulary
from test_serve import openai_client, serving

import flashformer
from flashformer.checkpoints.gguf.tokenizer import tokenizer_from_metadata
from flashformer.generate import speculative
from flashformer.model.native import native_decoder
from flashformer.serve.engine import Engine
from flashformer.serve.request import SamplingParams
from flashformer.serve.speculation import SpeculativeConfig

NEW_TOKENS = 8
FAMILIES = ["smollm3", "phi4-mini"]


def build(family: str, vocab_size: int = VOCAB):
    """Weights moved far enough that greedy does not settle on one token."""
    if family == "smollm3":  # 5 layers: the fourth rotates nothing
        return perturbed(tiny_smollm3(hidden_size=128, head_dim=32, vocab_size=vocab_size), scale=0.6)
    return perturbed(tiny_phi4_mini(head_dim=32, vocab_size=vocab_size), scale=0.6)


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory):
    """(family, the library's model on the float native decoder, the tiny vocabulary's tokenizer)."""
    folder = tmp_path_factory.mktemp(request.param)
    build(request.param).save_pretrained(folder)
    model = flashformer.from_pretrained(folder).eval()
    assert native_decoder(model) is not None
    return request.param, model, tokenizer_from_metadata(tiny_vocabulary())


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = random_ids(20, 1)  # a long system prompt: two and a half blocks of 8


def prompts_of(seed: int) -> list[list[int]]:
    """Four at once: two behind SYSTEM, within and past Phi-4-mini's original context (32), and two
    of their own on either side of it."""
    return [
        SYSTEM + random_ids(6, seed),
        SYSTEM + random_ids(ORIGINAL_CONTEXT - 12, seed + 1),
        random_ids(ORIGINAL_CONTEXT + 6, seed + 2),
        random_ids(9, seed + 3),
    ]


def library(
    model, prompt: list[int], new_tokens: int = NEW_TOKENS, **options
) -> tuple[list[int], list[float]]:
    """The library's greedy tokens for one prompt alone and their log-probabilities."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, eos_token_id=[], do_sample=False,
        return_dict_in_generate=True, output_logits=True, **options,
    )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [float(torch.log_softmax(step[0], -1)[t]) for step, t in zip(out.logits, tokens)]


def run(engine: Engine, prompts, new_tokens: int = NEW_TOKENS) -> list[dict]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, logprobs=0)
    return run_requests(engine, [(prompt, params) for prompt in prompts])


def engine_of(model, tokenizer, **options) -> Engine:
    return Engine(model, tokenizer, max_batch=4, num_blocks=64, block_size=8, prefill_chunk=64, **options)


def test_concurrent_greedy_is_the_library_s_with_the_prefix_cache(served):
    _, model, tokenizer = served
    engine = engine_of(model, tokenizer)
    for seed in (10, 20):  # the second round finds SYSTEM's blocks in the pool
        prompts = prompts_of(seed)
        for got, prompt in zip(run(engine, prompts), prompts):
            tokens, logprobs = library(model, prompt)
            assert got["tokens"] == tokens
            assert max(abs(a[1] - b) for a, b in zip(got["logprobs"], logprobs)) < 1e-4
    # the second round's two prompts behind SYSTEM found its two full blocks (Phi-4-mini's long
    # prompt those its long side wrote in the first round, the short one the short side's)
    assert engine.stats["prefix_cache_hits"] == 2 * 16


def test_speculative_decoding_keeps_greedy_tokens(served, tmp_path):
    """Prompts that repeat themselves (lookup's drafts) and the model drafting for itself, alone
    and batched: for Phi-4-mini one answer crosses the original context (no verify may cross it:
    its last token would turn long), one starts past it."""
    family, model, tokenizer = served
    speculative._ROW_COSTS[model] = {"PromptLookup": 0.2, "DraftModel": 0.5}  # as the server tests fix them
    prompts = [random_ids(6, 30) * 4, random_ids(9, 31) * 4]  # 24 and 36 tokens
    plain = [run(engine_of(model, tokenizer), [prompt], new_tokens=16)[0] for prompt in prompts]
    configs = {
        "ngram": (SpeculativeConfig(num_speculative_tokens=4), None),
        "draft_model": (
            SpeculativeConfig(method="draft_model", model=str(tmp_path), num_speculative_tokens=4),
            model,
        ),
    }
    for method, (config, draft) in configs.items():
        # a random model copies nothing: lookup's drafts are checked, the model's own are kept
        counted = "speculative_accepted_tokens" if draft is not None else "speculative_drafted_tokens"
        count = 0
        for jobs in [prompts[:1], prompts[1:], prompts]:
            engine = engine_of(model, tokenizer, speculative=config, draft_model=draft)
            assert run(engine, jobs, new_tokens=16) == [plain[prompts.index(p)] for p in jobs], method
            count += engine.stats[counted]
        assert count > 0, method


def test_a_q8_0_pool_decodes_natively_as_a_static_q8_0_cache(served):
    """As test_serve_cache_types asks of SmolLM2: the served tokens are generate()'s over a static
    cache of the same types, and the eager modules (native=False) choose them too."""
    _, model, tokenizer = served
    engine = engine_of(model, tokenizer, **Q8_0)
    assert engine.runner.caches[0].k.dtype == torch.uint8
    prompts = prompts_of(40)
    for got, prompt in zip(run(engine, prompts), prompts):
        tokens, logprobs = library(model, prompt, **Q8_0)
        assert got["tokens"] == tokens
        assert max(abs(a[1] - b) for a, b in zip(got["logprobs"], logprobs)) < 1e-4
        assert library(model, prompt, native=False, **Q8_0)[0] == tokens


Q8_0 = dict(cache_type_k="q8_0", cache_type_v="q8_0")


def q8_0_error(hf_model, folder) -> float:
    """The largest error of the logits of a prompt's first two steps over a q8_0 cache against a
    float one (relative to the largest logit), over prompts_of's four."""
    hf_model.save_pretrained(folder)
    model = flashformer.from_pretrained(folder).eval()
    worst = 0.0
    for prompt in prompts_of(50):
        steps = [
            model.generate(
                torch.tensor([prompt]), max_new_tokens=2, eos_token_id=[], do_sample=False,
                return_dict_in_generate=True, output_logits=True, **types,
            ).logits
            for types in ({}, Q8_0)
        ]  # fmt: skip
        worst = max(worst, *(relative_error(q[0], f[0]) for f, q in zip(*steps)))
    return worst


@pytest.mark.parametrize("family", FAMILIES)
def test_a_q8_0_cache_errs_as_a_llama_s_of_the_same_shape(family, tmp_path):
    """The helpers' models as they are (the served ones' larger weights make any model's attention
    sharp enough to turn q8_0's rounding into several percent, a LLaMA's alike): 0.2-0.7% measured,
    a LLaMA of the same heads 0.3-0.6%."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
        )
    ).eval()  # fmt: skip
    mine = tiny_smollm3(hidden_size=128, head_dim=32) if family == "smollm3" else tiny_phi4_mini(head_dim=32)
    error = q8_0_error(mine, tmp_path / family)
    assert error < min(0.01, 2 * q8_0_error(llama, tmp_path / "llama"))


SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_json_schema_holds_the_answer_through_the_openai_client(family, tmp_path):
    from flashformer.checkpoints.gguf.packaged_models import smollm2_path
    from flashformer.checkpoints.gguf.tokenizer import read_tokenizer

    tokenizer = read_tokenizer(smollm2_path())  # SmolLM2's, with its chat template
    build(family, vocab_size=tokenizer.vocab_size).save_pretrained(tmp_path)
    tokenizer.save(tmp_path)
    with serving(tmp_path, "--max-batch", "4", "--kv-blocks", "64") as url:
        client = openai_client(url)
        replies = [
            client.chat.completions.create(
                model=tmp_path.name,
                messages=[{"role": "user", "content": f"Weather {i}, as JSON."}],
                max_tokens=40,
                temperature=temperature,
                seed=i,
                response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}},
            )  # fmt: skip
            for i, temperature in enumerate((0, 0.8))
        ]
    for reply in replies:
        assert reply.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)


def test_phi4_mini_s_tools_render_and_required_calls_validate(tmp_path):
    """Through a template of Phi-4-mini's shape (helpers/dense_2026.py): the prompt is the
    template's own rendering of the tools (as transformers renders it), the format of its free
    answers Phi-4-mini's, and `required` gives calls that validate, streamed as whole."""
    from transformers import AutoTokenizer

    from flashformer.checkpoints.gguf.packaged_models import smollm2_path
    from flashformer.checkpoints.gguf.tokenizer import read_tokenizer
    from flashformer.text.tool_calls import format_of_template

    assert format_of_template(PHI4_MINI_SHAPED) == "phi4_mini_json"
    tokenizer = read_tokenizer(smollm2_path())
    build("phi4-mini", vocab_size=tokenizer.vocab_size).save_pretrained(tmp_path)
    tokenizer.chat_template = PHI4_MINI_SHAPED
    tokenizer.save(tmp_path)
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    expected = theirs.apply_chat_template(
        question, tools=[CITY], add_generation_prompt=True, return_dict=False
    )
    assert "<|tool|>" in theirs.decode(expected)
    kwargs = dict(model=tmp_path.name, messages=question, tools=[CITY], tool_choice="required", max_tokens=120,
                  temperature=0)  # fmt: skip
    with serving(tmp_path, "--max-batch", "4", "--kv-blocks", "64") as url:
        client = openai_client(url)
        whole = client.chat.completions.create(**kwargs)
        streamed: dict[int, list[str]] = {}
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for piece in chunk.choices[0].delta.tool_calls or []:
                call = streamed.setdefault(piece.index, ["", ""])
                call[0] += piece.function.name or ""
                call[1] += piece.function.arguments or ""
    assert whole.usage.prompt_tokens == len(expected)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    calls = [(call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    for name, arguments in calls:
        assert name == "weather"
        jsonschema.validate(json.loads(arguments), CITY["function"]["parameters"])
    assert [tuple(streamed[i]) for i in sorted(streamed)] == calls
