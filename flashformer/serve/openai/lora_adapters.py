"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters loaded and unloaded while
serving, in vLLM's bodies ({"lora_name", "lora_path"}; {"lora_name"}) and its plain-text success.
The engine's loop makes the change between two steps (Engine.change_adapter), so no forward sees
half an adapter; a request already running keeps its adapter (unloading it is refused until it
ends), and an adapter loaded again under a name never meets the earlier one's cached blocks."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from flashformer.adapters import AdapterError
from flashformer.serve.http.protocol import APIError


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's, which names the adapter by lora_name anyway


def add_lora_adapter_routes(app: FastAPI, engine, model_name: str) -> None:
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest):
        if not body.lora_name or body.lora_name == model_name:
            raise APIError(400, f"lora_name: {body.lora_name!r} is the base model's name or empty; "
                           "give the adapter a name of its own", param="lora_name")  # fmt: skip
        try:
            await asyncio.wrap_future(engine.change_adapter(body.lora_name, body.lora_path))
        except AdapterError as error:  # the folder: its file, module and what was expected
            raise APIError(400, f"lora_path: {error}", param="lora_path") from None
        except ValueError as error:  # the name is taken, or the engine runs natively
            raise APIError(400, str(error), param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest):
        try:
            await asyncio.wrap_future(engine.change_adapter(body.lora_name))
        except LookupError as error:
            raise APIError(404, str(error), param="lora_name", code="model_not_found") from None
        except ValueError as error:  # in use
            raise APIError(400, str(error), param="lora_name") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
