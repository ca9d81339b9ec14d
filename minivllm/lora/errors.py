"""The typed errors of loading an adapter: each names the field, module, file or shape at fault.

All are `ValueError`s (a bad adapter is a bad argument: the server answers 400), and each is raised
before anything changes, so the engine keeps serving the requests it has.
"""

from __future__ import annotations


class LoRAError(ValueError):
    """Any adapter the engine cannot serve."""


class LoRADisabledError(LoRAError):
    """A request brought a `lora_request` to an engine built without `enable_lora=True`."""


class LoRAFileError(LoRAError):
    """A PEFT folder's file is missing, unreadable or truncated."""


class UnsupportedLoRAError(LoRAError):
    """The adapter uses a PEFT feature minivllm does not serve (modules_to_save, embedding
    adapters, DoRA, bias), a rank above max_lora_rank, or targets a module the model lacks."""


class LoRAShapeError(LoRAError):
    """A weight's shape does not fit the model's linear: an adapter of another base model."""
