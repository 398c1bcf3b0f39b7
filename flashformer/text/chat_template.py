"""Chat templates: the Jinja program a model ships to turn a conversation into its prompt,
rendered exactly as transformers' apply_chat_template(..., tokenize=False) renders it.

Templates come with downloaded models, so they are untrusted code: they run in Jinja's
immutable sandbox, see only plain JSON-like data, and get the same few helpers transformers
gives them (raise_exception, strftime_now, a tojson that does not escape HTML, a restricted
dict and namespace, loop controls, and a {% generation %} block that renders its body). The
environment options matter for the output: trim_blocks and lstrip_blocks remove the newline
after a tag and the indentation before one, which templates are written to expect.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may come under; templates read "reasoning_content" or "thinking".
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat_template(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **variables,
) -> str:
    """The prompt text for one conversation.

    messages: dicts with "role" and "content" (and whatever else the template reads); keys whose
    value is None are dropped, as transformers drops them. variables: bos_token, eos_token and
    any other name the template uses. A template that calls raise_exception, or fails, raises
    ValueError with its message.
    """
    if not messages:
        raise ValueError("cannot render a chat template for an empty conversation: give at least one message")
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be dicts with 'role' and 'content'; got {message!r}")
    if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
        raise TypeError("tools must be JSON schemas (dicts)")
    conversation = [_with_reasoning_aliases({k: v for k, v in m.items() if v is not None}) for m in messages]
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=_plain(conversation),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **_plain(variables),
        )
    except jinja2.TemplateError as error:  # raise_exception, an undefined name, a sandbox violation
        raise ValueError(f"the chat template failed on these messages: {error.message or error}") from None


def template_variables(template: str) -> set[str] | None:
    """The names a template reads without setting them (`tools`, `enable_thinking`, ...), parsed
    as it is rendered (its {% generation %} blocks included: SmolLM3's template has them); None
    for a template that is not valid Jinja (rendering reports it)."""
    try:
        return jinja2.meta.find_undeclared_variables(_environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return None


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals.update(
        raise_exception=_raise_exception,
        strftime_now=lambda format: datetime.now().strftime(format),
        dict=_TemplateDict(),
        namespace=_TemplateNamespace,
    )
    return environment


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(
            f"the chat template is not valid Jinja (line {error.lineno}): {error.message}"
        ) from None


def _raise_exception(message):
    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """JSON as json.dumps writes it: Jinja's own tojson escapes <, >, & and ' for HTML, which a prompt must not."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlock(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %} marks the assistant's text for training masks; it renders as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _TemplateDict:
    """dict(...) and dict.fromkeys(...) for templates, without the type object itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore names (a way towards Python internals)."""

    def __init__(*args, **kwargs):  # no named self: `namespace(self=...)` must stay possible
        namespace, attributes = args[0], dict(*args[1:], **kwargs)
        for name in attributes:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(namespace, attributes)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


def _with_reasoning_aliases(message: dict) -> dict:
    """A message's reasoning under every name templates read it by."""
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value):
    """Only JSON-like data reaches the sandbox: the methods of richer objects (arrays, images,
    models) are not known to be safe, so anything else becomes a placeholder "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if hasattr(value, "item") and getattr(value, "shape", None) == ():  # numpy / torch scalars
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models, as OpenAI's client returns
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"
