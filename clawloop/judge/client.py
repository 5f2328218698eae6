"""Judge clients: chat messages in, the judge's text out — and never an exception.

Two implementations of one small protocol (``JudgeClient.complete``):

* ``HTTPJudgeClient`` talks to any OpenAI-compatible ``/chat/completions`` endpoint (a vLLM/SGLang server, a hosted
  API, another clawloop) over httpx. Every call has a time limit (``timeout_s``, enforced both by httpx and by an
  outer ``asyncio.wait_for`` so a server that trickles bytes cannot hold a call forever), transient failures
  (connection errors, timeouts, HTTP 408/409/429/5xx, unreadable bodies) are retried ``retries`` times with
  exponential backoff and jitter, other 4xx fail at once, and a semaphore bounds the calls in flight. Votes are
  held to a valid form by structured output where the endpoint takes it (``clawloop.judge.structured``): with
  ``structured = "auto"`` a JSON schema is sent until the endpoint rejects it once, then never again.
* ``EngineJudgeClient`` calls an in-process ``Engine`` directly (``judge_backend = engine``: the frozen base model).
  It renders the messages with the tokenizer's chat template and generates; concurrent calls batch inside the
  engine.

Whatever goes wrong ends as a ``Completion`` with ``error`` set and whatever text was received, which the caller
records as an invalid vote. Cancellation (the pipeline's per-turn deadline, shutdown) is the one thing passed
through, so a cancelled pipeline stops promptly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from clawloop.engines.base import Engine, SamplingParams
from clawloop.judge import structured as so
from clawloop.renderers import SafeChatTokenizer
from clawloop.retry import Backoff, retry_async

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


@dataclass
class Completion:
    text: str
    """What the judge wrote ('' when nothing usable came back)."""
    error: str = ""
    """Why the call failed ('' on success); the vote is then invalid."""
    latency_s: float = 0.0
    attempts: int = 1


class JudgeClient(Protocol):
    async def complete(self, messages: Sequence[dict[str, Any]], *, temperature: float, max_tokens: int,
                       seed: int | None = None) -> Completion: ...

    async def close(self) -> None: ...


class _Retryable(Exception):
    """A failure worth another try; carries the text received so far."""

    def __init__(self, message: str, text: str = ""):
        super().__init__(message)
        self.text = text


class _Fatal(Exception):
    def __init__(self, message: str, text: str = ""):
        super().__init__(message)
        self.text = text


def _chat_url(base_url: str) -> tuple[str, str]:
    """(chat completions URL, models URL) from a base URL such as ``http://host:8000/v1``."""
    base = base_url.rstrip("/")
    if base.endswith("/chat/completions"):
        base = base[: -len("/chat/completions")]
    return base + "/chat/completions", base + "/models"


class HTTPJudgeClient:
    """An OpenAI-compatible judge endpoint."""

    def __init__(self, base_url: str, model: str = "", api_key: str = "", *, timeout_s: float = 120.0,
                 retries: int = 2, backoff_s: float = 0.5, concurrency: int = 4,
                 extra_body: dict[str, Any] | None = None, transport: httpx.AsyncBaseTransport | None = None,
                 structured: str = "auto"):
        self.chat_url, self.models_url = _chat_url(base_url)
        self.model = model
        self.extra_body = dict(extra_body or {})
        """Merged into every request body (provider-specific fields such as vLLM's ``structured_outputs``)."""
        if structured not in so.MODES:
            raise ValueError(f"structured={structured!r} is not one of {', '.join(so.MODES)}")
        own = {"response_format", "structured_outputs", "guided_regex", "guided_json", "guided_grammar"}
        if structured == "auto" and own & set(self.extra_body):
            structured = "off"  # the caller constrains the output itself
        self.structured = "json_schema" if structured == "auto" else structured
        """The structured-output mode in use; ``off`` after an ``auto`` endpoint rejected the JSON schema."""
        self._structured_auto = structured == "auto"
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.concurrency = int(concurrency)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._transport = transport
        self._http: httpx.AsyncClient | None = None
        self._sem: asyncio.Semaphore | None = None
        self._model_lock: asyncio.Lock | None = None

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            self._http = httpx.AsyncClient(
                timeout=httpx.Timeout(self.timeout_s), headers=self._headers, transport=self._transport,
                limits=httpx.Limits(max_connections=max(1, self.concurrency)))
            self._sem = asyncio.Semaphore(max(1, self.concurrency))
            self._model_lock = asyncio.Lock()
        return self._http

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _resolve_model(self) -> str:
        if self.model:
            return self.model
        assert self._model_lock is not None
        async with self._model_lock:
            if not self.model:
                try:
                    resp = await asyncio.wait_for(self._client().get(self.models_url), self.timeout_s)
                except (httpx.HTTPError, asyncio.TimeoutError) as exc:
                    raise _Retryable(f"listing models failed: {type(exc).__name__}: {exc}") from None
                if resp.status_code != 200:
                    raise _Retryable(f"listing models: HTTP {resp.status_code}", resp.text[:2000])
                try:
                    self.model = str(resp.json()["data"][0]["id"])
                except (ValueError, KeyError, IndexError, TypeError):
                    raise _Retryable("listing models: unreadable body", resp.text[:2000]) from None
        return self.model

    async def _once(self, messages: Sequence[dict[str, Any]], temperature: float, max_tokens: int,
                    seed: int | None) -> str:
        body: dict[str, Any] = {**self.extra_body, "model": await self._resolve_model(), "messages": list(messages),
                                "temperature": temperature, "max_tokens": max_tokens, "stream": False}
        if seed is not None:
            body["seed"] = seed
        kind = so.vote_kind(messages)
        mode = self.structured if kind is not None else "off"
        resp = await self._post({**body, **so.request_fields(mode, kind)} if mode != "off" else body)
        if mode != "off" and resp.status_code in so.REJECTED_STATUS:
            if not self._structured_auto:
                raise _Fatal(f"HTTP {resp.status_code}: the endpoint rejected structured output "
                             f"(judge_structured_output={mode!r})", resp.text[:2000])
            rejected = resp.status_code
            resp = await self._post(body)
            mode = "off"
            if resp.status_code == 200:  # remembered only when the plain request works: it was the schema
                log.warning("clawloop judge: %s rejected structured output (HTTP %s); sending plain requests "
                            "from now on", self.chat_url, rejected)
                self.structured = "off"
        content = self._content(resp)
        return so.as_vote_text(kind, content) if mode == "json_schema" and kind is not None else content

    async def _post(self, body: dict[str, Any]) -> httpx.Response:
        try:
            return await asyncio.wait_for(self._client().post(self.chat_url, json=body), self.timeout_s)
        except asyncio.TimeoutError:
            raise _Retryable(f"timed out after {self.timeout_s:g}s") from None
        except httpx.TimeoutException as exc:
            raise _Retryable(f"timed out after {self.timeout_s:g}s ({type(exc).__name__})") from None
        except httpx.HTTPError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from None

    @staticmethod
    def _content(resp: httpx.Response) -> str:
        if resp.status_code != 200:
            err = f"HTTP {resp.status_code}"
            if resp.status_code in RETRY_STATUS:
                raise _Retryable(err, resp.text[:2000])
            raise _Fatal(err, resp.text[:2000])
        try:
            content = resp.json()["choices"][0]["message"].get("content")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise _Retryable("unreadable response body", resp.text[:2000]) from None
        if isinstance(content, list):  # content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return content if isinstance(content, str) else ""

    async def complete(self, messages: Sequence[dict[str, Any]], *, temperature: float, max_tokens: int,
                       seed: int | None = None) -> Completion:
        self._client()
        assert self._sem is not None
        start = time.monotonic()
        tried = 0

        async def attempt(n: int) -> str:
            nonlocal tried
            tried = n + 1
            return await self._once(messages, temperature, max_tokens, seed)

        async with self._sem:
            try:
                text = await retry_async(attempt, Backoff(self.retries, self.backoff_s, jitter=True),
                                         retryable=lambda exc: not isinstance(exc, _Fatal))
            except _Fatal as exc:
                return Completion(text=exc.text, error=str(exc), latency_s=time.monotonic() - start, attempts=tried)
            except _Retryable as exc:
                error, text = str(exc), exc.text
            except Exception as exc:  # noqa: BLE001 - a judge failure must never stall the pipeline
                error, text = f"{type(exc).__name__}: {exc}", ""
            else:
                return Completion(text=text, latency_s=time.monotonic() - start, attempts=tried)
        return Completion(text=text, error=f"{error} (after {self.retries + 1} attempts)",
                          latency_s=time.monotonic() - start, attempts=self.retries + 1)


def chat_template_ids(tokenizer: Any) -> Callable[[Sequence[dict[str, Any]]], list[int]]:
    """Render plain chat messages (no tools) with the tokenizer's chat template, generation prompt on."""
    safe = SafeChatTokenizer(tokenizer)  # judged text is user text: it never yields special tokens

    def render(messages: Sequence[dict[str, Any]]) -> list[int]:
        return safe.render(list(messages))[1]

    return render


class EngineJudgeClient:
    """The judge as an in-process engine (``judge_backend = engine``). Concurrent calls batch inside the engine."""

    def __init__(self, engine: Engine, render: Callable[[Sequence[dict[str, Any]]], list[int]], *,
                 timeout_s: float = 120.0, concurrency: int = 16):
        self.engine = engine
        self.render = render
        self.timeout_s = float(timeout_s)
        self.concurrency = int(concurrency)
        self._sem: asyncio.Semaphore | None = None

    async def close(self) -> None:
        """The engine belongs to whoever made it; nothing to release here."""

    async def complete(self, messages: Sequence[dict[str, Any]], *, temperature: float, max_tokens: int,
                       seed: int | None = None) -> Completion:
        if self._sem is None:
            self._sem = asyncio.Semaphore(max(1, self.concurrency))
        start = time.monotonic()
        async with self._sem:
            try:
                ids = self.render(messages)
                params = SamplingParams(temperature=temperature, top_p=1.0, max_tokens=max_tokens, seed=seed)
                gen = await asyncio.wait_for(self.engine.generate(ids, params), self.timeout_s)
            except asyncio.TimeoutError:
                return Completion(text="", error=f"timed out after {self.timeout_s:g}s",
                                  latency_s=time.monotonic() - start)
            except Exception as exc:  # noqa: BLE001 - recorded as an invalid vote
                return Completion(text="", error=f"{type(exc).__name__}: {exc}", latency_s=time.monotonic() - start)
        return Completion(text=gen.text, latency_s=time.monotonic() - start)
