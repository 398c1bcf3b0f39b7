"""LoRA adapters served per request: `flashformer serve BASE --lora NAME=PATH ...`. A request whose
`model` is an adapter's name runs with it, the base's name without any, one batch mixing them; the
reference is the library's own greedy with the same adapter (flashformer.load(..., adapters=...)),
which tests/adapters/ holds to peft. The prefix cache must keep each adapter's blocks apart: the
same prompt under two adapters gives each its own answer."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from helpers import tiny_chat_folder
from helpers.engine import run_requests
from test_serve import http, openai_client, serving, start_server

import flashformer
from flashformer.cli.serve import served_adapters
from flashformer.serve.engine import Engine
from flashformer.serve.request import Request, SamplingParams

pytest.importorskip("peft")

PROMPTS = [[1, 504, 2931, 314, 253], [1, 3144, 28, 1543, 30, 2203, 17], [1, 504, 2931, 314, 253]]
NEW_TOKENS = 8


def peft_folder(base_folder, folder, seed: int):
    """A random PEFT adapter on the tiny LLaMA (B nonzero, large enough to change greedy choices)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder)
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(base folder, {adapter name: PEFT folder}) for two adapters."""
    root = tmp_path_factory.mktemp("served-lora")
    base = tiny_chat_folder(root / "base", max_positions=256)
    adapters = {name: peft_folder(base, root / name, seed) for name, seed in (("math", 1), ("poem", 2))}
    return base, adapters


def library_greedy(
    base, adapters: dict, adapter: str | None, prompt: list[int], quantize="auto"
) -> list[int]:
    """What generate() chooses greedily with `adapter` alone loaded (None: the base)."""
    chosen = None if adapter is None else {adapter: adapters[adapter]}
    model, tokenizer = flashformer.load(base, quantize=quantize, adapters=chosen)
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, eos_token_id=tokenizer.stop_token_ids
    )
    return out[0, len(prompt) :].tolist()


def greedy(adapter: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, adapter=adapter)


@pytest.mark.parametrize("quantize", ["auto", "int8"])  # float: padded decode steps; int8: packed steps
def test_one_batch_of_two_adapters_and_the_base_equals_the_library(folders, quantize):
    base, adapters = folders
    model, tokenizer = flashformer.load(base, quantize=quantize, adapters=adapters)
    engine = Engine(model, tokenizer, max_batch=4, num_blocks=32, block_size=4)
    assert engine.adapters == ("math", "poem") and engine.runner.native is None
    assert engine.pad_decode == (quantize == "auto")
    chosen = ["math", "poem", None]
    results = run_requests(engine, [(p, greedy(a)) for p, a in zip(PROMPTS, chosen)])
    expected = [library_greedy(base, adapters, a, p, quantize) for p, a in zip(PROMPTS, chosen)]
    assert [r["tokens"] for r in results] == expected
    base_alone = library_greedy(base, adapters, None, PROMPTS[0], quantize)
    assert expected[0] != base_alone, "the adapter must change the greedy answer"


def test_the_prefix_cache_keeps_each_adapters_blocks_apart(folders):
    base, adapters = folders
    model, tokenizer = flashformer.load(base, adapters=adapters)
    # a float model's prompt blocks are cached in whole prefill chunks (scheduler.py): chunks of 4
    engine = Engine(model, tokenizer, max_batch=4, num_blocks=64, block_size=4, prefill_chunk=4)
    prompt = list(range(1, 14)) + [504, 2931, 314]  # 16 tokens: several full blocks to share
    answers = {}
    for adapter in ["math", "poem", None, "math"]:  # one after the other: the earlier blocks are cached
        hits = engine.scheduler.cache_hits
        tokens = run_requests(engine, [(prompt, greedy(adapter))])[0]["tokens"]
        answers.setdefault(adapter, []).append(tokens)
        reused = engine.scheduler.cache_hits - hits
        assert (reused > 0) == (len(answers[adapter]) > 1), (adapter, reused)  # only its own blocks
    for adapter, got in answers.items():
        assert all(tokens == library_greedy(base, adapters, adapter, prompt) for tokens in got), adapter
    assert len({tuple(got[0]) for got in answers.values()}) == 3


def test_an_unknown_adapter_is_refused_by_name(folders):
    base, adapters = folders
    model, tokenizer = flashformer.load(base, adapters={"math": adapters["math"]})
    engine = Engine(model, tokenizer, max_batch=2, num_blocks=16)
    with pytest.raises(ValueError, match="adapter 'poem' is not loaded"):
        run_requests(engine, [(PROMPTS[0], greedy("poem"))])


# ---- the server ----


@pytest.fixture(scope="module")
def served(folders):
    base, adapters = folders
    flags = [f"--lora={name}={path}" for name, path in adapters.items()]
    with serving(base, "--max-batch", "4", "--kv-blocks", "64", "--api-key", "k", *flags) as url:
        yield url


def test_models_list_the_base_and_every_adapter(served, folders):
    base, _ = folders
    models = openai_client(served, "k").models.list().data
    assert [m.id for m in models] == [base.name, "math", "poem"]
    assert [getattr(m, "parent", None) for m in models] == [None, base.name, base.name]


def test_concurrent_requests_of_two_adapters_and_the_base_answer_as_the_library(served, folders):
    from concurrent.futures import ThreadPoolExecutor

    base, adapters = folders
    client = openai_client(served, "k")
    chosen = [("math", PROMPTS[0]), ("poem", PROMPTS[1]), (base.name, PROMPTS[2])]

    def ask(job):
        name, prompt = job
        reply = client.completions.create(model=name, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
        return reply.model, reply.choices[0].text

    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(ask, chosen))
    _, tokenizer = flashformer.load(base)
    for (name, prompt), (model, text) in zip(chosen, replies):
        adapter = None if name == base.name else name
        assert model == name
        assert text == tokenizer.decode(library_greedy(base, adapters, adapter, prompt)), name


def test_an_unknown_model_is_refused_404_naming_the_adapters(served):
    body = json.dumps({"model": "nope", "prompt": "hi", "max_tokens": 2}).encode()
    headers = {"Content-Type": "application/json", "Authorization": "Bearer k"}
    status, text = http("POST", served + "/v1/completions", body, headers)
    assert status == 404
    assert "'nope' does not exist" in text and "'math', 'poem'" in text


def test_a_bad_adapter_is_refused_at_start_by_name(folders, tmp_path):
    base, adapters = folders
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((adapters["math"] / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(RuntimeError, match="--lora bad=.*broken.*cannot be read as safetensors"):
        start_server(base, "--lora", f"bad={broken}")
    args = argparse.Namespace(lora=[f"{base.name}={adapters['math']}"])
    with pytest.raises(SystemExit, match="the adapter's name is the base model's"):
        served_adapters(args, base.name)


# ---- adapters loaded and unloaded while serving ----


def answer(engine: Engine, prompt: list[int], adapter: str | None) -> list[int]:
    """A greedy request through the engine's own inbox (its _accept, as the loop takes it)."""
    done = []
    request = Request(prompt, greedy(adapter), 1, lambda event: done.append(event.kind == "done"))
    engine.submit(request)
    while engine._inbox.qsize():
        engine._accept(engine._inbox.get())
    while not any(done):
        engine.step()
    return request.sequences[0].generated


def change(engine: Engine, name: str, path=None):
    """An adapter loaded (or unloaded, path None) as the loop makes it: the exception, or None."""
    future = engine.change_adapter(name, None if path is None else str(path))
    engine._accept(engine._inbox.get())
    return future.exception()


def test_a_name_loaded_again_never_reuses_the_earlier_adapters_blocks(folders):
    base, adapters = folders
    model, tokenizer = flashformer.load(base, adapters={"math": adapters["math"]})
    engine = Engine(model, tokenizer, max_batch=4, num_blocks=64, block_size=4, prefill_chunk=4)
    prompt = list(range(1, 14)) + [504, 2931, 314]
    assert answer(engine, prompt, "math") == library_greedy(base, adapters, "math", prompt)
    assert change(engine, "poem", adapters["poem"]) is None and engine.adapters == ("math", "poem")
    assert answer(engine, prompt, "poem") == library_greedy(base, adapters, "poem", prompt)
    assert change(engine, "math") is None and engine.adapters == ("poem",)
    hits = engine.scheduler.cache_hits
    assert change(engine, "math", adapters["poem"]) is None  # the name again, another adapter
    assert answer(engine, prompt, "math") == library_greedy(base, adapters, "poem", prompt)
    assert engine.scheduler.cache_hits == hits  # the earlier math's blocks and poem's are not its own
    assert isinstance(change(engine, "gone"), LookupError)
    assert "loaded already" in str(change(engine, "poem", adapters["poem"]))


def test_the_native_decoder_refuses_to_load_an_adapter(folders):
    base, adapters = folders
    model, tokenizer = flashformer.load(base)
    engine = Engine(model, tokenizer, max_batch=2, num_blocks=16)
    if engine.runner.native is not None:  # it would run no adapter: refused, naming the flag
        assert "--enable-lora" in str(change(engine, "math", adapters["math"]))
        assert engine.adapters == ()
    eager = Engine(model, tokenizer, max_batch=2, num_blocks=16, native=False)  # --enable-lora
    assert change(eager, "math", adapters["math"]) is None and eager.adapters == ("math",)


def test_load_and_unload_lora_adapter_endpoints(served, folders):
    base, adapters = folders
    headers = {"Content-Type": "application/json", "Authorization": "Bearer k"}

    def post(path, **body):
        return http("POST", served + path, json.dumps(body).encode(), headers)

    client = openai_client(served, "k")
    assert post("/v1/load_lora_adapter", lora_name="late", lora_path=str(adapters["poem"])) == (
        200,
        "Success: LoRA adapter 'late' added successfully.",
    )
    assert [m.id for m in client.models.list().data] == [base.name, "math", "poem", "late"]
    reply = client.completions.create(model="late", prompt=PROMPTS[1], max_tokens=NEW_TOKENS, temperature=0)
    _, tokenizer = flashformer.load(base)
    assert reply.choices[0].text == tokenizer.decode(library_greedy(base, adapters, "poem", PROMPTS[1]))
    status, text = post("/v1/load_lora_adapter", lora_name="late", lora_path=str(adapters["math"]))
    assert status == 400 and "loaded already" in text
    status, text = post("/v1/load_lora_adapter", lora_name="x", lora_path=str(base))
    assert status == 400 and "lora_path" in text and "adapter_config.json" in text
    status, text = post("/v1/load_lora_adapter", lora_name=base.name, lora_path=str(adapters["math"]))
    assert status == 400 and "base model's name" in text
    assert post("/v1/unload_lora_adapter", lora_name="late")[0] == 200
    assert "late" not in [m.id for m in client.models.list().data]
    assert post("/v1/unload_lora_adapter", lora_name="late")[0] == 404
    status, _ = post("/v1/completions", model="late", prompt="hi", max_tokens=2)
    assert status == 404


def test_chat_and_messages_take_the_adapters_name(served, folders):
    base, adapters = folders
    _, tokenizer = flashformer.load(base)
    question = [{"role": "user", "content": "Hello!"}]
    ids = tokenizer.apply_chat_template(question, add_generation_prompt=True)
    expected = tokenizer.decode(library_greedy(base, adapters, "poem", ids))
    chat = openai_client(served, "k").chat.completions.create(
        model="poem", messages=question, max_tokens=NEW_TOKENS, temperature=0
    )
    assert (chat.model, chat.choices[0].message.content) == ("poem", expected)
    body = {"model": "poem", "max_tokens": NEW_TOKENS, "temperature": 0, "messages": question}
    headers = {"Content-Type": "application/json", "Authorization": "Bearer k"}
    status, text = http("POST", served + "/v1/messages", json.dumps(body).encode(), headers)
    assert status == 200
    message = json.loads(text)
    assert (message["model"], message["content"][0]["text"]) == ("poem", expected)
    assert expected != tokenizer.decode(library_greedy(base, adapters, None, ids))
