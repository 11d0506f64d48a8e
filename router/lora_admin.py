"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's API, its status codes and
messages): adapters served from then on, on a served model, behind the API key.

A load is checked by a replica of the model loading it (LoRAError: a 400 naming the adapter),
then recorded in the application's registry (router/lora_registry.py), from which every ingress
replica routes requests naming it, and every replica of the model loads it on demand (the path
travels with each request). An unload takes the name out of the registry (new requests: 404 at
once here, within lora_registry.REFRESH_S on other ingress replicas); requests already running
on it finish; the model's replicas are told best-effort, and otherwise evict it as they need
room (max_cpu_loras, least recently used first)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from router.errors import HTTPError, bad_request
from router.lora_registry import Adapter
from router.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

logger = logging.getLogger("ray.serve")


class LoRAAdmin:
    """The adapter endpoints of an IngressCore (its models, adapters, guard)."""

    def __init__(self, core) -> None:
        self.core = core
        self._background: set[asyncio.Task] = set()

    def _model_for_load(self, name: str | None):
        """The served model an adapter is loaded on: `name`, else the first model."""
        core = self.core
        if name is None:
            return core.default
        model = core.models.get(name)
        if model is None:
            raise HTTPError(
                404,
                f"The model {name!r} does not exist: adapters load on one of the models "
                f"{list(core.models)}",
                "not_found_error",
                param="model",
                code="model_not_found",
            )
        return model

    async def load(self, request: Request) -> Response:
        core = self.core
        core.guard.check_auth(request)
        req = await core.read_request(request, LoadLoRAAdapterRequest)
        model = self._model_for_load(req.model)
        name = req.lora_name
        if name in core.models or await core.adapters.get(name) is not None:
            raise bad_request(
                f"The lora adapter '{name}' has already been loaded.", param="lora_name"
            )
        if not model.engine.lora_enabled:
            raise bad_request(
                f"LoRA is off for the model {model.name!r}: cannot load the adapter '{name}' "
                "(set engine.enable_lora, or give the model lora_modules)",
                param="model",
            )
        # a replica of the model checks the adapter by loading it (LoRAError: 400 naming it)
        await model.handle.load_lora.remote(name, req.lora_path)
        if not await core.adapters.add(Adapter(name, model.name, req.lora_path)):
            raise bad_request(
                f"The lora adapter '{name}' has already been loaded.", param="lora_name"
            )
        logger.info("LoRA adapter %r loaded on %r from %s", name, model.name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        core = self.core
        core.guard.check_auth(request)
        req = await core.read_request(request, UnloadLoRAAdapterRequest)
        name = req.lora_name
        adapter = await core.adapters.remove(name)
        if adapter is None:
            raise HTTPError(
                404,
                f"The lora adapter '{name}' cannot be found.",
                "not_found_error",
                param="lora_name",
            )
        model = core.models.get(adapter.base)
        if model is not None:
            self._tell_replicas(model, name)
        logger.info("LoRA adapter %r unloaded from %r", name, adapter.base)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    def _tell_replicas(self, model, name: str) -> None:
        """Best-effort: ask a replica of the model to drop the adapter, without waiting (the
        answer to the client does not depend on it; a replica not told evicts it by LRU)."""

        async def tell() -> None:
            try:
                await model.handle.unload_lora.remote(name)
            except Exception as exc:
                logger.info("unload_lora(%r) on %r not applied: %s", name, model.name, exc)

        task = asyncio.ensure_future(tell())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
