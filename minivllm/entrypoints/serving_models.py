"""Which models the server serves: the base model's names and its LoRA adapters (vLLM's
`OpenAIServingModels`, vllm/entrypoints/openai/serving_models.py).

A request's `model` picks what runs: a served name of the base model runs the base model; an
adapter's name runs the base model under that adapter (a `LoRARequest` that travels with the
request into the engine); any other name is OpenAI's 404, "The model `X` does not exist.". Every
handler asks this one object, so /v1/models, the generation routes and the adapter routes can
never disagree about what exists.

Adapters come from `--lora-modules` (loaded when the server starts: a bad one stops the start,
naming it), and, with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`, from POST /v1/load_lora_adapter; POST
/v1/unload_lora_adapter forgets one. Loading runs the engine's own check of the folder
(`LLMEngine.add_lora`, where the model is), so a bad path, a rank above `max_lora_rank`, a target
module the model lacks, the shape of another base model or a truncated file is a 400 that names
it, and the adapter is not listed. Unloading takes the name away at once (a later request naming
it is a 404); requests already running under it finish on it, and the engine frees its slot after
the last of them (`LLMEngine.remove_lora`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Any

from minivllm.engine.protocol import EngineClient
from minivllm.entrypoints.cli_args import LoRAModulePath
from minivllm.entrypoints.protocol import (
    LoadLoRAAdapterRequest,
    OpenAIError,
    UnloadLoRAAdapterRequest,
)
from minivllm.lora.errors import LoRAError
from minivllm.lora.request import LoRARequest

logger = logging.getLogger("minivllm")


@dataclass(frozen=True)
class BaseModelPath:
    name: str  # a served name (--served-model-name)
    model_path: str  # the model as the server was told it: /v1/models' `root`


class OpenAIServingModels:
    """The base model's names and the adapters loaded, by name."""

    def __init__(
        self,
        engine_client: EngineClient,
        base_model_paths: list[BaseModelPath],
        lora_modules: list[LoRAModulePath] | None = None,
    ) -> None:
        if lora_modules and engine_client.config.lora is None:
            raise ValueError("lora_modules needs LoRA: start the server with enable_lora")
        self.engine_client = engine_client
        self.base_model_paths = base_model_paths
        self.static_lora_modules = list(lora_modules or [])
        self.lora_requests: dict[str, LoRARequest] = {}  # name -> its adapter, in load order
        self.lora_parents: dict[str, str] = {}  # name -> the base model name it reports
        self._lora_ids = itertools.count(1)  # vLLM's rule: 0 is the base model
        self._lock = asyncio.Lock()  # one load or unload at a time

    @property
    def base_model_names(self) -> list[str]:
        return [b.name for b in self.base_model_paths]

    def is_base_model(self, model_name: str) -> bool:
        return model_name in self.base_model_names

    # ------------------------------------------------------------------ a request's model
    def resolve(self, model: str | None) -> tuple[str, LoRARequest | None]:
        """(the name to answer with, the adapter to run under): the first served name for none;
        404 for a name that is neither a served name nor an adapter."""
        if model is None:
            return self.base_model_names[0], None
        if self.is_base_model(model):
            return model, None
        if model in self.lora_requests:
            return model, self.lora_requests[model]
        raise OpenAIError(f"The model `{model}` does not exist.", 404, param="model")

    def check_still_loaded(self, lora_request: LoRARequest | None) -> None:
        """Right before a request is queued: its adapter was not unloaded while the handler
        prepared it (which would otherwise bring the adapter back into the engine)."""
        if lora_request is not None and (
            self.lora_requests.get(lora_request.lora_name) is not lora_request
        ):
            raise OpenAIError(
                f"The model `{lora_request.lora_name}` does not exist.", 404, param="model"
            )

    def show_available_models(self, max_model_len: int, task: str) -> dict[str, Any]:
        """/v1/models: the base model's names, then each adapter with its `parent` (vLLM's
        `ModelCard`: `root` is where the weights are, `parent` the model an adapter adapts)."""

        def card(name: str, root: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "minivllm",
                "root": root,
                "parent": parent,
                "max_model_len": max_model_len,
                "task": task,  # generate, or a pooling model's task: what its routes serve
            }

        cards = [card(b.name, b.model_path, None) for b in self.base_model_paths]
        cards += [
            card(name, lora.lora_path, self.lora_parents[name])
            for name, lora in self.lora_requests.items()
        ]
        return {"object": "list", "data": cards}

    # ------------------------------------------------------------------ loading and unloading
    async def init_static_loras(self) -> None:
        """Load every `--lora-modules` adapter; the first that fails stops the start, named."""
        for module in self.static_lora_modules:
            request = LoadLoRAAdapterRequest(lora_name=module.name, lora_path=module.path)
            try:
                await self.load_lora_adapter(request, module.base_model_name)
            except OpenAIError as exc:
                raise ValueError(
                    f"--lora-modules {module.name}={module.path}: {exc.message}"
                ) from None

    async def load_lora_adapter(
        self, request: LoadLoRAAdapterRequest, base_model_name: str | None = None
    ) -> str:
        name, path = request.lora_name, request.lora_path
        if not name or not path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.")
        if base_model_name is not None and not self.is_base_model(base_model_name):
            raise OpenAIError(
                f"base_model_name {base_model_name!r} is not a served model name "
                f"({', '.join(self.base_model_names)})",
                param="base_model_name",
            )
        async with self._lock:
            if name in self.lora_requests:  # vLLM's wording, less its load_inplace hint
                raise OpenAIError(
                    f"The lora adapter '{name}' has already been loaded.", param="lora_name"
                )
            if self.is_base_model(name):
                raise OpenAIError(
                    f"lora_name {name!r} is the base model's served name; choose another",
                    param="lora_name",
                )
            lora_request = LoRARequest(name, next(self._lora_ids), path)
            try:  # read and checked where the model is; it then stays in host memory
                await self.engine_client.add_lora(lora_request)
            except LoRAError as exc:
                raise OpenAIError(str(exc), param="lora_path") from None
            self.lora_requests[name] = lora_request
            self.lora_parents[name] = base_model_name or self.base_model_names[0]
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        name = request.lora_name
        if not name:
            raise OpenAIError("'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self._lock:
            lora_request = self.lora_requests.pop(name, None)
            if lora_request is None:
                raise OpenAIError(
                    f"The lora adapter '{name}' cannot be found.", 404, param="lora_name"
                )
            del self.lora_parents[name]
            # Queued after every request already sent under it: those finish on it.
            await self.engine_client.remove_lora(lora_request.lora_int_id)
        logger.info("Removed LoRA adapter: name '%s'", name)
        return f"Success: LoRA adapter '{name}' removed successfully."
