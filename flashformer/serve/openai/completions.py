"""POST /v1/completions: a prompt string or token ids (one prompt per request; n for several
choices), with echo (the prompt opens the text; with logprobs, its tokens' log-probabilities
too), answered whole or streamed (bodies.py)."""

from __future__ import annotations

from fastapi import FastAPI, Request

from flashformer.serve.http.chat import params_of
from flashformer.serve.http.protocol import (
    APIError,
    CompletionRequest,
    check_generates,
    check_model,
    refuse_unsupported,
)
from flashformer.serve.http.structured import compile_for, requested_constraint
from flashformer.serve.openai.bodies import respond


def add_completion_routes(app: FastAPI, engine, model_name: str) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        check_model(body.model, model_name, engine)
        check_generates(engine, model_name)
        refuse_unsupported(body)
        if body.echo and body.stream:
            raise APIError(400, "echo with stream=true is not supported (ask without stream)", param="echo")
        prompt = _one_prompt(body.prompt)
        ids = _prompt_ids(engine, prompt)
        scored = body.logprobs if body.echo else None  # echo with logprobs: the prompt's too
        constraint = await compile_for(engine, requested_constraint(body))
        params = params_of(body, body.max_tokens, body.logprobs, len(ids), engine, scored, constraint)
        echo = None
        if body.echo:
            echo = (
                prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids, skip_special_tokens=False)
            )
        return await respond(engine, http, body, ids, params, body.model, chat=False, echo=echo)


def _one_prompt(prompt):
    """The request's prompt: a string or token ids (a list of one of them: that one)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError(400, "prompt: one prompt per request (use n for several choices)", param="prompt")
        prompt = prompt[0]
    return prompt


def _prompt_ids(engine, prompt) -> list[int]:
    """A prompt's token ids: a text through the tokenizer, ids checked against the vocabulary."""
    if isinstance(prompt, str):
        ids = engine.tokenizer.encode(prompt)
    else:
        vocab = engine.model.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise APIError(
                400, f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt"
            )
        ids = list(prompt)
    if not ids:
        raise APIError(400, "prompt: the prompt is empty", param="prompt")
    return ids
