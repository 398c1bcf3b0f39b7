"""The server's sampling fields, prompt log-probabilities (echo), /tokenize and /detokenize,
and lm-evaluation-harness against the server: the same tiny model and server as
test_serve.py. The sampling module itself is checked against transformers and numpy in
tests/generate/test_sampling.py; here each field must reach it (the server's greedy tokens
equal generate()'s with the same settings), stay batch-invariant, and bad values get a 400
naming the field and the value. Prompt log-probabilities are compared with transformers'
own forward of the same folder."""

from __future__ import annotations

import asyncio
import functools
import json
import math

import pytest
import torch
from test_serve import KEY, QUESTIONS, http, serving, tiny_chat_model  # noqa: F401 (a fixture)

import flashformer

HEADERS = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(tiny_chat_model):  # noqa: F811
    with serving(tiny_chat_model, "--api-key", KEY, "--max-batch", "8", "--kv-blocks", "96") as url:
        yield url


@pytest.fixture(scope="module")
def local(tiny_chat_model):  # noqa: F811
    return flashformer.load(tiny_chat_model)


def post(server, path: str, body: dict) -> tuple[int, dict]:
    code, text = http("POST", server + path, json.dumps(body).encode(), HEADERS)
    return code, json.loads(text)


def complete(server, model_dir, **body) -> dict:
    code, reply = post(server, "/v1/completions", {"model": model_dir.name, **body})
    assert code == 200, reply
    return reply


PROMPT = "The lighthouse keeper looked at the sea and said"

# every honoured field at once, greedy (the sampling-only filters change nothing then)
PENALIZED = dict(
    logit_bias={"11": 3.0, "28": -2.0},
    repetition_penalty=1.3,
    presence_penalty=0.8,
    frequency_penalty=0.5,
)


def test_the_fields_reach_generates_sampling(server, tiny_chat_model, local):  # noqa: F811
    """Greedy with logit_bias (banning the plain answer's first token) and the three penalties:
    the server's tokens are generate()'s with the same settings (whose processor tests/generate
    checks against transformers and numpy), and differ from the plain greedy answer."""
    model, tokenizer = local
    ids = tokenizer.encode(PROMPT)
    plain = model.generate(torch.tensor([ids]), max_new_tokens=12, eos_token_id=[])[0, len(ids) :].tolist()
    fields = {**PENALIZED, "logit_bias": {**PENALIZED["logit_bias"], str(plain[0]): -100}}
    reply = complete(
        server, tiny_chat_model, prompt=ids, max_tokens=12, temperature=0, ignore_eos=True, **fields
    )
    bias = {int(k): v for k, v in fields["logit_bias"].items()}
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=12, eos_token_id=[], **{**fields, "logit_bias": bias}
    )
    text = reply["choices"][0]["text"]
    assert text == tokenizer.decode(out[0, len(ids) :].tolist())
    assert text != tokenizer.decode(plain) and reply["usage"]["completion_tokens"] == 12


def test_typical_p_reaches_the_sampler(server, tiny_chat_model, local):  # noqa: F811
    """typical_p, a request field: greedy requests are unchanged by it (a warper); when sampling,
    typical_p 1e-6 keeps one token per step, the one whose -log p is nearest the entropy
    (filter_typical, checked against transformers in tests/generate), so whatever the seeds the
    server's tokens are generate()'s with the same setting, and not greedy's."""
    model, tokenizer = local
    ids = tokenizer.encode(PROMPT)
    asked = dict(prompt=ids, max_tokens=10, ignore_eos=True)
    greedy = complete(server, tiny_chat_model, **asked, temperature=0)["choices"][0]["text"]
    assert (
        complete(server, tiny_chat_model, **asked, temperature=0, typical_p=0.2)["choices"][0]["text"]
        == greedy
    )
    typical = complete(server, tiny_chat_model, **asked, temperature=1.0, typical_p=1e-6, seed=1)
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=10, eos_token_id=[], do_sample=True, typical_p=1e-6, seed=7
    )
    assert typical["choices"][0]["text"] == tokenizer.decode(out[0, len(ids) :].tolist())
    assert typical["choices"][0]["text"] != greedy


def test_sampling_fields_are_batch_invariant_and_seeded(server, tiny_chat_model):  # noqa: F811
    """A seeded request with every field gives the same tokens alone and among seven others
    with different settings; top_k 1 samples the greedy tokens."""
    from openai import AsyncOpenAI

    fields = dict(temperature=0.9, seed=7, top_k=20, min_p=0.05, top_p=0.95, min_tokens=4, **PENALIZED)
    alone = complete(server, tiny_chat_model, prompt=PROMPT, max_tokens=16, **fields)["choices"][0]["text"]
    again = complete(server, tiny_chat_model, prompt=PROMPT, max_tokens=16, **fields)["choices"][0]["text"]
    assert alone == again and alone

    async def together():
        client = AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
        others = [
            dict(temperature=1.0, seed=i, top_k=5 + i, presence_penalty=-1.0, frequency_penalty=1.5)
            for i in range(7)
        ]
        replies = await asyncio.gather(
            *[
                client.completions.create(
                    model=tiny_chat_model.name,
                    prompt=QUESTIONS[i % 4],
                    max_tokens=12 + i,
                    extra_body=dict(o),
                )
                for i, o in enumerate(others)
            ],
            client.completions.create(
                model=tiny_chat_model.name, prompt=PROMPT, max_tokens=16, extra_body=fields
            ),
        )
        await client.close()
        return replies[-1].choices[0].text

    assert asyncio.run(together()) == alone
    greedy = complete(server, tiny_chat_model, prompt=PROMPT, max_tokens=8, temperature=0)
    top1 = complete(server, tiny_chat_model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, top_k=1)
    assert top1["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_min_tokens_ignore_eos_and_stop_token_ids(server, tiny_chat_model, local):  # noqa: F811
    model, tokenizer = local
    eos = tokenizer.eos_token_id
    forced = {"logit_bias": {str(eos): 100}, "temperature": 0, "max_tokens": 10, "prompt": PROMPT}
    ended = complete(server, tiny_chat_model, **forced)
    assert ended["usage"]["completion_tokens"] == 1 and ended["choices"][0]["finish_reason"] == "stop"
    held = complete(server, tiny_chat_model, **forced, min_tokens=5)
    assert held["usage"]["completion_tokens"] == 6 and held["choices"][0]["finish_reason"] == "stop"
    ignored = complete(server, tiny_chat_model, **forced, ignore_eos=True)
    assert ignored["usage"]["completion_tokens"] == 10 and ignored["choices"][0]["finish_reason"] == "length"
    ids = tokenizer.encode(PROMPT)
    free = model.generate(torch.tensor([ids]), max_new_tokens=10, eos_token_id=[])[0, len(ids) :].tolist()
    stopped = complete(server, tiny_chat_model, prompt=ids, max_tokens=10, temperature=0, ignore_eos=True,
                       stop_token_ids=[free[2]])  # fmt: skip
    first = free.index(free[2]) + 1  # the first time that token comes
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == first
    assert stopped["choices"][0]["text"] == tokenizer.decode(free[: first - 1])


BAD = [
    ({"top_k": -2}, "top_k", "-2"),
    ({"min_p": 1.5}, "min_p", "1.5"),
    ({"typical_p": 0}, "typical_p", "0"),
    ({"presence_penalty": 2.5}, "presence_penalty", "2.5"),
    ({"frequency_penalty": -3}, "frequency_penalty", "-3"),
    ({"repetition_penalty": 0}, "repetition_penalty", "0"),
    ({"logit_bias": {"11": 250}}, "logit_bias.11", "250"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "'abc'"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "'99999999'"),
    ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "9"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids", str(10**9)),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", "'a b'"),
    ({"tool_choice": "required"}, "tool_choice 'required' needs tools", "required"),
]


@pytest.mark.parametrize("fields, named, value", BAD, ids=[b[1].split()[0] for b in BAD])
def test_bad_values_get_400_naming_the_field_and_value(server, tiny_chat_model, fields, named, value):  # noqa: F811
    body = {"model": tiny_chat_model.name, "messages": [{"role": "user", "content": "x"}], **fields}
    code, reply = post(server, "/v1/chat/completions", body)
    assert code == 400
    assert named in reply["error"]["message"] and value in reply["error"]["message"], reply


def test_fields_with_no_effect_are_accepted(server, tiny_chat_model):  # noqa: F811
    plain = complete(server, tiny_chat_model, prompt=PROMPT, max_tokens=6, temperature=0)
    same = complete(server, tiny_chat_model, prompt=PROMPT, max_tokens=6, temperature=0, user="u",
                    metadata={"a": "b"}, store=False, service_tier="auto")  # fmt: skip
    assert same["choices"][0]["text"] == plain["choices"][0]["text"]


# ---- prompt log-probabilities ----


@functools.cache
def transformers_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()


def transformers_logprobs(folder, ids: list[int]) -> torch.Tensor:
    """Row p: log P(next token | ids[: p + 1]) over the vocabulary, from transformers' own
    forward of the same folder (float64 softmax)."""
    model = transformers_model(folder)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()  # (L, V)
    return torch.log_softmax(logits, -1)  # (L, V)


def test_echo_returns_the_prompts_logprobs(server, tiny_chat_model, local):  # noqa: F811
    _, tokenizer = local
    ids = tokenizer.encode(PROMPT)
    reply = complete(server, tiny_chat_model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=3)
    choice = reply["choices"][0]
    assert choice["text"] == PROMPT and reply["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["tokens"] == [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    expected = transformers_logprobs(tiny_chat_model, ids)
    for position in range(1, len(ids)):
        assert math.isclose(
            lp["token_logprobs"][position], expected[position - 1, ids[position]], abs_tol=1e-4
        )
        top = lp["top_logprobs"][position]
        best = torch.topk(expected[position - 1], 3)
        assert len(top) == 3
        assert sorted(top.values(), reverse=True) == pytest.approx(best.values.tolist(), abs=1e-4)

    with_completion = complete(server, tiny_chat_model, prompt=ids, max_tokens=4, echo=True, logprobs=1,
                               temperature=0)  # fmt: skip
    alone = complete(server, tiny_chat_model, prompt=ids, max_tokens=4, temperature=0)
    text = with_completion["choices"][0]["text"]
    assert text == tokenizer.decode(ids, skip_special_tokens=False) + alone["choices"][0]["text"]
    assert len(with_completion["choices"][0]["logprobs"]["tokens"]) == len(ids) + 4
    assert with_completion["choices"][0]["logprobs"]["token_logprobs"][1:4] == lp["token_logprobs"][1:4]
    echo_only = complete(server, tiny_chat_model, prompt=PROMPT, max_tokens=0, echo=True)
    assert echo_only["choices"][0]["text"] == PROMPT and echo_only["choices"][0]["logprobs"] is None
    code, refused = post(
        server, "/v1/completions", {"model": tiny_chat_model.name, "prompt": PROMPT, "max_tokens": 0}
    )
    assert code == 400 and "max_tokens" in refused["error"]["message"]


def test_tokenize_and_detokenize(server, tiny_chat_model, local):  # noqa: F811
    _, tokenizer = local
    code, reply = post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    ids = tokenizer.encode(PROMPT)
    assert code == 200 and reply["tokens"] == ids and reply["count"] == len(ids)
    assert reply["max_model_len"] == 256 and len(reply["token_strs"]) == len(ids)
    assert post(server, "/detokenize", {"tokens": ids})[1] == {
        "prompt": tokenizer.decode(ids, skip_special_tokens=False)
    }
    messages = [{"role": "user", "content": QUESTIONS[2]}]
    counted = post(server, "/tokenize", {"model": tiny_chat_model.name, "messages": messages})[1]
    code, chat = post(server, "/v1/chat/completions", {"model": tiny_chat_model.name, "messages": messages,
                                                       "max_tokens": 1})  # fmt: skip
    assert counted["count"] == chat["usage"]["prompt_tokens"]
    assert post(server, "/detokenize", {"tokens": [10**9]})[0] == 400
    assert post(server, "/tokenize", {"model": "other", "prompt": "x"})[0] == 404
    info = json.loads(http("GET", server + "/tokenizer_info")[1])
    assert info["eos_token"] == tokenizer.special_tokens["eos_token"]


# ---- lm-evaluation-harness against the server ----

QUIZ = [
    ("The capital of France is", [" Paris", " Berlin", " Madrid"], 0),
    ("Two plus two equals", [" four", " five", " seven", " one"], 0),
    ("The opposite of hot is", [" cold", " warm", " loud"], 0),
    ("A baby cat is called a", [" kitten", " puppy", " calf"], 0),
    ("The sky on a clear day is", [" blue", " green", " red", " purple"], 0),
    ("Water freezes at zero degrees", [" Celsius", " Fahrenheit", " Kelvin"], 0),
    ("The first letter of the alphabet is", [" A", " Z", " M"], 0),
    ("Bees make", [" honey", " milk", " silk"], 0),
]

TASK = """task: tiny_quiz
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def lm_eval_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness' split of a (context, continuation) into tokens (api/model.py
    _encode_pair, with its remote tokenizer: no special tokens): trailing spaces of the context
    move to the continuation, the whole is encoded and the context's tokens cut off."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    return context_ids, whole[len(context_ids) :]


@pytest.mark.slow
def test_lm_eval_local_completions_scores_as_in_process(
    server,
    tiny_chat_model,  # noqa: F811
    local,
    tmp_path,
    monkeypatch,
):
    """lm-evaluation-harness' local-completions model (echo, logprobs, max_tokens 1, prompts as
    token ids from the server's /tokenize) on a local multiple-choice task: the same accuracy
    and per-choice log-likelihoods (within 1e-4) as transformers' forward of the same folder and
    flashformer's in-process eval.loglikelihood, with the tokens lm-evaluation-harness sends."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    lm_eval = pytest.importorskip(
        "lm_eval", reason="lm-evaluation-harness is not installed (pip install lm_eval)"
    )
    pytest.importorskip("tenacity", reason="lm-evaluation-harness' API models need lm_eval[api]")
    from lm_eval.tasks import TaskManager

    from flashformer.eval.loglikelihood import token_logprobs

    data = tmp_path / "quiz.jsonl"
    data.write_text(
        "".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUIZ)
    )
    (tmp_path / "tiny_quiz.yaml").write_text(TASK.format(data=data))
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={tiny_chat_model.name},base_url={server}/v1/completions,tokenizer_backend=remote,"
        "num_concurrent=1,max_retries=1,tokenized_requests=True",
        tasks=["tiny_quiz"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
        batch_size=1,
    )
    model, tokenizer = local
    samples = sorted(results["samples"]["tiny_quiz"], key=lambda s: s["doc_id"])
    assert len(samples) == len(QUIZ)
    correct = 0
    for sample, (_, choices, answer) in zip(samples, QUIZ):
        theirs = [float(resp[0][0]) for resp in sample["resps"]]
        ours, reference = [], []
        for context, continuation in sample["arguments"]:  # (context, continuation) per choice
            context_ids, continuation_ids = lm_eval_pair(tokenizer, context, continuation)
            assert context_ids and continuation_ids
            ids = context_ids + continuation_ids
            expected = transformers_logprobs(tiny_chat_model, ids)
            reference.append(sum(float(expected[p - 1, ids[p]]) for p in range(len(context_ids), len(ids))))
            scored = token_logprobs(model, ids)
            ours.append(sum(scored[p].logprob for p in range(len(context_ids), len(ids))))
        assert theirs == pytest.approx(reference, abs=1e-4) and ours == pytest.approx(reference, abs=1e-4)
        correct += int(max(range(len(choices)), key=reference.__getitem__) == answer)
    assert results["results"]["tiny_quiz"]["acc,none"] == pytest.approx(correct / len(QUIZ))
