"""Server-sent events shaped exactly like OpenAI's ``chat.completion.chunk`` stream.

Order of a stream: one chunk whose delta carries ``role`` (and empty content); content deltas as tokens
arrive; tool-call deltas (one per call: id, type, name and the full argument string); one chunk with an empty
delta and the ``finish_reason``; with ``stream_options.include_usage`` a last chunk with ``choices: []`` and
the ``usage`` (every other chunk then has ``"usage": null``, as OpenAI sends it); then ``data: [DONE]``.
An error after the stream has started is sent as ``data: {"error": {...}}`` followed by ``[DONE]``.

``GuardedStreamingResponse`` runs a callback once the response is over however it ended (finished, client
gone, never started), which is how a session lock held by a streamed request is always released.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


DONE = sse("[DONE]")


class ChunkMaker:
    """Builds the chunks of one streamed completion (same id, created and model on each)."""

    def __init__(self, completion_id: str, created: int, model: str, include_usage: bool):
        self.completion_id = completion_id
        self.created = created
        self.model = model
        self.include_usage = include_usage

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        chunk: dict[str, Any] = {"id": self.completion_id, "object": "chat.completion.chunk",
                                 "created": self.created, "model": self.model, "system_fingerprint": None,
                                 "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        chunk.update(extra)
        return chunk

    def delta(self, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None = None,
              finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta,
                  "logprobs": None if logprobs is None else {"content": logprobs, "refusal": None},
                  "finish_reason": finish_reason}
        return self._chunk([choice], **extra)

    def role(self) -> dict[str, Any]:
        return self.delta({"role": "assistant", "content": ""})

    def content(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return self.delta({"content": text}, logprobs)

    def tool_call(self, index: int, call: dict[str, Any]) -> dict[str, Any]:
        return self.delta({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                           "function": {"name": call["function"]["name"],
                                                        "arguments": call["function"]["arguments"]}}]})

    def finish(self, finish_reason: str, logprobs: list[dict[str, Any]] | None = None,
               **extra: Any) -> dict[str, Any]:
        return self.delta({}, logprobs, finish_reason, **extra)

    def usage(self, usage: dict[str, int]) -> dict[str, Any]:
        chunk = self._chunk([])
        chunk["usage"] = usage
        return chunk


class GuardedStreamingResponse(StreamingResponse):
    """A streaming response that calls ``on_close`` exactly once when it is over, however it ended."""

    def __init__(self, *args: Any, on_close: Callable[[], None] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            callback, self._on_close = self._on_close, None
            if callback is not None:
                callback()
