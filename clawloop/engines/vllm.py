"""An engine backed by a vLLM OpenAI-compatible server: ``clawloop.engines.base.Engine`` over HTTP.

What it asks vLLM for, and why the numbers mean what the interface promises:

* **Generation** is ``POST /v1/completions`` with the prompt as a list of token ids (no re-tokenisation), with
  ``return_token_ids`` (the exact generated ids) and ``logprobs`` + ``return_tokens_as_token_ids`` (per-token
  log-probs keyed by id). The server must run with ``--logprobs-mode processed_logprobs``: then each reported
  log-prob is read from the distribution the token was drawn from (after temperature and top-p), exactly the
  embedded engine's convention; at temperature 0 it is the plain log-softmax. (vLLM's default, ``raw_logprobs``,
  reports the un-tempered model distribution instead; ``check_logprobs_mode`` detects it, and serving runs it at
  start-up, after ``connect``.) Every request pins
  the sampling knobs clawloop does not use (top_k, min_p, penalties) so server-side defaults cannot change the
  distribution, sends the EOS ids as ``stop_token_ids`` and keeps special tokens in the text. Stop handling then
  matches the embedded engine: an EOS/stop token ends generation and stays the last id; a stop string cuts the
  text before it while the ids run up to and including the token that completed it.
* **Streaming** reads the server-sent events; a chunk may carry several tokens, whose text delta is attached to
  the chunk's last token. vLLM holds back text that could start a stop string, so the deltas concatenate to the
  final text.
* **Scoring** (``score``) never trusts an approximation silently:

  1. One probe request with ``prompt = prompt_ids + response_ids``, ``max_tokens=1`` and ``prompt_logprobs=k``
     returns, per response position, the log-prob of the response token and the top-k ids with their
     log-probs, from ``log_softmax(logits)``: vLLM applies no temperature to prompt positions. At temperature 1
     that is exact.
  2. At temperature T != 1 the wanted values are ``a*l_v - log(sum_j p_j^a)`` with ``a = 1/T`` and ``l``, ``p`` the
     untempered log-probs/probs. The sum over the ids the probe returned is known; the rest (the tail, of known
     total mass, every member at most as likely as the k-th) is bracketed by exact inequalities (``a > 1``:
     between 0 and ``tail * p_k^(a-1)``; ``a < 1``: between ``tail * p_k^(a-1)`` and ``N^(1-a) * tail^a``). The
     midpoint is used when the bracket's half-width is at most ``score_tolerance`` nats (default 1e-3) — peaked
     positions, the common case at T < 1.
  3. Positions where the bracket is wider, or where ``at_ids_T_K`` asks for ids outside the probe's top-k, are
     scored **exactly**: a one-token generation request with ``prompt = prompt_ids + response_ids[:t]``, the
     request's temperature, no top-p/top-k, and ``logprob_token_ids`` = the position's top-k ids, response token
     and requested ids. With ``processed_logprobs`` those values come from ``log_softmax(logits / T)`` over the full
     vocabulary. It costs one request per such position, so it is exact and slower; the last position goes
     first so that the others find the shared prefix in vLLM's prefix cache (which caches whole KV blocks: on
     CPU, where vLLM's default block is 128 tokens, start scoring servers with a smaller ``block_size``, e.g.
     32). Temperature never changes the order of ids, so the probe's top-k ids are the tempered top-k too.

  ``prompt_logprobs=False`` (a server with ``--enable-lora``: prompt log-probs through the CPU LoRA logits path
  crash vLLM 0.32's engine) scores every position with step 3, first asking for the top-k at that position.
  vLLM needs one spare position for the generated token, so scoring needs ``P + T < max_context``.
* **Two kinds of log-prob request never overlap.** In vLLM 0.32 a batch holding one ``logprob_token_ids`` request
  returns *every* row's log-probs gathered at ``logprob_token_ids`` columns, so a concurrent request asking for
  its top alternatives (``logprobs > 0``) silently gets the sampled token plus padding instead. The engine
  therefore admits "top-k" requests and "chosen-ids" requests in alternating groups (``_KindGate``, fair: a
  waiting group goes next); requests asking for neither run freely. This covers every request sent through one
  engine object, so give a server whose requests need top alternatives a single ``VLLMEngine`` per process (and
  do not share it with other clients asking for them). As a last guard a top-k answer with fewer finite entries
  than asked (impossible at temperature > 0 without top-p) is an error, never a result.
* **Versions.** Requests go to the model name of the current policy route (``set_policy``): the base model's
  served name, or a versioned LoRA adapter's name, so a request runs on the version it was sent to from start to
  end. The engine counts in-flight requests per model name (``inflight``/``when_idle``) and lets callers pin a
  name (``hold``) so a publisher unloads an old adapter only when nothing uses it; ``draining`` holds new
  requests (never rejects them) until those running finish, for in-place weight reloads.
  ``clawloop.engines.vllm_publish`` does publication. Per-user policies add one route per adapter name
  (``set_adapter_route``): a request naming an adapter (``SamplingParams.adapter``) goes to that name's newest
  version's model name, and its ``Generation.policy_version`` is that version.
* **Failures are EngineErrors naming the URL**: connection failures and 5xx answers are retried with exponential
  backoff (``retries``, ``backoff_s``); a server that does not answer within ``request_timeout_s`` is not retried
  (it is slow, not gone); 4xx answers are not retried; prompts that do not fit raise ``PromptTooLongError``;
  an answer missing the fields asked for is reported with a snippet of what came back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections import Counter, deque
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from clawloop.engines.base import (
    EngineError,
    check_sampling,
    Generation,
    PromptTooLongError,
    SamplingParams,
    ScoreRequest,
    ScoreResult,
    TokenEvent,
)
from clawloop.retry import Backoff, retry_async

log = logging.getLogger(__name__)

NEG_INF_JSON = -9999.0
"""vLLM writes -inf log-probs as -9999.0 (JSON has no infinity)."""
_CONTEXT_MESSAGES = ("maximum context length", "max_model_len", "context length", "too long")
_RETRY_STATUS = frozenset({500, 502, 503, 504})


@dataclass(frozen=True)
class PolicyRoute:
    """Where new requests go: the served model name of one policy version."""

    version: int
    model: str


class _KindGate:
    """Admits requests of one kind at a time ("top" or "ids"); requests of kind None pass (module docstring)."""

    def __init__(self) -> None:
        self.kind: str | None = None
        self.active = 0
        self.waiting: deque[tuple[str, asyncio.Future]] = deque()

    @contextlib.asynccontextmanager
    async def admit(self, kind: str | None):
        if kind is None:
            yield
            return
        self.waiting = deque((k, f) for k, f in self.waiting if not f.done())  # drop cancelled waiters
        if self.active == 0 and self.waiting:
            self._dispatch()
        free = self.active == 0 and not self.waiting
        joins = self.kind == kind and self.active > 0 and all(k == kind for k, _ in self.waiting)
        if free or joins:
            self.kind = kind
            self.active += 1
        else:
            fut = asyncio.get_running_loop().create_future()
            self.waiting.append((kind, fut))
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():  # admitted just before the cancellation
                    self._leave()
                raise
        try:
            yield
        finally:
            self._leave()

    def _leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._dispatch()

    def _dispatch(self) -> None:
        """With nothing running, admit the oldest waiting request and every waiting one of its kind."""
        self.kind = None
        self.waiting = deque((k, f) for k, f in self.waiting if not f.done())
        if not self.waiting:
            return
        self.kind = self.waiting[0][0]
        rest: deque[tuple[str, asyncio.Future]] = deque()
        for k, fut in self.waiting:
            if k == self.kind:
                self.active += 1
                fut.set_result(None)
            else:
                rest.append((k, fut))
        self.waiting = rest


def _logprob_kind(body: dict) -> str | None:
    if body.get("logprob_token_ids"):
        return "ids"
    return "top" if (body.get("logprobs") or 0) > 0 else None


class VLLMEngine:
    """See the module docstring. Implements ``clawloop.engines.base.Engine``."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str = "",
        tokenizer: Any = None,
        eos_token_ids: Iterable[int] | None = None,
        max_context: int | None = None,
        vocab_size: int | None = None,
        max_logprobs: int = 20,
        prompt_logprobs: bool = True,
        score_probe_k: int | None = None,
        score_tolerance: float = 1e-3,
        score_concurrency: int = 16,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        initial_version: int = 0,
    ):
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[: -len("/v1")]
        self.base_model = model
        self.api_key = api_key
        self.tokenizer = tokenizer
        if eos_token_ids is None and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos_token_ids = [int(tokenizer.eos_token_id)]
        self.eos_token_ids = tuple(sorted(set(int(i) for i in (eos_token_ids or ()))))
        self._max_context = max_context
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs
        self.prompt_logprobs = prompt_logprobs
        self.score_probe_k = min(max_logprobs, score_probe_k or max_logprobs)
        self.score_tolerance = score_tolerance
        self.score_concurrency = max(1, score_concurrency)
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.retries = max(0, retries)
        self.backoff_s = backoff_s
        self.publisher: Any = None
        """Set by a ``clawloop.engines.vllm_publish`` publisher; ``publish`` delegates to it."""
        self.adapter_publisher: Any = None
        """Set by ``vllm_publish.UserAdapterPublisher``; ``publish_adapter`` delegates to it."""
        self._adapter_routes: dict[str, PolicyRoute] = {}
        """Per adapter name (per-user policies): where that adapter's new requests go (``set_adapter_route``)."""
        self.stats = Counter()
        """Requests by kind since start: generate, stream, score_probe, score_position, retries."""

        self._route = PolicyRoute(initial_version, model)
        self._inflight: Counter[str] = Counter()
        self._holds: Counter[str] = Counter()
        self._idle_waiters: dict[str, list[asyncio.Future]] = {}
        self._drain_waiters: list[asyncio.Future] = []
        self._gate_waiters: list[asyncio.Future] = []
        self._draining = False
        self._closed = False
        self._client: httpx.AsyncClient | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._kinds = _KindGate()
        self.loop: asyncio.AbstractEventLoop | None = None
        """The event loop this engine last ran on (publishers use it from other threads)."""

    # ----------------------------------------------------------------------------------- public surface

    @property
    def policy_version(self) -> int:
        return self._route.version

    @property
    def route(self) -> PolicyRoute:
        return self._route

    @property
    def max_context(self) -> int:
        if self._max_context is None:
            raise EngineError(f"the context length of {self.base_url} is unknown: await engine.connect() first")
        return self._max_context

    async def connect(self) -> dict[str, Any]:
        """Check the server serves our model and learn its context length; returns its ``/v1/models`` entry."""
        data = await self.request("GET", "/v1/models", None, retry=True)
        models = data.get("data") if isinstance(data, dict) else None
        if not isinstance(models, list):
            raise EngineError(f"{self.base_url}/v1/models answered without a model list: {_snippet(data)}")
        entry = next((m for m in models if isinstance(m, dict) and m.get("id") == self.base_model), None)
        if entry is None:
            raise EngineError(
                f"{self.base_url} does not serve {self.base_model!r}; it serves {[m.get('id') for m in models]}"
            )
        if self._max_context is None and entry.get("max_model_len"):
            self._max_context = int(entry["max_model_len"])
        return entry

    async def check_logprobs_mode(self) -> None:
        """Fail unless the server reports log-probs of the tempered (processed) distribution.

        The gap between two ids' log-probs scales with 1/T under ``processed_logprobs`` and not under
        ``raw_logprobs``; one token of generation at T=1 and T=0.5 tells them apart.
        """
        prompt, ids = [self.eos_token_ids[0] if self.eos_token_ids else 0], [0, 1]
        gaps = []
        for temperature in (1.0, 0.5):
            body = self._neutral_body(prompt, max_tokens=1, temperature=temperature, top_p=1.0)
            body.update(logprobs=1, logprob_token_ids=ids)
            top = _first_top(await self._post_completion(body, self._route.model), self.base_url)
            gaps.append(top[ids[0]] - top[ids[1]])
        if abs(gaps[1] - 2 * gaps[0]) > 1e-3 * max(1.0, abs(gaps[0])):
            raise EngineError(
                f"{self.base_url} reports untempered log-probs; start vLLM with --logprobs-mode processed_logprobs "
                f"(gaps at T=1, 0.5: {gaps})"
            )

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        prompt_ids = self._check_prompt(prompt_ids, params)
        route = await self._acquire(params.adapter)
        try:
            body = self._generation_body(prompt_ids, params, stream=False)
            self.stats["generate"] += 1
            data = await self._post_completion(body, route.model)
            return self._parse_generation(data, prompt_ids, params, route)
        finally:
            self._release(route)

    async def generate_stream(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[TokenEvent | Generation]:
        prompt_ids = self._check_prompt(prompt_ids, params)
        route = await self._acquire(params.adapter)
        try:
            body = self._generation_body(prompt_ids, params, stream=True)
            body["model"] = route.model
            self.stats["stream"] += 1
            ids: list[int] = []
            logprobs: list[float] = []
            tops: list[list[tuple[int, float]]] | None = [] if params.top_logprobs > 0 else None
            text_parts: list[str] = []
            pending = ""  # text that arrived in a chunk without tokens rides on the next token
            finish: str | None = None
            async for chunk in self._gated_stream("/v1/completions", body):
                if not chunk.get("choices"):
                    continue  # a usage-only chunk
                choice = _first_choice(chunk, self.base_url)
                new_ids, new_lps, new_tops = self._token_fields(choice, params)
                delta = choice.get("text") or ""
                text_parts.append(delta)
                pending += delta
                for n, (token_id, lp) in enumerate(zip(new_ids, new_lps)):
                    ids.append(token_id)
                    logprobs.append(lp)
                    top = new_tops[n] if new_tops is not None else None
                    if tops is not None:
                        tops.append(top or [])
                    text_delta, pending = (pending, "") if n == len(new_ids) - 1 else ("", pending)
                    yield TokenEvent(token_id=token_id, logprob=lp, text_delta=text_delta, top_logprobs=top)
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
            if finish is None:
                raise EngineError(f"{self.base_url} ended the stream without a finish reason")
            yield Generation(
                token_ids=ids,
                logprobs=logprobs,
                finish_reason=self._finish_reason(finish),
                policy_version=route.version,
                prompt_tokens=len(prompt_ids),
                text="".join(text_parts),
                top_logprobs=tops,
            )
        finally:
            self._release(route)

    async def score(self, requests: list[ScoreRequest]) -> list[ScoreResult]:
        if self._closed:
            raise EngineError("engine is closed")
        for r in requests:
            self._check_score(r)
        if not requests:
            return []
        route = await self._acquire()
        try:
            return list(await asyncio.gather(*(self._score_one(r, route) for r in requests)))
        finally:
            self._release(route)

    @property
    def takes_adapters(self) -> bool:
        """Publication capability: whether a LoRA run publishes its adapter as such (hot-loaded by vLLM) rather
        than merged weights; the attached publisher's."""
        return bool(getattr(self.publisher, "takes_adapters", False))

    async def publish(self, weights: Any, **kwargs: Any) -> int:
        """Publish through the attached publisher (``clawloop.engines.vllm_publish``); returns the new version."""
        if self.publisher is None:
            raise EngineError("this VLLMEngine has no publisher: attach a LoRAPublisher or CheckpointPublisher")
        return await self.publisher.publish(weights, **kwargs)

    def publish_sync(self, weights: Any, timeout_s: float | None = None, **kwargs: Any) -> int:
        """Blocking ``publish`` for trainer threads: runs on the engine's event loop when it has one. Never call
        it on that loop's own thread (it would wait for itself)."""
        coro = self.publish(weights, **kwargs)
        if self.loop is not None and self.loop.is_running():
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)
        return asyncio.run(coro)

    async def close(self) -> None:
        self._closed = True
        if self.publisher is not None and hasattr(self.publisher, "aclose"):
            await self.publisher.aclose()
        client, self._client = self._client, None
        if client is not None and self._client_loop is asyncio.get_running_loop():
            await client.aclose()

    # -------------------------------------------------------------------------------- policy routing

    def set_policy(self, version: int, model: str) -> PolicyRoute:
        """Send new requests to ``model`` as ``version``; returns the previous route."""
        previous, self._route = self._route, PolicyRoute(int(version), model)
        return previous

    def set_adapter_route(self, name: str, version: int, model: str) -> PolicyRoute | None:
        """Send new requests naming adapter ``name`` (``SamplingParams.adapter``) to ``model`` as ``version``;
        returns the previous route of that name."""
        previous = self._adapter_routes.get(name)
        self._adapter_routes[name] = PolicyRoute(int(version), model)
        return previous

    def adapter_version(self, name: str) -> int | None:
        """The version new requests naming adapter ``name`` run on; None if it was never published."""
        route = self._adapter_routes.get(name)
        return None if route is None else route.version

    def remove_adapter_route(self, name: str) -> PolicyRoute | None:
        """New requests can no longer name adapter ``name``; returns its last route."""
        return self._adapter_routes.pop(name, None)

    async def remove_adapter(self, name: str) -> int:
        """Unpublish adapter ``name`` (a forgotten user's) through the attached ``UserAdapterPublisher``: no new
        request can name it, and its versions are unloaded and their folders deleted once no request runs on
        them. Returns the version it had (0: none)."""
        if self.adapter_publisher is None:
            raise EngineError("this VLLMEngine has no adapter publisher: attach a UserAdapterPublisher")
        return await self.adapter_publisher.remove(name)

    async def publish_adapter(self, name: str, adapter: Mapping[str, Any], scaling: float, *,
                              version: int | None = None) -> int:
        """Publish a LoRA adapter (PEFT tensors, ``scaling`` = alpha / r) as a new version of adapter ``name``
        through the attached ``UserAdapterPublisher``; returns its version."""
        if self.adapter_publisher is None:
            raise EngineError("this VLLMEngine has no adapter publisher: attach a UserAdapterPublisher")
        return await self.adapter_publisher.publish(name, adapter, scaling, version=version)

    def publish_adapter_sync(self, name: str, adapter: Mapping[str, Any], scaling: float, *,
                             version: int | None = None, timeout_s: float | None = None) -> int:
        """Blocking ``publish_adapter`` for trainer threads (as ``publish_sync``)."""
        coro = self.publish_adapter(name, adapter, scaling, version=version)
        if self.loop is not None and self.loop.is_running():
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)
        return asyncio.run(coro)

    def inflight(self, model: str | None = None) -> int:
        """Requests running on ``model`` (all models when None)."""
        return sum(self._inflight.values()) if model is None else self._inflight.get(model, 0)

    def in_use(self, model: str) -> bool:
        return self._inflight.get(model, 0) > 0 or self._holds.get(model, 0) > 0

    @contextlib.contextmanager
    def hold(self, model: str):
        """Keep ``model`` counted as in use (e.g. while a stale sample still needs that adapter)."""
        self._holds[model] += 1
        try:
            yield
        finally:
            self._holds[model] -= 1
            if self._holds[model] <= 0:
                del self._holds[model]
            self._wake_idle(model)

    async def when_idle(self, model: str) -> None:
        """Return once no request runs on ``model`` and nobody holds it."""
        while self.in_use(model):
            fut = asyncio.get_running_loop().create_future()
            self._idle_waiters.setdefault(model, []).append(fut)
            await fut

    @contextlib.asynccontextmanager
    async def draining(self):
        """Hold new requests (they wait, never fail) and wait for running ones; for in-place weight swaps."""
        if self._draining:
            raise EngineError("a weight swap is already in progress")
        self._draining = True
        try:
            while self.inflight() > 0:
                fut = asyncio.get_running_loop().create_future()
                self._drain_waiters.append(fut)
                await fut
            yield
        finally:
            self._draining = False
            waiters, self._gate_waiters = self._gate_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    async def _acquire(self, adapter: str | None = None) -> PolicyRoute:
        if self._closed:
            raise EngineError("engine is closed")
        if adapter is not None and adapter not in self._adapter_routes:
            raise EngineError(f"no adapter named {adapter!r} is published")
        self.loop = asyncio.get_running_loop()
        while self._draining:
            fut = self.loop.create_future()
            self._gate_waiters.append(fut)
            await fut
        route = self._route if adapter is None else self._adapter_routes.get(adapter)
        if route is None:  # unpublished (a forgotten user's) while the request waited for a weight swap
            raise EngineError(f"adapter {adapter!r} was unpublished")
        self._inflight[route.model] += 1
        return route

    def _release(self, route: PolicyRoute) -> None:
        self._inflight[route.model] -= 1
        if self._inflight[route.model] <= 0:
            del self._inflight[route.model]
            self._wake_idle(route.model)
        if self.inflight() == 0:
            waiters, self._drain_waiters = self._drain_waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    def _wake_idle(self, model: str) -> None:
        if self.in_use(model):
            return
        for fut in self._idle_waiters.pop(model, []):
            if not fut.done():
                fut.set_result(None)

    # ---------------------------------------------------------------------------------------- generation

    def _check_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        if self._closed:
            raise EngineError("engine is closed")
        ids = [int(i) for i in prompt_ids]
        if not ids:
            raise EngineError("the prompt is empty")
        self._check_ids(ids, "the prompt")
        check_sampling(params)
        if params.top_logprobs > self.max_logprobs:
            raise EngineError(
                f"top_logprobs={params.top_logprobs} exceeds the server's max_logprobs={self.max_logprobs}"
            )
        if self._max_context is not None and len(ids) + params.max_tokens > self._max_context:
            raise PromptTooLongError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context length of "
                f"{self._max_context} tokens"
            )
        return ids

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        limit = self.vocab_size
        if any(i < 0 or (limit is not None and i >= limit) for i in ids):
            raise EngineError(f"{what} holds token ids outside [0, {limit})")

    def _neutral_body(self, prompt_ids: list[int], *, max_tokens: int, temperature: float, top_p: float) -> dict:
        """A completion request with every sampling knob clawloop does not use switched off explicitly."""
        return {
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p if temperature > 0 else 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "n": 1,
            "return_tokens_as_token_ids": True,
        }

    def _generation_body(self, prompt_ids: list[int], params: SamplingParams, stream: bool) -> dict:
        body = self._neutral_body(prompt_ids, max_tokens=params.max_tokens, temperature=params.temperature,
                                  top_p=params.top_p)
        body.update(
            logprobs=params.top_logprobs,
            return_token_ids=True,
            stop=list(params.stop),
            stop_token_ids=sorted(set(self.eos_token_ids) | set(params.stop_token_ids)),
            include_stop_str_in_output=False,
            skip_special_tokens=False,
            stream=stream,
        )
        if params.seed is not None:
            body["seed"] = int(params.seed)
        if stream:
            body["stream_options"] = {"include_usage": False}
        return body

    def _token_fields(
        self, choice: dict, params: SamplingParams
    ) -> tuple[list[int], list[float], list[list[tuple[int, float]]] | None]:
        """(ids, log-probs, top alternatives) of the tokens in one choice (whole completion or a stream chunk)."""
        try:
            ids = [int(i) for i in (choice.get("token_ids") or [])]
            lp = choice.get("logprobs") or {}
            logprobs = [_float(x) for x in (lp.get("token_logprobs") or [])]
            tokens = lp.get("tokens") or []
            tops_raw = lp.get("top_logprobs") or []
        except (TypeError, ValueError, AttributeError) as exc:
            raise EngineError(f"{self.base_url} answered with malformed token data: {_snippet(choice)}") from exc
        if len(ids) != len(logprobs) or (tokens and [_token_id(t) for t in tokens] != ids):
            raise EngineError(
                f"{self.base_url} answered {len(ids)} token ids but {len(logprobs)} log-probs / tokens "
                f"{tokens[:5]}: is the server's logprobs support off? {_snippet(choice)}"
            )
        tops = None
        if params.top_logprobs > 0:
            if len(tops_raw) != len(ids):
                raise EngineError(f"{self.base_url} answered without top_logprobs: {_snippet(choice)}")
            tops = []
            for entry in tops_raw:
                pairs = sorted(((_token_id(k), _float(v)) for k, v in (entry or {}).items()), key=lambda p: -p[1])
                tops.append([(i, v) for i, v in pairs if v != float("-inf")][: params.top_logprobs])
        return ids, logprobs, tops

    def _parse_generation(self, data: dict, prompt_ids: list[int], params: SamplingParams,
                          route: PolicyRoute) -> Generation:
        choice = _first_choice(data, self.base_url)
        ids, logprobs, tops = self._token_fields(choice, params)
        return Generation(
            token_ids=ids,
            logprobs=logprobs,
            finish_reason=self._finish_reason(choice.get("finish_reason")),
            policy_version=route.version,
            prompt_tokens=len(prompt_ids),
            text=choice.get("text") or "",
            top_logprobs=tops,
        )

    def _finish_reason(self, reason: Any) -> str:
        if reason in ("stop", "length"):
            return reason
        raise EngineError(f"{self.base_url} ended generation with finish_reason={reason!r}")

    # ------------------------------------------------------------------------------------------- scoring

    def _check_score(self, r: ScoreRequest) -> None:
        if not r.prompt_ids:
            raise EngineError("score needs a non-empty prompt")
        self._check_ids([int(i) for i in r.prompt_ids], "the prompt")
        self._check_ids([int(i) for i in r.response_ids], "the response")
        if self._max_context is not None and len(r.prompt_ids) + len(r.response_ids) >= self._max_context:
            raise PromptTooLongError(
                f"prompt + response ({len(r.prompt_ids) + len(r.response_ids)} tokens) must be shorter than the "
                f"context length of {self._max_context} tokens (vLLM needs one spare position)"
            )
        if r.top_k < 0:
            raise EngineError("top_k must be >= 0")
        if r.top_k > self.max_logprobs:
            raise EngineError(f"top_k={r.top_k} exceeds the server's max_logprobs={self.max_logprobs}")
        if r.at_ids_T_K is not None:
            at = r.at_ids_T_K
            if at.ndim != 2 or at.shape[0] != len(r.response_ids):
                raise EngineError(f"at_ids_T_K must be [T={len(r.response_ids)}, K], got {tuple(at.shape)}")
            if at.numel():
                self._check_ids([int(at.min()), int(at.max())], "at_ids_T_K")

    async def _score_one(self, r: ScoreRequest, route: PolicyRoute) -> ScoreResult:
        prompt = [int(i) for i in r.prompt_ids]
        response = [int(i) for i in r.response_ids]
        T, K = len(response), r.top_k
        temperature = r.temperature if r.temperature > 0 else 1.0
        at_rows: list[list[int]] | None = r.at_ids_T_K.long().tolist() if r.at_ids_T_K is not None else None
        needed = [{response[t], *(at_rows[t] if at_rows else ())} for t in range(T)]
        values: list[dict[int, float]] = [{} for _ in range(T)]  # tempered log-probs, per position
        topk: list[list[int] | None] = [None] * T
        exact: list[int] = list(range(T))
        if T and self.prompt_logprobs:
            exact = []
            probe_k = min(max(K, self.score_probe_k), self.max_logprobs)
            probe = await self._probe(prompt, response, route, probe_k)
            for t, entry in enumerate(probe):
                ranked = sorted((rank, i) for i, (_, rank) in entry.items() if rank is not None)
                topk[t] = [i for _, i in ranked[:K]]
                if len(topk[t]) < K:
                    raise EngineError(f"{self.base_url} returned {len(topk[t])} prompt log-probs, asked for {K}")
                tempered = self._temper(entry, temperature, probe_k)
                if tempered is None or not needed[t] <= tempered.keys():
                    exact.append(t)
                else:
                    values[t] = tempered
        if exact:
            # The last position first: its prefill puts every full KV block of prompt + response in vLLM's prefix
            # cache, so the other positions' requests recompute only their last partial block.
            last = exact.pop()
            await self._score_position(prompt, response, last, temperature, topk, needed, values, route, K)
            await asyncio.gather(*(self._score_position(prompt, response, t, temperature, topk, needed, values,
                                                        route, K) for t in exact))
        logprobs_T = torch.tensor([values[t][response[t]] for t in range(T)], dtype=torch.float32)
        topk_ids_T_K = torch.tensor([topk[t] for t in range(T)], dtype=torch.long).reshape(T, K)
        topk_logprobs_T_K = torch.tensor([[values[t][i] for i in topk[t]] for t in range(T)],
                                         dtype=torch.float32).reshape(T, K)
        at_logprobs = None
        if at_rows is not None:
            width = r.at_ids_T_K.shape[1]
            at_logprobs = torch.tensor([[values[t][i] for i in at_rows[t]] for t in range(T)],
                                       dtype=torch.float32).reshape(T, width)
        return ScoreResult(
            logprobs_T=logprobs_T,
            topk_ids_T_K=topk_ids_T_K,
            topk_logprobs_T_K=topk_logprobs_T_K,
            at_ids_logprobs_T_K=at_logprobs,
            policy_version=route.version,
        )

    async def _probe(self, prompt: list[int], response: list[int], route: PolicyRoute,
                     k: int) -> list[dict[int, tuple[float, int | None]]]:
        """Per response position: {id: (untempered log-prob, rank)} for the top-k and the response token."""
        body = self._neutral_body(prompt + response, max_tokens=1, temperature=0.0, top_p=1.0)
        body["prompt_logprobs"] = k
        self.stats["score_probe"] += 1
        async with self._limit():
            data = await self._post_completion(body, route.model)
        choice = _first_choice(data, self.base_url)
        rows = choice.get("prompt_logprobs")
        P = len(prompt)
        if not isinstance(rows, list) or len(rows) != P + len(response):
            raise EngineError(
                f"{self.base_url} answered {len(rows) if isinstance(rows, list) else 'no'} prompt log-prob rows for "
                f"a {P + len(response)}-token prompt: {_snippet(choice)}"
            )
        out = []
        for t, row in enumerate(rows[P:]):
            if not isinstance(row, dict):
                raise EngineError(f"{self.base_url}: prompt log-prob row {P + t} is {_snippet(row)}")
            entry = {}
            for key, item in row.items():
                try:
                    entry[_token_id(key)] = (_float(item["logprob"]), item.get("rank"))
                except (KeyError, TypeError, ValueError) as exc:
                    raise EngineError(f"{self.base_url}: unexpected prompt log-prob item {_snippet(item)}") from exc
            if response[t] not in entry:
                raise EngineError(f"{self.base_url}: prompt log-probs at row {P + t} miss the prompt token")
            out.append(entry)
        return out

    def _temper(self, entry: dict[int, tuple[float, int | None]], temperature: float,
                probe_k: int) -> dict[int, float] | None:
        """Tempered log-probs of the probed ids, or None when the tail bracket is wider than the tolerance.

        ``entry`` holds the probe's top ``probe_k`` ids plus the response token (whatever its rank); every id not
        in it is at most as likely as the ``probe_k``-th best id.
        """
        raw = {i: lp for i, (lp, _) in entry.items()}
        if temperature == 1.0:
            return raw
        a = 1.0 / temperature
        finite = [lp for lp in raw.values() if lp > float("-inf")]
        known_mass = math.fsum(math.exp(lp) for lp in finite)
        tail = max(0.0, 1.0 - known_mass)
        head = math.fsum(math.exp(a * lp) for lp in finite)
        top = sorted((rank, lp) for lp, rank in entry.values() if rank is not None)[:probe_k]
        p_k = math.exp(top[-1][1]) if top else 0.0  # the k-th best: every unlisted id is at most this likely
        if tail <= 0.0:
            lo = hi = head
        elif a > 1.0:
            lo, hi = head, head + tail * p_k ** (a - 1.0)
        else:
            if self.vocab_size is None or p_k <= 0.0:
                return None
            n_tail = max(1, self.vocab_size - len(raw))
            lo = head + tail * p_k ** (a - 1.0)
            hi = head + n_tail ** (1.0 - a) * tail ** a
            hi = max(hi, lo)
        log_lo, log_hi = math.log(lo), math.log(hi)
        if (log_hi - log_lo) / 2 > self.score_tolerance:
            return None
        log_norm = (log_lo + log_hi) / 2
        return {i: a * lp - log_norm for i, lp in raw.items()}

    async def _score_position(self, prompt: list[int], response: list[int], t: int, temperature: float,
                              topk: list[list[int] | None], needed: list[set[int]], values: list[dict[int, float]],
                              route: PolicyRoute, K: int) -> None:
        """Exact tempered log-probs at response position t from one-token generation requests."""
        prefix = prompt + response[:t]
        got: dict[int, float] = {}
        if topk[t] is None:  # no probe: ask this position for its top-k first
            body = self._neutral_body(prefix, max_tokens=1, temperature=temperature, top_p=1.0)
            body["logprobs"] = max(K, 1)
            self.stats["score_position"] += 1
            async with self._limit():
                got.update(_first_top(await self._post_completion(body, route.model), self.base_url))
            got = {i: v for i, v in got.items() if v > float("-inf")}
            ranked = sorted(got.items(), key=lambda p: -p[1])
            if len(ranked) < K:
                raise EngineError(
                    f"{self.base_url} returned {len(ranked)} finite top log-probs at position {t}, asked for {K} "
                    "(another client's logprob_token_ids request in the same batch overrides top-k in vLLM 0.32)"
                )
            topk[t] = [i for i, _ in ranked[:K]]
        wanted = sorted((set(topk[t]) | needed[t]) - got.keys())
        if wanted:
            body = self._neutral_body(prefix, max_tokens=1, temperature=temperature, top_p=1.0)
            body.update(logprobs=1, logprob_token_ids=wanted)
            self.stats["score_position"] += 1
            async with self._limit():
                got.update(_first_top(await self._post_completion(body, route.model), self.base_url))
        missing = [i for i in wanted if i not in got]
        if missing:
            raise EngineError(f"{self.base_url} did not return log-probs for ids {missing[:5]} at position {t}")
        values[t] = got

    # ------------------------------------------------------------------------------------------ transport

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _http(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            # An httpx client belongs to the loop it first ran on; a new loop (e.g. asyncio.run per call) gets its own.
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.request_timeout_s, connect=self.connect_timeout_s),
                headers=self._headers(),
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            )
            self._client_loop = loop
            self._semaphore = asyncio.Semaphore(self.score_concurrency)
        return self._client

    def _limit(self) -> asyncio.Semaphore:
        self._http()
        assert self._semaphore is not None
        return self._semaphore

    async def _post_completion(self, body: dict, model: str) -> dict:
        body = dict(body, model=model)
        async with self._kinds.admit(_logprob_kind(body)):
            return await self.request("POST", "/v1/completions", body, retry=True)

    async def request(self, method: str, path: str, body: dict | None, *, retry: bool,
                      expect_json: bool = True) -> Any:
        """One HTTP exchange with retries (see the module docstring); the decoded JSON (or the text)."""
        url = self.base_url + path
        backoff = Backoff(self.retries if retry else 0, self.backoff_s)

        async def attempt(n: int) -> httpx.Response:
            response = await self._http().request(method, url, json=body)
            if response.status_code in _RETRY_STATUS and not backoff.is_last(n):
                raise _RetryStatus(response.status_code)
            return response

        try:
            response = await retry_async(attempt, backoff, retryable=_worth_retrying,
                                         on_retry=lambda n, exc, delay: self._count_retry(url, exc, delay))
        except httpx.TimeoutException as exc:  # only a connect timeout is retried: the server may be slow, not gone
            raise self._timeout_error(url, exc) from exc
        except httpx.TransportError as exc:
            raise EngineError(
                f"{url} is unreachable after {backoff.attempts} attempts: {type(exc).__name__}: {exc}"
            ) from exc
        if not expect_json:
            if response.status_code >= 400:
                raise self._http_error(url, response.status_code, response.text)
            return response.text
        return self._decode(url, response)

    def _timeout_error(self, url: str, exc: Exception) -> EngineError:
        return EngineError(f"{url}: no answer within {self.request_timeout_s:.0f} s ({type(exc).__name__})")

    def _count_retry(self, url: str, why: Any, delay: float) -> None:
        self.stats["retries"] += 1
        log.warning("vLLM request to %s failed (%s); retrying in %.1f s", url, why, delay)

    def _decode(self, url: str, response: httpx.Response) -> Any:
        if response.status_code >= 400:
            raise self._http_error(url, response.status_code, response.text)
        try:
            return response.json()
        except ValueError as exc:
            raise EngineError(f"{url} answered {response.status_code} with non-JSON: {response.text[:300]!r}") from exc

    def _http_error(self, url: str, status: int, text: str) -> EngineError:
        try:
            message = json.loads(text).get("error", {}).get("message") or text
        except (ValueError, AttributeError):
            message = text
        message = str(message)[:500]
        if status == 400 and any(m in message.lower() for m in _CONTEXT_MESSAGES):
            return PromptTooLongError(f"{url}: {message}")
        if status == 404:
            return EngineError(f"{url}: not found (404): {message}")
        return EngineError(f"{url} answered {status}: {message}")

    async def _gated_stream(self, path: str, body: dict) -> AsyncIterator[dict]:
        async with self._kinds.admit(_logprob_kind(body)):
            async for event in self._stream(path, body):
                yield event

    async def _stream(self, path: str, body: dict) -> AsyncIterator[dict]:
        """Server-sent events of a streaming request; connection failures before the first event are retried."""
        url = self.base_url + path
        backoff = Backoff(self.retries, self.backoff_s)

        async def attempt(n: int) -> httpx.Response:
            client = self._http()
            response = await client.send(client.build_request("POST", url, json=body), stream=True)
            if response.status_code >= 400:
                try:
                    text = (await response.aread()).decode("utf-8", "replace")
                finally:
                    await response.aclose()
                if response.status_code in _RETRY_STATUS and not backoff.is_last(n):
                    raise _RetryStatus(response.status_code)
                raise self._http_error(url, response.status_code, text)
            return response

        try:
            response = await retry_async(attempt, backoff, retryable=_worth_retrying_stream,
                                         on_retry=lambda n, exc, delay: self._count_retry(url, exc, delay))
            try:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        return
                    try:
                        event = json.loads(payload)
                    except ValueError as exc:
                        raise EngineError(f"{url} streamed non-JSON: {payload[:300]!r}") from exc
                    if isinstance(event, dict) and "error" in event and "choices" not in event:
                        raise EngineError(f"{url} failed mid-stream: {_snippet(event['error'])}")
                    yield event
                raise EngineError(f"{url} closed the stream before [DONE]")
            finally:
                await response.aclose()
        except httpx.TimeoutException as exc:
            raise self._timeout_error(url, exc) from exc
        except httpx.TransportError as exc:
            raise EngineError(f"{url}: stream failed: {type(exc).__name__}: {exc}") from exc


# ------------------------------------------------------------------------------------------------ helpers


class _RetryStatus(Exception):
    """An HTTP status worth another try (on the last try the answer is reported as it is)."""

    def __init__(self, status: int):
        super().__init__(f"HTTP {status}")


def _worth_retrying(exc: BaseException) -> bool:
    """Connection failures and 5xx answers; of the timeouts only a connect timeout (a slow server is not gone)."""
    if isinstance(exc, httpx.TimeoutException):
        return isinstance(exc, httpx.ConnectTimeout)
    return isinstance(exc, (httpx.TransportError, _RetryStatus))


def _worth_retrying_stream(exc: BaseException) -> bool:
    """Before a stream's first event: a refused connection and 5xx answers (no timeout)."""
    return isinstance(exc, (httpx.ConnectError, _RetryStatus))


def _token_id(token: Any) -> int:
    """An id from vLLM's ``"token_id:123"`` (``return_tokens_as_token_ids``) or ``"123"`` keys."""
    text = str(token)
    if text.startswith("token_id:"):
        text = text[len("token_id:"):]
    return int(text)


def _float(value: Any) -> float:
    x = float(value)
    return float("-inf") if x <= NEG_INF_JSON else x


def _snippet(value: Any, limit: int = 300) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _first_choice(data: Any, url: str) -> dict:
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EngineError(f"{url} answered without choices: {_snippet(data)}")
    return choices[0]


def _first_top(data: Any, url: str) -> dict[int, float]:
    """{id: log-prob} of the first generated token's ``top_logprobs`` entry."""
    choice = _first_choice(data, url)
    try:
        entry = choice["logprobs"]["top_logprobs"][0]
        return {_token_id(k): _float(v) for k, v in entry.items()}
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise EngineError(f"{url} answered without top log-probs: {_snippet(choice)}") from exc
