"""The OpenAI-compatible HTTP surface: FastAPI routes on top of an engine, the store and the session manager.

Routes (each chat/model route is also mounted under ``/sessions/{session_id}``, which names the session):

* ``POST /v1/chat/completions`` — plain or streamed; see ``ChatService.chat``.
* ``GET /v1/models``, ``GET /v1/models/{id}`` — the one served model.
* ``POST /v1/sessions/{id}/end`` — end a session (its pending turn is dropped as ``no_next_state``).
* ``GET /v1/status`` — run status as JSON (samples waiting, turns by state, drop reasons, policy version,
  last optimizer step). With per-user keys a user key gets its own figures only (its turns by state, drop
  reasons and live sessions, plus the policy version and judge set-up); the run-wide status is admin data and
  answers whoever passes ``require_admin`` (e.g. the admin key).
* ``GET /healthz`` and ``GET /metrics`` (Prometheus text) — open, no key needed.

Order of work in a chat request: API key -> body (size-limited read, JSON) -> validation -> rendering and the
context-length check -> session (lock + pairing of the previous turn; main turns only) -> generation (awaited,
the engine runs on its own thread, the event loop never waits on the model) -> the turn is committed to the
store -> the answer goes out. For a stream the commit happens after the last token and before the chunk with
the ``finish_reason``; a stream the client abandons is not stored (the client never saw the whole answer). An
error after a stream's headers went out ends the stream with the error event a non-streamed request would have
been answered with (``stream_error``): a full disk is ``storage_unavailable`` either way.

Every response to a chat request carries ``X-Session-Id`` and ``X-Policy-Version`` headers and a ``clawloop``
field (``session_id``, ``turn_id`` (None for side turns), ``policy_version``, ``turn_type``, and for main turns
``paired_turn_id``); in a stream the field rides on the ``finish_reason`` chunk, and its ``policy_version`` is the
writer's while the header, sent before the engine takes the request, names the version served on arrival. Turn
ids are the store's own (one sequence for the whole run) in the shared namespace; a per-user key is given opaque
ids instead (``auth.TurnIdMask``), which do not count other keys' turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from clawloop.api.bodies import read_json_body
from clawloop.api.auth import KeyRing, TurnIdMask, is_admin, require_user
from clawloop.api.errors import APIError, bad_request, error_body, install_error_handlers
from clawloop.api.guard import BrowserGuard, CatchAll, storage_failure, storage_unavailable_body
from clawloop.api.metrics import ServingMetrics, labelled
from clawloop.api.schemas import (
    ChatRequest,
    parse_chat_request,
    parse_flag_header,
    validate_session_id,
    validate_turn_type,
)
from clawloop.api.sessions import OwnerClosed, SessionManager, TurnContext
from clawloop.api.streaming import DONE, ChunkMaker, GuardedStreamingResponse, sse
from clawloop.api.token_texts import TokenTexts
from clawloop.config import Config
from clawloop.engines.base import Engine, EngineError, Generation, PromptTooLongError, SamplingParams, TokenEvent
from clawloop.judge.describe import describe as describe_judge
from clawloop.openclaw_format import housekeeping_kind
from clawloop.renderers import (ChatRenderer, ParsedAnswer, RenderedPrompt, TemplateRefusedError, ToolCallStreamFilter,
                                assistant_message, parse_answer)
from clawloop.store import Store, TurnRecord

log = logging.getLogger("clawloop.api")

SESSION_HEADER = "x-session-id"
TURN_TYPE_HEADER = "x-turn-type"
SESSION_DONE_HEADER = "x-session-done"
POLICY_VERSION_HEADER = "X-Policy-Version"


# ------------------------------------------------------------------------------------------------ service


def _headers(session_id: str, policy_version: int) -> dict[str, str]:
    return {"X-Session-Id": session_id, POLICY_VERSION_HEADER: str(policy_version)}


def being_forgotten() -> APIError:
    """The answer to a request of an owner whose records are being forgotten right now."""
    return APIError(409, "This key's data is being forgotten right now; send the request again in a moment.",
                    "invalid_request_error", None, "user_being_forgotten")


def stream_error(exc: Exception) -> dict[str, Any]:
    """The error event that ends a stream which failed after its headers went out: the error body a non-streamed
    request would have been answered with (so a full disk is ``storage_unavailable`` here too)."""
    if isinstance(exc, APIError):
        log.warning("stream ended with %s: %s", exc.code, exc.message)
        return exc.body()
    if storage_failure(exc):
        log.error("storage failure while streaming: %s", exc)
        return storage_unavailable_body()
    log.error("internal error while streaming", exc_info=exc)
    return error_body("The server had an internal error while streaming.", "server_error", None, "internal_error")


def warn_context_overflow(prompt_len: int, context: int, max_tokens: int | None) -> None:
    """Say in the server log why a client gets ``context_length_exceeded``: clients often only report 'context
    overflow' and the person running the server has to know which side to change."""
    asked = f" + {max_tokens} completion tokens requested" if max_tokens is not None else ""
    log.warning("prompt of %d tokens%s does not fit the served context of %d tokens; the request is refused "
                "(400 context_length_exceeded). Shorten the client's prompt (for OpenClaw: `clawloop "
                "openclaw-config` writes settings that fit this model) or serve a model with a longer context.",
                prompt_len, asked, context)


@dataclasses.dataclass
class PreparedChat:
    req: ChatRequest
    rendered: RenderedPrompt
    params: SamplingParams
    session_id_given: str | None
    turn_type: str
    session_done: bool


class ChatService:
    """Everything one chat request needs; the FastAPI routes are thin wrappers around it."""

    def __init__(self, config: Config, engine: Engine, store: Store, sessions: SessionManager,
                 tokenizer: Any = None, metrics: ServingMetrics | None = None):
        self.config = config
        self.engine = engine
        self.store = store
        self.sessions = sessions
        self.tokenizer = tokenizer if tokenizer is not None else getattr(engine, "tokenizer")
        self.renderer = ChatRenderer(self.tokenizer)
        self.token_texts = TokenTexts(self.tokenizer)
        self.metrics = metrics or ServingMetrics()
        self.started_at = int(time.time())
        self.end_ids = frozenset(getattr(self.tokenizer, "all_special_ids", []) or []) | frozenset(
            getattr(engine, "eos_token_ids", ()) or ())
        self.extra_stats: dict[str, int] = {"streams_abandoned": 0, "engine_errors": 0, "requests_abandoned": 0}
        # Only per-user keys need masked ids; the shared namespace keeps the store's ids (and writes no secret).
        self.turn_ids = TurnIdMask.of_store(store) if KeyRing.from_config(config).per_user else TurnIdMask.unused()

    # ---- preparation ---------------------------------------------------------------------------------
    def prepare(self, body: Any, headers: Any, path_session_id: str | None) -> PreparedChat:
        req = parse_chat_request(body)
        session_id = path_session_id
        if session_id is None and headers.get(SESSION_HEADER) is not None:
            session_id = validate_session_id(headers[SESSION_HEADER], "X-Session-Id")
        if session_id is None:
            session_id = req.session_id
        turn_type = req.turn_type
        if headers.get(TURN_TYPE_HEADER) is not None:
            turn_type = validate_turn_type(headers[TURN_TYPE_HEADER], "X-Turn-Type")
        if turn_type is None and housekeeping_kind(req.messages):
            turn_type = "side"  # an agent's own bookkeeping (memory flush, summary, title) is not a conversation
        turn_type = turn_type or self.config.default_turn_type
        done = parse_flag_header(headers.get(SESSION_DONE_HEADER), "X-Session-Done") or req.session_done
        context = int(self.engine.max_context)
        at_least = self.renderer.token_lower_bound(req.messages, req.tools)
        if at_least >= context:  # refused before the CPU goes into tokenising a huge prompt
            warn_context_overflow(at_least, context, req.max_tokens)
            raise bad_request(f"This model's maximum context length is {context} tokens; the messages take at "
                              f"least {at_least} tokens. Shorten the messages.", "messages",
                              "context_length_exceeded")
        try:
            rendered = self.renderer.render(req.messages, req.tools, req.tool_choice)
        except TemplateRefusedError as exc:
            raise bad_request(f"The model's chat template refused these messages: {exc}", "messages",
                              "template_refused") from None
        params = self._sampling(req, len(rendered.ids))
        return PreparedChat(req, rendered, params, session_id, turn_type, done)

    def _sampling(self, req: ChatRequest, prompt_len: int) -> SamplingParams:
        context = int(self.engine.max_context)
        room = context - prompt_len
        if room < 1 or (req.max_tokens is not None and req.max_tokens > room):
            warn_context_overflow(prompt_len, context, req.max_tokens)
            if room < 1:
                raise bad_request(f"This model's maximum context length is {context} tokens; the messages take "
                                  f"{prompt_len} tokens. Shorten the messages.", "messages",
                                  "context_length_exceeded")
            raise bad_request(f"This model's maximum context length is {context} tokens; the messages take "
                              f"{prompt_len} tokens and {req.max_tokens} were requested for the completion.",
                              "max_tokens", "context_length_exceeded")
        max_tokens = req.max_tokens if req.max_tokens is not None else min(self.config.default_max_tokens, room)
        temperature = self.config.default_temperature if req.temperature is None else req.temperature
        return SamplingParams(
            temperature=float(temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p),
            max_tokens=max_tokens,
            stop=tuple(req.stop),
            seed=None if req.seed is None else req.seed % (2**63),
            top_logprobs=req.top_logprobs if req.logprobs else 0,
        )

    # ---- pieces of the answer ------------------------------------------------------------------------
    def visible_count(self, gen: Generation) -> int:
        """Tokens the client sees: all but a final end-of-sequence token."""
        ids = gen.token_ids
        if gen.finish_reason == "stop" and ids and ids[-1] in self.end_ids:
            return len(ids) - 1
        return len(ids)

    def logprob_entry(self, token_id: int, logprob: float, top: list[tuple[int, float]] | None) -> dict[str, Any]:
        entry = self.token_texts.entry(token_id, logprob)
        entry["top_logprobs"] = [self.token_texts.entry(i, lp) for i, lp in (top or [])]
        return entry

    def logprobs_content(self, gen: Generation) -> list[dict[str, Any]]:
        n = self.visible_count(gen)
        tops = gen.top_logprobs or [None] * len(gen.token_ids)
        return [self.logprob_entry(gen.token_ids[i], gen.logprobs[i], tops[i]) for i in range(n)]

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def turn_record(self, prep: PreparedChat, gen: Generation, message: dict[str, Any],
                    finish_reason: str) -> TurnRecord:
        # tools = the tools the model was shown, so ChatRenderer.render(messages, tools) re-renders prompt_ids.
        return TurnRecord(
            session_id="", messages=prep.req.messages, prompt_ids=list(prep.rendered.ids),
            response_ids=list(gen.token_ids), logprobs=list(gen.logprobs), temperature=prep.params.temperature,
            top_p=prep.params.top_p, policy_version=gen.policy_version, response_text=gen.text,
            assistant_message=message, tools=prep.rendered.tools, finish_reason=finish_reason)

    def _extension(self, session_id: str, turn_id: int | None, policy_version: int, turn_type: str,
                   ctx: TurnContext | None, owner: str) -> dict[str, Any]:
        ext: dict[str, Any] = {"session_id": session_id, "turn_id": self.turn_ids.public(owner, turn_id),
                               "policy_version": policy_version, "turn_type": turn_type}
        if ctx is not None:
            ext["paired_turn_id"] = self.turn_ids.public(owner, ctx.paired_turn_id)
        return ext

    # ---- whose policy answers ---------------------------------------------------------------------------
    def adapter_of(self, owner: str) -> str | None:
        """Per-user policies (``policy_scope = "per_user"``): the caller's own adapter once one is published, else
        None (the base model, which every user's adapter starts from). A key can name no other adapter: the name
        is the key's own owner name, never taken from the request."""
        if self.config.policy_scope != "per_user" or not owner:
            return None
        return owner if self.engine.adapter_version(owner) is not None else None

    def version_for(self, owner: str) -> int:
        """The version a new request of ``owner`` starts on."""
        adapter = self.adapter_of(owner)
        version = None if adapter is None else self.engine.adapter_version(adapter)  # None: unpublished meanwhile
        return int(self.engine.policy_version) if version is None else int(version)

    # ---- the request -----------------------------------------------------------------------------------
    async def chat(self, request: Request, path_session_id: str | None = None) -> Any:
        owner = require_user(request)
        if self.sessions.is_closed(owner):
            raise being_forgotten()
        ctx: TurnContext | None = None
        arrived = self.sessions.arrival(owner)  # a forget beginning from here on refuses this request
        body = await read_json_body(request, self.config.max_body_bytes)
        # Validation, the chat template and tokenisation run off the event loop (long agent prompts).
        prep = await asyncio.to_thread(self.prepare, body, request.headers, path_session_id)
        adapter = self.adapter_of(owner)
        if adapter is not None:
            prep.params = dataclasses.replace(prep.params, adapter=adapter)
        if prep.turn_type == "main":
            try:
                ctx = await self.sessions.begin_main(prep.session_id_given, prep.req.messages, owner=owner,
                                                     arrived=arrived)
            except OwnerClosed:
                raise being_forgotten() from None
            session_id = ctx.session_id
        else:
            session_id = self.sessions.resolve_side(prep.session_id_given, prep.req.messages, owner=owner)
        if prep.req.stream:
            handed_over = False
            try:
                response = GuardedStreamingResponse(
                    self._stream(prep, ctx, session_id, owner), media_type="text/event-stream",
                    headers={**_headers(session_id, self.version_for(owner)), "Cache-Control": "no-cache",
                             "X-Accel-Buffering": "no"},
                    on_close=None if ctx is None else ctx.release,
                    send_timeout_s=self.config.stream_send_timeout_s)
                handed_over = True
                return response
            finally:
                if ctx is not None and not handed_over:
                    ctx.release()
        try:
            return await self._complete(prep, ctx, session_id, owner, request)
        finally:
            if ctx is not None:
                ctx.release()

    async def _generate(self, prep: PreparedChat) -> Generation:
        try:
            return await self.engine.generate(prep.rendered.ids, prep.params)
        except PromptTooLongError as exc:
            raise bad_request(str(exc), "messages", "context_length_exceeded") from None
        except EngineError as exc:
            self.extra_stats["engine_errors"] += 1
            log.error("engine failed: %s", exc)
            raise APIError(500, f"The model engine failed: {exc}", "server_error", None, "engine_error") from None

    async def _generate_while_connected(self, prep: PreparedChat, request: Request | None) -> Generation:
        """Generate, cancelling as soon as the client disconnects (nobody would receive the answer, so it is
        neither finished nor stored)."""
        if request is None:
            return await self._generate(prep)

        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        generation = asyncio.ensure_future(self._generate(prep))
        watcher = asyncio.ensure_future(gone())
        try:
            await asyncio.wait({generation, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not generation.done():  # the client left (or this request was cancelled): stop generating
                generation.cancel()
                await asyncio.gather(generation, return_exceptions=True)
        if generation.cancelled():
            self.extra_stats["requests_abandoned"] += 1
            raise APIError(499, "The client closed the request before the answer was ready; nothing was stored.",
                           "invalid_request_error", None, "client_closed_request")
        return generation.result()

    async def _record_answer(self, prep: PreparedChat, gen: Generation, parsed: ParsedAnswer,
                             ctx: TurnContext | None, owner: str) -> tuple[dict[str, Any], str, int | None]:
        """(assistant message, finish reason, turn id) of a finished answer, streamed or not: the turn is committed
        to its session (which ends when the request says so) and counted in the metrics."""
        message = assistant_message(parsed)
        finish_reason = "tool_calls" if parsed.tool_calls else gen.finish_reason
        turn_id = None
        if ctx is not None:
            turn_id = await ctx.commit(self.turn_record(prep, gen, message, finish_reason))
            if prep.session_done:
                await ctx.end_session()
        elif prep.session_done and prep.session_id_given is not None:
            await self.sessions.end_if_exists(prep.session_id_given, "done", owner=owner)
        self.metrics.record_turn(prep.turn_type, len(prep.rendered.ids), len(gen.token_ids), ctx is not None)
        return message, finish_reason, turn_id

    async def _complete(self, prep: PreparedChat, ctx: TurnContext | None, session_id: str, owner: str = "",
                        request: Request | None = None) -> JSONResponse:
        gen = await self._generate_while_connected(prep, request)
        parsed = parse_answer(gen.text, prep.rendered.tools is not None)
        message, finish_reason, turn_id = await self._record_answer(prep, gen, parsed, ctx, owner)
        choice_message = dict(message)
        choice_message["refusal"] = None
        body = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.config.served_model_name,
            "system_fingerprint": None,
            "choices": [{
                "index": 0,
                "message": choice_message,
                "logprobs": {"content": self.logprobs_content(gen), "refusal": None} if prep.req.logprobs else None,
                "finish_reason": finish_reason,
            }],
            "usage": self.usage(len(prep.rendered.ids), len(gen.token_ids)),
            "clawloop": self._extension(session_id, turn_id, gen.policy_version, prep.turn_type, ctx, owner),
        }
        return JSONResponse(body, headers=_headers(session_id, gen.policy_version))

    async def _stream(self, prep: PreparedChat, ctx: TurnContext | None, session_id: str,
                      owner: str = "") -> AsyncIterator[str]:
        maker = ChunkMaker(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.config.served_model_name,
                           prep.req.include_usage)
        want_logprobs = prep.req.logprobs
        tools_active = prep.rendered.tools is not None
        filt = ToolCallStreamFilter(tools_active)
        entries: list[dict[str, Any]] = []  # log-prob entries not yet sent
        sent_entries = 0
        gen: Generation | None = None
        finished = False
        try:
            yield sse(maker.role())
            try:
                async with contextlib.aclosing(self.engine.generate_stream(prep.rendered.ids, prep.params)) as it:
                    async for item in it:
                        if isinstance(item, TokenEvent):
                            if want_logprobs:
                                entries.append(self.logprob_entry(item.token_id, item.logprob, item.top_logprobs))
                            delta = filt.feed(item.text_delta)
                            if delta:
                                # The newest token may turn out to be the end-of-sequence token: send it later.
                                lp = None
                                if want_logprobs:
                                    lp = entries[sent_entries: len(entries) - 1]
                                    sent_entries = len(entries) - 1
                                yield sse(maker.content(delta, lp))
                        else:
                            gen = item
            except (PromptTooLongError, EngineError) as exc:
                self.extra_stats["engine_errors"] += 1
                log.error("engine failed while streaming: %s", exc)
                code = "context_length_exceeded" if isinstance(exc, PromptTooLongError) else "engine_error"
                kind = "invalid_request_error" if isinstance(exc, PromptTooLongError) else "server_error"
                yield sse({"error": {"message": str(exc), "type": kind, "param": None, "code": code}})
                yield DONE
                finished = True
                return
            if gen is None:
                raise RuntimeError("the engine stream ended without a final Generation")
            rest, parsed = filt.finish()
            tail_lp = None
            if want_logprobs:
                tail_lp = entries[sent_entries: self.visible_count(gen)]
            if rest:
                yield sse(maker.content(rest, tail_lp))
                tail_lp = [] if want_logprobs else None
            for i, call in enumerate(parsed.tool_calls):
                yield sse(maker.tool_call(i, call))
            _, finish_reason, turn_id = await self._record_answer(prep, gen, parsed, ctx, owner)
            ext = self._extension(session_id, turn_id, gen.policy_version, prep.turn_type, ctx, owner)
            yield sse(maker.finish(finish_reason, tail_lp if tail_lp else None, clawloop=ext))
            if prep.req.include_usage:
                yield sse(maker.usage(self.usage(len(prep.rendered.ids), len(gen.token_ids))))
            yield DONE
            finished = True
        except Exception as exc:  # after the headers went out the only way to report is in the stream
            yield sse(stream_error(exc))
            yield DONE
            finished = True
        finally:
            if not finished:
                self.extra_stats["streams_abandoned"] += 1
            if ctx is not None:
                ctx.release()

    # ---- other routes ----------------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict[str, Any]:
        # max_model_len (as vLLM reports it): the real context, read by `clawloop openclaw-config`.
        return {"id": self.config.served_model_name, "object": "model", "created": self.started_at,
                "owned_by": "clawloop", "max_model_len": int(self.engine.max_context)}

    def judge_setup(self) -> dict[str, Any]:
        """Which judge this server runs and what it can see (configuration, no activity)."""
        return {**describe_judge(self.config), "judging": bool(self.config.train)}

    async def user_status(self, owner: str) -> dict[str, Any]:
        """What a per-user key may see of the run: its own turns and sessions, and what serves it."""
        turns, reasons = await asyncio.gather(asyncio.to_thread(self.store.count_turns, owner),
                                              asyncio.to_thread(self.store.drop_reasons, owner))
        return {
            "object": "clawloop.status",
            "scope": "user",
            "model": self.config.served_model_name,
            "policy_version": self.version_for(owner),
            "turns_by_state": turns,
            "drop_reasons": reasons,
            "judge": self.judge_setup(),
            "live_sessions": self.sessions.live_count(owner),
            "uptime_s": round(time.time() - self.started_at, 3),
        }

    async def status(self) -> dict[str, Any]:
        """The whole run's status (admin data once keys are per-user)."""
        turns, reasons, samples, last, votes = await asyncio.gather(
            asyncio.to_thread(self.store.count_turns), asyncio.to_thread(self.store.drop_reasons),
            asyncio.to_thread(self.store.count_samples), asyncio.to_thread(self.store.last_step),
            asyncio.to_thread(self.store.vote_stats))
        return {
            "object": "clawloop.status",
            "scope": "run",
            "model": self.config.served_model_name,
            "policy_version": self.engine.policy_version,
            "samples_waiting": int(samples.get("ready", 0)),
            "samples_by_state": samples,
            "turns_by_state": turns,
            "drop_reasons": reasons,
            "judge": {**self.judge_setup(), **votes},
            "live_sessions": len(self.sessions),
            "last_step": None if last is None else {"step": last[0], "metrics": last[1]},
            "uptime_s": round(time.time() - self.started_at, 3),
        }

    async def metrics_text(self) -> str:
        turns, samples = await asyncio.gather(asyncio.to_thread(self.store.count_turns),
                                              asyncio.to_thread(self.store.count_samples))
        stats = self.sessions.stats
        gauges = {
            "clawloop_policy_version": ("Version of the weights serving new requests.",
                                        {(): float(self.engine.policy_version)}),
            "clawloop_live_sessions": ("Sessions held in memory.", {(): float(len(self.sessions))}),
            "clawloop_turns": ("Stored turns by state.", labelled(turns, "state")),
            "clawloop_samples": ("Training samples by state.", labelled(samples, "state")),
        }
        ended = {k[len("sessions_ended_"):]: v for k, v in stats.items() if k.startswith("sessions_ended_")}
        pairing = {k[len("pairing_"):]: v for k, v in stats.items() if k.startswith("pairing_")}
        counters = {
            "clawloop_sessions_started_total": ("Sessions opened.", {(): float(stats.get("sessions_started", 0))}),
            "clawloop_sessions_ended_total": ("Sessions ended, by cause.", labelled(ended, "cause")),
            "clawloop_pairings_total": ("Previous turns paired with a next state, by how the answer was found.",
                                        labelled(pairing, "how")),
            "clawloop_streams_abandoned_total": ("Streams the client left before the end (not stored).",
                                                 {(): float(self.extra_stats["streams_abandoned"])}),
            "clawloop_engine_errors_total": ("Generations the engine failed.",
                                             {(): float(self.extra_stats["engine_errors"])}),
        }
        return self.metrics.render(gauges, counters)


# ------------------------------------------------------------------------------------------ middleware


class RequestMetricsMiddleware:
    """Counts every HTTP request by route template and status, and times it to the last byte sent."""

    def __init__(self, app: ASGIApp, metrics: ServingMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500, "recorded": False}

        def record() -> None:
            if status["recorded"]:
                return
            status["recorded"] = True
            route = scope.get("route")
            name = getattr(route, "path", None) or "unmatched"
            self.metrics.record_request(name, scope.get("method", ""), int(status["code"]),
                                        time.perf_counter() - start)

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                record()

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            record()


# ------------------------------------------------------------------------------------------------- app


def create_app(service: ChatService, lifespan: Any = None) -> FastAPI:
    """The FastAPI app; ``lifespan`` (an async context manager factory) runs around serving. Routes mounted on it
    later (the trainer routes, the dashboard: ``clawloop.assemble``) pass through the same middlewares."""
    app = FastAPI(title="clawloop", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    install_error_handlers(app)
    config = service.config

    async def chat(request: Request) -> Any:
        return await service.chat(request)

    async def chat_in_session(request: Request, session_id: str) -> Any:
        return await service.chat(request, validate_session_id(session_id, "session_id"))

    async def models(request: Request) -> Any:
        require_user(request)
        return service.models()

    async def models_in_session(request: Request, session_id: str) -> Any:
        return await models(request)

    async def model(request: Request, model_id: str) -> Any:
        require_user(request)
        if model_id != config.served_model_name:
            raise APIError(404, f"The model {model_id!r} does not exist.", "invalid_request_error", "model",
                           "model_not_found")
        return service.model_card()

    async def end_session(request: Request, session_id: str) -> Any:
        owner = require_user(request)
        sid = validate_session_id(session_id, "session_id")
        known, dropped = await service.sessions.end(sid, owner=owner)
        if not known:
            raise APIError(404, f"No live session {sid!r}.", "invalid_request_error", "session_id",
                           "session_not_found")
        return {"id": sid, "object": "session", "ended": True,
                "dropped_turn_id": service.turn_ids.public(owner, dropped)}

    async def status(request: Request) -> Any:
        if is_admin(request, config):
            return await service.status()
        owner = require_user(request)
        return await (service.user_status(owner) if owner else service.status())

    async def healthz() -> Any:
        return {"status": "ok", "model": config.served_model_name, "policy_version": service.engine.policy_version}

    async def metrics() -> Any:
        return PlainTextResponse(await service.metrics_text(), media_type="text/plain; version=0.0.4")

    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/sessions/{session_id}/v1/chat/completions", chat_in_session, methods=["POST"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/sessions/{session_id}/v1/models", models_in_session, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", model, methods=["GET"])
    app.add_api_route("/v1/sessions/{session_id}/end", end_session, methods=["POST"])
    app.add_api_route("/v1/status", status, methods=["GET"])
    app.add_api_route("/healthz", healthz, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_middleware(CatchAll)
    app.add_middleware(RequestMetricsMiddleware, metrics=service.metrics)
    app.add_middleware(BrowserGuard, config=config)  # outermost: refused requests reach no route
    app.state.service = service
    app.state.keyring = KeyRing.from_config(config)
    return app
