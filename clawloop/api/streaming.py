"""Server-sent events shaped exactly like OpenAI's ``chat.completion.chunk`` stream.

Order of a stream: one chunk whose delta carries ``role`` (and empty content); content deltas as tokens
arrive; tool-call deltas (one per call: id, type, name and the full argument string); one chunk with an empty
delta and the ``finish_reason``; with ``stream_options.include_usage`` a last chunk with ``choices: []`` and
the ``usage`` (every other chunk then has ``"usage": null``, as OpenAI sends it); then ``data: [DONE]``.
An error after the stream has started is sent as ``data: {"error": {...}}`` followed by ``[DONE]``.

``GuardedStreamingResponse`` runs a callback once the response is over however it ended (finished, client
gone, never started, or cut off because its client stopped reading), which is how a session lock held by a
streamed request is always released, and released in bounded time: a client that keeps its connection open but
reads nothing would otherwise hold its session, and everything that waits for it, for as long as it likes.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send


log = logging.getLogger(__name__)


class ReaderStalled(Exception):
    """A streamed chunk was not taken by the client within the response's send timeout."""


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
    """A streaming response that calls ``on_close`` exactly once when it is over, however it ended. With
    ``send_timeout_s``, a chunk the client has not taken within that long (its reads stopped, the connection's
    buffers are full) ends the response: the request lets go of its session, and the server closes the
    connection once what it already buffered is read or the client leaves."""

    def __init__(self, *args: Any, on_close: Callable[[], None] | None = None, send_timeout_s: float | None = None,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._on_close = on_close
        self._send_timeout_s = send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout_s = self._send_timeout_s

        async def send_in_time(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout_s)
            except TimeoutError:
                raise ReaderStalled(f"the client read nothing of its stream for {timeout_s:g} s") from None

        try:
            await super().__call__(scope, receive, send if timeout_s is None else send_in_time)
        except ReaderStalled as exc:
            log.warning("stream on %s cut off: %s", scope.get("path"), exc)
        finally:
            callback, self._on_close = self._on_close, None
            if callback is not None:
                callback()
