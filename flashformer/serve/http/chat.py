"""The chat path: a ChatCompletionRequest made into a prompt (the chat template, its tools,
chat_template_kwargs), the engine's SamplingParams (checked, 400 naming the field) and the
AnswerPlan its answers are read with (answer.py), then submitted to the engine.

/v1/chat/completions takes it directly; Anthropic's /v1/messages (serve/anthropic/) and the
Responses API (responses_api.py) translate their bodies into a ChatCompletionRequest and take
it too, so that every chat-shaped API renders one template, samples with one set of settings
and reads one answer: no second sampling path.

    turn = await prepare_chat(engine, body, server)     # ChatTurn: prompt, params, answer plan
    request, events = submit(engine, turn.prompt, turn.params, n)
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass

from flashformer.generate.constraints import Constraint
from flashformer.generate.sampling_options import REQUEST_OPTIONS
from flashformer.serve.engine import Busy, Engine
from flashformer.serve.http.answer import AnswerPlan
from flashformer.serve.http.protocol import APIError, ChatCompletionRequest, CompletionRequest, Sampling
from flashformer.serve.http.structured import compile_for, requested_constraint
from flashformer.serve.http.tools import call_constraint, plan_tools, template_messages
from flashformer.serve.request import Event, SamplingParams, Thinking
from flashformer.serve.request import Request as EngineRequest
from flashformer.text.reasoning import END, START, check_format, reasoning_start

# names apply_chat_template gives the template itself: chat_template_kwargs may not set them
TEMPLATE_OWN = {"messages", "tools", "documents", "add_generation_prompt", "chat_template", "tokenize"}


@dataclass(frozen=True)
class ServerOptions:
    """What `flashformer serve` decides for every request: the tool-call format
    (--tool-parser; None: the template's) and the reasoning format (--reasoning-parser)."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self):
        if self.reasoning_parser is not None:
            check_format(self.reasoning_parser)


@dataclass
class ChatTurn:
    """A chat request ready for the engine: its prompt's token ids, its settings and how its
    answers are read."""

    prompt: list[int]
    params: SamplingParams
    answer: AnswerPlan


async def prepare_chat(
    engine: Engine, body: ChatCompletionRequest, server: ServerOptions, thinking_budget: int | None = None
) -> ChatTurn:
    """The ChatTurn of a chat request (fields outside the body's model are the caller's to
    refuse). thinking_budget: the most reasoning tokens (Anthropic's budget_tokens); it needs
    --reasoning-parser and the tags as single tokens."""
    prompt, plan = render_prompt(engine, body, server)
    answer = AnswerPlan(plan, server.reasoning_parser, _starts_in(engine.tokenizer, prompt, server))
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    top = body.top_logprobs if body.logprobs else None
    if body.logprobs and top is None:
        top = 0
    asked = requested_constraint(body)
    constraint = await compile_for(engine, call_constraint(plan, asked) or asked)
    thinking = _thinking(engine.tokenizer, answer, constraint, thinking_budget)
    params = params_of(body, limit, top, len(prompt), engine, constraint=constraint, thinking=thinking)
    return ChatTurn(prompt, params, answer)


def render_prompt(engine: Engine, body: ChatCompletionRequest, server: ServerOptions):
    """(the prompt's token ids, the ToolPlan) of a chat request: its messages and tools through
    the chat template, with its chat_template_kwargs."""
    offered = body.tools if body.tool_choice != "none" else None  # "none": as if no tools
    template = template_of(engine.tokenizer, offered)
    plan = plan_tools(body, template, server.tool_parser)
    messages, tools = template_messages([message_fields(m) for m in body.messages], template, plan)
    try:
        prompt = engine.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=True,
            tools=tools,
            chat_template=template,
            **template_kwargs(body.chat_template_kwargs),
        )
    except ValueError as error:
        raise APIError(400, f"messages: {error}", param="messages") from None
    return prompt, plan


def template_kwargs(given: dict | None) -> dict:
    """chat_template_kwargs (vLLM's field): more variables for the template, such as Qwen3's
    enable_thinking; never one of the names apply_chat_template sets itself."""
    for name in given or {}:
        if name in TEMPLATE_OWN:
            raise APIError(400, f"chat_template_kwargs.{name}: the request sets {name} itself; "
                           f"give it as a field of the request", param=f"chat_template_kwargs.{name}")  # fmt: skip
    return dict(given or {})


def _starts_in(tokenizer, prompt: list[int], server: ServerOptions) -> str:
    """Where the answer's text starts (text.reasoning's states), read off the prompt's last
    tokens: the template may have opened or closed the reasoning."""
    if server.reasoning_parser is None:
        return "answer"
    tail = tokenizer.decode(prompt[-8:], skip_special_tokens=False)
    return reasoning_start(server.reasoning_parser, tail)


def _thinking(tokenizer, answer: AnswerPlan, constraint, budget: int | None) -> Thinking | None:
    """The engine's Thinking for a request whose answer is constrained or whose reasoning has
    a budget, when its text may start in reasoning; None otherwise."""
    if answer.reasoning is None or answer.starts_in == "answer" or (constraint is None and budget is None):
        return None
    tags = tag_tokens(tokenizer)
    if tags is None:
        raise APIError(
            400,
            f"--reasoning-parser {answer.reasoning}: the tokenizer has no single tokens for {START} and "
            f"{END}, so a constrained answer or a thinking budget cannot wait for the reasoning's end",
            param="tools" if answer.tools is not None and answer.tools.schema is not None else None,
        )
    return Thinking(tags[0], tags[1], answer.starts_in, budget)


@functools.lru_cache(maxsize=8)
def tag_tokens(tokenizer) -> tuple[int, int] | None:
    """The token ids of <think> and </think>, when each is one token."""
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (START, END)]
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None


def message_fields(message) -> dict:
    """A request's message for the chat template: its other fields (name, ...) reach the
    template too, as in transformers; an assistant's calls without text keep content None."""
    fields = {**(message.model_extra or {}), "role": message.role}
    if message.tool_calls:
        fields["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    calls_only = message.content is None and message.tool_calls
    fields["content"] = None if calls_only else text_of(message.content)
    return fields


def template_of(tokenizer, tools) -> str | None:
    """The chat template the prompt is rendered with (None: the tokenizer has none)."""
    try:
        return tokenizer.chat_template_for(None, tools or None)
    except (ValueError, AttributeError):
        return None


def text_of(content) -> str:
    """A message's content: a string, or OpenAI's list of parts (text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") != "text":
            raise APIError(
                400,
                f"messages: content parts of type {part.get('type')!r} are not supported",
                param="messages",
            )
        texts.append(part.get("text", ""))
    return "".join(texts)


def params_of(
    body: Sampling,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_len: int,
    engine: Engine,
    prompt_logprobs: int | None = None,
    constraint: Constraint | None = None,
    thinking: Thinking | None = None,
) -> SamplingParams:
    """The request's settings, checked (400 naming the field and the value). max_tokens 0 is
    allowed with echo (prompt_logprobs set, or echo alone): the prompt, and no token.
    constraint: the compiled structured output (structured.py), or None."""
    if prompt_len >= engine.context:
        raise APIError(
            400,
            f"the prompt is {prompt_len} tokens; this model's maximum context length is {engine.context} tokens",
            param="messages",
            code="context_length_exceeded",
        )
    echo = getattr(body, "echo", False)
    if max_tokens is not None and (max_tokens < 0 or (max_tokens == 0 and not echo)):
        least = "0 (with echo)" if isinstance(body, CompletionRequest) else "1"
        raise APIError(400, f"max_tokens must be at least {least}; got {max_tokens}", param="max_tokens")
    room = engine.context - prompt_len
    limit = room if max_tokens is None else min(max_tokens, room)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > body.most_stops or any(not s for s in stop):
        raise APIError(400, f"stop: up to {body.most_stops} non-empty strings", param="stop")
    vocab = engine.model.config.vocab_size
    bias = _logit_bias(body.logit_bias, vocab)
    asked_stops = list(body.stop_token_ids or [])
    bad = [t for t in asked_stops if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"stop_token_ids: {bad[0]} is outside the vocabulary [0, {vocab})",
                       param="stop_token_ids")  # fmt: skip
    # ignore_eos: the model's own stop tokens go on; the request's stop_token_ids still end it
    own_stops = [] if body.ignore_eos else list(getattr(engine.tokenizer, "stop_token_ids", []) or [])
    min_tokens = body.min_tokens or 0
    if min_tokens > limit:
        raise APIError(
            400, f"min_tokens ({min_tokens}) must be at most max_tokens ({limit})", param="min_tokens"
        )
    return SamplingParams(
        **{option.name: option.from_request(getattr(body, option.name)) for option in REQUEST_OPTIONS},
        max_tokens=limit,
        logit_bias=bias,
        min_tokens=min_tokens,
        seed=body.seed,
        stop=tuple(stop),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        stop_token_ids=tuple(dict.fromkeys(own_stops + asked_stops)),
        constraint=constraint,
        speculative=body.speculative is not False,
        thinking=thinking,
        adapter=body.model if body.model in getattr(engine, "adapters", ()) else None,
    )


def _logit_bias(bias: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: token ids as strings (JSON's keys), each in the vocabulary."""
    pairs = []
    for key, value in (bias or {}).items():
        token = int(key) if key.strip().lstrip("-").isdigit() else None
        if token is None or not 0 <= token < vocab:
            raise APIError(400, f"logit_bias: {key!r} is not a token id in [0, {vocab})", param="logit_bias")
        pairs.append((token, float(value)))
    return tuple(pairs)


def submit(
    engine: Engine, prompt: list[int], params: SamplingParams, n: int = 1
) -> tuple[EngineRequest, asyncio.Queue[Event]]:
    """Queue a request on the engine: the request, and the queue its events arrive on in this
    event loop. 503 when the engine's queue is full."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[Event] = asyncio.Queue()
    request = EngineRequest(
        prompt, params, n, lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
    )
    try:
        engine.submit(request)
    except Busy as busy:
        raise APIError(503, str(busy), kind="server_error", code="overloaded") from None
    except ValueError as error:
        raise APIError(400, str(error), code="context_length_exceeded") from None
    return request, events


class ClientGone(Exception):
    """The client went away while its whole answer was awaited (its request is cancelled)."""


async def until_done(request, events, http):
    """A request's events up to its "done", for an answer sent whole: an "error" is raised as a
    500, and the request is cancelled when the client goes away (ClientGone) or the handler is
    cancelled."""
    try:
        while True:
            try:
                event = await asyncio.wait_for(events.get(), timeout=0.5)
            except TimeoutError:
                if await http.is_disconnected():
                    request.cancel()
                    raise ClientGone from None
                continue
            if event.kind == "error":
                raise APIError(500, event.message, kind="server_error")
            yield event
            if event.kind == "done":
                return
    except asyncio.CancelledError:
        request.cancel()
        raise
