"""The responses `/v1/responses` keeps: what `GET /v1/responses/{id}`, `previous_response_id`,
`background` runs and their cancel route read (vLLM's `response_store` and `msg_store` in
vllm/entrypoints/openai/serving_responses.py).

vLLM keeps them in two dicts that only grow, behind `VLLM_ENABLE_RESPONSES_API_STORE`. Here the
store is bounded: it keeps the `max_responses` most recently used (stored, read, continued from);
putting one more evicts the least recently used, and a background run still going when its entry is
evicted is cancelled with it, so no task outlives the only handle that could cancel it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from minivllm.entrypoints.protocol import ChatMessage, OpenAIError

MAX_STORED_RESPONSES = 1000  # bounded memory: about a few MB of text at most


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response body, as GET returns it
    messages: list[ChatMessage]  # the conversation it answered (continued by previous_response_id)
    task: asyncio.Task[None] | None = None  # a background response's run


class ResponsesStore:
    def __init__(self, max_responses: int = MAX_STORED_RESPONSES) -> None:
        if max_responses < 1:
            raise ValueError(f"max_responses must be at least 1, got {max_responses}")
        self.max_responses = max_responses
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, rid: str, response: dict[str, Any], messages: list[ChatMessage]) -> None:
        self._entries[rid] = StoredResponse(response, messages)
        self._entries.move_to_end(rid)
        while len(self._entries) > self.max_responses:
            _, evicted = self._entries.popitem(last=False)  # the least recently used
            if evicted.task is not None and not evicted.task.done():
                evicted.task.cancel()

    def get(self, rid: str, param: str = "response_id") -> StoredResponse:
        """The entry (now the most recently used); vLLM's 400 and 404 wording otherwise."""
        if not rid.startswith("resp_"):
            raise OpenAIError(
                f"Invalid '{param}': '{rid}'. Expected an ID that begins with 'resp'.",
                param=param,
            )
        entry = self._entries.get(rid)
        if entry is None:
            raise OpenAIError(f"Response with id '{rid}' not found.", 404, param=param)
        self._entries.move_to_end(rid)
        return entry

    def finish(self, rid: str, response: dict[str, Any]) -> None:
        """A background run's result; a cancelled (or evicted) response stays as it is."""
        entry = self._entries.get(rid)
        if entry is not None and entry.response["status"] != "cancelled":
            entry.response = response

    async def cancel(self, rid: str) -> dict[str, Any]:
        """Cancel a queued or running background response (vLLM's rule: only those)."""
        entry = self.get(rid)
        if entry.response["status"] not in ("queued", "in_progress"):
            raise OpenAIError("Cannot cancel a synchronous response.")
        entry.response = {**entry.response, "status": "cancelled"}
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()  # the run's _collect aborts the engine request
            await asyncio.gather(entry.task, return_exceptions=True)
        return entry.response
