"""OpenAI's request bodies (pydantic: fastapi checks them and answers 400 by name), the checks
every endpoint makes (the model's name, a text model), and the error shape: for the endpoint
modules create_app assembles (serve/app.py): the body every chat-shaped API translates into."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, create_model

from flashformer.generate.sampling_options import REQUEST_OPTIONS, SamplingOption
from flashformer.serve.embeddings import EmbeddingEngine

# ---- request bodies ----


class StreamOptions(BaseModel):
    include_usage: bool = False


Bias = Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]


def option_field(option: SamplingOption) -> tuple[Any, Any]:
    """A sampling option as a request field: null by default, its range (the request's, where
    it differs from generate()'s: temperature's 0 and 2, top_k's -1) checked by pydantic, so
    fastapi's 400 names the field and the bound."""
    bounds = option.request_bounds if option.request_bounds is not None else option.bounds
    finite = {"allow_inf_nan": False} if option.type is float else {}
    return option.type | None, Field(None, **bounds, **finite)


class _SamplingFields(BaseModel):
    # other fields are kept for refuse_unsupported: each is refused by name unless it cannot
    # change the answer (user, metadata, ...) or holds its no-op value
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = None
    logit_bias: dict[str, Bias] | None = None  # token id (a string, as JSON keys are) -> bias
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    # flashformer's: false keeps a server with --speculative-config from drafting for this request
    speculative: bool | None = None
    # structured outputs (serve/http/structured.py reads and checks them, naming the field):
    # OpenAI's response_format, vLLM's structured_outputs object and its older guided_* fields
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    most_stops: ClassVar[int] = 4  # OpenAI's rule for `stop` (the engine has none)


Sampling = create_model(
    "Sampling",
    __base__=_SamplingFields,
    __module__=__name__,
    __doc__="""The settings both endpoints share: OpenAI's names, defaults and ranges, and vLLM's
    for the fields OpenAI lacks. The sampling options (temperature, top_p, top_k, min_p, the
    penalties, ...) are the rows of generate.sampling_options.REQUEST_OPTIONS; the others are
    _SamplingFields'. Null is the default. Every one reaches generate.sampling (engine.py).""",
    **{option.name: option_field(option) for option in REQUEST_OPTIONS},
)


# ---- tools (serve/http/tools.py uses them) ----

FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]  # OpenAI's rule


class FunctionDefinition(BaseModel):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionChoice(BaseModel):
    name: FunctionName


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(BaseModel):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: True, as OpenAI's default
    # vLLM's: more variables for the chat template (Qwen3's enable_thinking, ...)
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


# ---- fields outside the models above ----

# fields that cannot change an answer: who asks, what to store, how to bill
NO_EFFECT = {"user", "metadata", "store", "service_tier", "prediction"}

# fields this server does not implement, with the values that ask for nothing (OpenAI's and
# vLLM's defaults); any other value would change the answer, so it is refused by name (tools
# and tool_choice reach here only on /v1/completions, which has no tools)
NO_OP_VALUES: dict[str, tuple] = {
    "best_of": (1,),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none", "auto"),  # without tools, both mean plain text
    "parallel_tool_calls": (True, False),  # without tools, nothing to call
    "modalities": (["text"],),
}


def refuse_unsupported(
    body: BaseModel, no_effect: set = NO_EFFECT, no_op_values: dict[str, tuple] = NO_OP_VALUES
) -> None:
    """Raise a 400 naming the first field of the request that this server would not honour: a
    field it does not know or implement, unless it cannot change the answer (no_effect) or holds
    its no-op value (no_op_values; null counts as absent). Nothing a client sends is silently
    ignored. The defaults are chat's and completions' fields; the Responses API passes its own."""
    for name, value in (body.model_extra or {}).items():
        if value is None or name in no_effect:
            continue
        if name in no_op_values and any(value == no_op for no_op in no_op_values[name]):
            continue
        raise APIError(400, f"{name} is not supported by this server (got {value!r})", param=name)


# ---- checks every endpoint makes ----


def check_model(name: str, served: str, engine=None) -> None:
    """404 unless `name` is the served model or one of the engine's LoRA adapters (vLLM's
    convention: a request names its adapter as its model)."""
    adapters = tuple(getattr(engine, "adapters", ()))
    if name != served and name not in adapters:
        also = f" and the adapters {list(adapters)}" if adapters else ""
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {served!r}{also}",
            param="model",
            code="model_not_found",
        )


def check_generates(engine, model_name: str) -> None:
    """A text endpoint refuses a server of sentence embeddings by name."""
    if isinstance(engine, EmbeddingEngine):
        raise APIError(
            400,
            f"the model {model_name!r} is an encoder (sentence embeddings); use /v1/embeddings",
            param="model",
        )


# ---- errors ----


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)
