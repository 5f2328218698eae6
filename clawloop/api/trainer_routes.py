"""The trainer's side door into the API process: remote trainers lease batches, acknowledge them and report
new weights over authenticated HTTP, so the trainer can run as its own process (or ``torchrun`` job).

Routes (all ``POST`` with a JSON body, except ``GET /v1/trainer/state``):

* ``/v1/trainer/lease {n, min_n, lease_s, lease_id?}`` → ``{lease_id, samples: [...], waiting}``; each sample
  carries its turn (prompt/response ids exactly as generated, behaviour log-probs, temperature, policy version,
  messages) and its judge/teacher outcome (reward, kind, hints, targets as base64 safetensors). A ``lease_id``
  chosen by the trainer makes the call safe to retry: a lease that still holds samples under it is answered
  again instead of leasing more.
* ``/v1/trainer/heartbeat {lease_id, lease_s}`` extends the lease; 409 when it was lost.
* ``/v1/trainer/commit {lease_id, step, policy_version, metrics, turn_ids}`` → ``store.commit_step``; 409 only
  when the lease was lost (its samples expired and went to another trainer), so a step is acknowledged at most
  once. Any other failure of the store (disk full, database locked) is a 503 (``store_unavailable``, OpenAI's
  error shape, ``Retry-After``) that the trainer tries again: its update is already in its weights, so it must
  not give the batch back. Every route answers a store failure so.
* ``/v1/trainer/next_version {at_least}``, ``/v1/trainer/versions {version, step, status, evidence}``,
  ``/v1/trainer/events {kind, detail, step, version}``, ``/v1/trainer/rollbacks {to_version, from_version,
  detail}`` and ``GET /v1/trainer/recent_prompts?n=&corrected=`` give a remote trainer the store's version numbering,
  version history, gate events and the gate's recent prompts, as the embedded trainer has them.
* ``/v1/trainer/release {lease_id}`` gives the batch back; ``/v1/trainer/drop {lease_id, turn_id, reason}``
  records a leased sample the trainer refuses (too long, stale, ...), never silently.
* ``/v1/trainer/weights {path, version, kind}`` publishes weights written to shared disk: ``kind = "full"``, a
  folder of ``*.safetensors`` with the full state dict of the served architecture, or ``kind = "lora"``, a PEFT
  adapter folder (hot-loaded by an engine whose publisher takes adapters; merged into the base model for the
  embedded engine). The engine's new version is returned.
* ``GET /v1/trainer/state`` → last committed step, policy version, samples waiting.

Exactly-once comes from the store: a lease is a compare-and-set on the samples' state, an expired lease returns
its samples to ready at the next lease call, and a commit under a lost lease fails as a whole.

Auth: every route calls ``clawloop.api.auth.require_admin`` (the one admin rule: the admin key; without one,
refused while user keys are set, and only loopback same-origin calls when no key is set), since these routes
hand out the run's data and change the served weights. Every number is validated into range (400 otherwise),
and weights that cannot be loaded as the served model's are a 400 that names no file-system detail.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from pathlib import Path
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from fastapi import FastAPI
from safetensors.torch import load_file as st_load_file
from starlette.requests import Request

from clawloop.api.auth import require_admin
from clawloop.api.bodies import ADMIN_BODY_BYTES, read_json_object
from clawloop.api.errors import APIError
from clawloop.store import LeaseLost, Store
from clawloop.wire import decode_tensors, sample_to_json

log = logging.getLogger("clawloop.api")

T = TypeVar("T")

MAX_LEASE_S = 24 * 3600.0
MAX_RECENT_PROMPTS = 1000
MAX_INT = 2**31 - 1
"""Largest count, step, turn id or policy version a route accepts."""
LEASE_ID_RE = re.compile(r"[0-9a-f]{8,64}")
"""A lease id a trainer may choose for its lease."""


def _number(body: dict[str, Any], key: str, default: float | None = None, *, minimum: float = 0.0,
            maximum: float = float(MAX_INT)) -> float:
    value = body.get(key, default)
    ok = value is not None and not isinstance(value, bool) and isinstance(value, (int, float))
    if ok:
        try:
            ok = math.isfinite(float(value)) and minimum <= value <= maximum
        except OverflowError:  # an integer beyond any float
            ok = False
    if not ok:
        raise APIError(400, f"'{key}' must be a number in [{minimum:g}, {maximum:g}].", "invalid_request_error", key,
                       "invalid_value")
    return float(value)


def _object(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key) or {}
    if not isinstance(value, dict):
        raise APIError(400, f"'{key}' must be an object.", "invalid_request_error", key, "invalid_value")
    return value


async def _store_call(fn: Callable[..., T], *args: Any) -> T:
    """Run a store call off the event loop. ``LeaseLost`` is the caller's to answer (409); any other failure of
    the store (disk full, database locked, a number recorded twice) is a 503 the remote trainer tries again:
    its update is in its weights, so it must not give the batch back for it."""
    try:
        return await asyncio.to_thread(fn, *args)
    except (LeaseLost, APIError):
        raise
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.error("trainer route: the store failed (%s: %s); answered 503", type(exc).__name__, exc)
        raise APIError(503, f"The store could not record this ({type(exc).__name__}); try again.", "server_error",
                       None, "store_unavailable", headers={"Retry-After": "1"}) from None


def _integer(body: dict[str, Any], key: str, default: int | None = None, *, minimum: int = 0) -> int:
    value = body.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= MAX_INT:
        raise APIError(400, f"'{key}' must be an integer in [{minimum}, {MAX_INT}].", "invalid_request_error", key,
                       "invalid_value")
    return value


def _string(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise APIError(400, f"'{key}' must be a non-empty string.", "invalid_request_error", key, None)
    return value


def load_weights_folder(path: Path, kind: str, base_model: str | Path | None) -> Any:
    """What the engine's ``publish_sync`` gets for a reported folder (see the module docstring)."""
    if kind == "full":
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(st_load_file(str(f)))
        return state
    # LoRA adapter merged into the base weights (for engines that take full state dicts).
    from clawloop.engines.model_files import resolve_model
    from clawloop.trainer.publish import merge_adapter_folder

    return merge_adapter_folder(path, resolve_model(base_model))


def mount_trainer_routes(app: FastAPI, store: Store, engine: Any, config: Any) -> None:
    """Add the ``/v1/trainer/*`` routes for ``store`` and ``engine`` to ``app``."""
    publish_lock = asyncio.Lock()

    def authorise(request: Request) -> None:
        require_admin(request, config)

    async def lease(request: Request) -> Any:
        authorise(request)
        body = await read_json_object(request, ADMIN_BODY_BYTES)
        n = _integer(body, "n", minimum=1)
        min_n = body.get("min_n")
        min_n = None if min_n is None else _integer(body, "min_n", minimum=0)
        lease_s = min(_number(body, "lease_s", 600.0, minimum=0.001), MAX_LEASE_S)
        asked_id = body.get("lease_id")  # the trainer's own id: a retried lease gets what the first attempt did
        if asked_id is not None and not (isinstance(asked_id, str) and LEASE_ID_RE.fullmatch(asked_id)):
            raise APIError(400, "'lease_id' must be 8 to 64 hex digits.", "invalid_request_error", "lease_id",
                           "invalid_value")

        def work() -> dict[str, Any]:
            lease_id, samples = store.lease_samples(n, lease_s=lease_s, min_n=min_n, lease_id=asked_id)
            return {"lease_id": lease_id, "lease_s": lease_s,
                    "samples": [sample_to_json(s, store.get_turn(s.turn_id)) for s in samples],
                    "waiting": store.ready_count()}

        return await _store_call(work)

    async def heartbeat(request: Request) -> Any:
        authorise(request)
        body = await read_json_object(request, ADMIN_BODY_BYTES)
        lease_id = _string(body, "lease_id")
        lease_s = min(_number(body, "lease_s", 600.0, minimum=0.001), MAX_LEASE_S)
        held = await _store_call(store.extend_lease, lease_id, lease_s)
        if held == 0:
            raise APIError(409, f"Lease {lease_id} holds no samples (expired, committed or released).",
                           "invalid_request_error", "lease_id", "lease_lost")
        return {"lease_id": lease_id, "held": held, "lease_s": lease_s}

    async def commit(request: Request) -> Any:
        authorise(request)
        body = await read_json_object(request, ADMIN_BODY_BYTES)
        lease_id = _string(body, "lease_id")
        step = _integer(body, "step", minimum=1)
        version = _integer(body, "policy_version", minimum=0)
        metrics = body.get("metrics") or {}
        turn_ids = body.get("turn_ids")
        if not isinstance(metrics, dict) or not isinstance(turn_ids, list) or not turn_ids \
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT for t in turn_ids):
            raise APIError(400, "'metrics' must be an object and 'turn_ids' a non-empty list of integers.",
                           "invalid_request_error", None, None)
        scores = body.get("scores") or {}
        if not isinstance(scores, dict) or not all(isinstance(v, str) for v in scores.values()):
            raise APIError(400, "'scores' must be an object of base64 safetensors by turn id.",
                           "invalid_request_error", "scores", None)
        try:
            decoded = {int(tid): decode_tensors(text) for tid, text in scores.items()}
        except Exception:  # noqa: BLE001 - any undecodable entry is the client's error
            raise APIError(400, "'scores' holds an entry that is not a turn id with base64 safetensors.",
                           "invalid_request_error", "scores", None) from None
        try:
            await _store_call(store.commit_step, lease_id, step, version, metrics, turn_ids, decoded)
        except LeaseLost as exc:  # a sample is no longer held by this lease
            raise APIError(409, str(exc), "invalid_request_error", "lease_id", "lease_lost") from None
        return {"lease_id": lease_id, "step": step, "committed": len(turn_ids)}

    async def release(request: Request) -> Any:
        authorise(request)
        body = await read_json_object(request, ADMIN_BODY_BYTES)
        lease_id = _string(body, "lease_id")
        return {"lease_id": lease_id, "released": await _store_call(store.release_lease, lease_id)}

    async def drop(request: Request) -> Any:
        authorise(request)
        body = await read_json_object(request, ADMIN_BODY_BYTES)
        turn_id = _integer(body, "turn_id", minimum=0)
        reason = _string(body, "reason")[:200]
        lease_id = None if body.get("lease_id") is None else _string(body, "lease_id")
        if not await _store_call(store.drop_leased_sample, turn_id, reason, lease_id):
            raise APIError(409, f"Sample {turn_id} is not leased{' by this lease' if lease_id else ''}; nothing "
                           "was dropped.", "invalid_request_error", "turn_id", "sample_not_leased")
        return {"turn_id": turn_id, "dropped": True}

    async def weights(request: Request) -> Any:
        authorise(request)
        body = await read_json_object(request, ADMIN_BODY_BYTES)
        path = Path(_string(body, "path"))
        version = body.get("version")
        version = None if version is None else _integer(body, "version", minimum=0)
        kind = body.get("kind", "full")
        if kind not in ("full", "lora"):
            raise APIError(400, "'kind' must be 'full' or 'lora'.", "invalid_request_error", "kind", None)
        if not path.exists():
            raise APIError(400, "'path' must name an existing weights folder or file.",
                           "invalid_request_error", "path", "invalid_weights")
        if kind == "lora" and not (path / "adapter_config.json").is_file():
            # Checked here so that PEFT never treats the path as a model id to download.
            raise APIError(400, "'path' is not a LoRA adapter folder (no adapter_config.json).",
                           "invalid_request_error", "path", "invalid_weights")

        def work() -> int:
            from clawloop.trainer.publish import takes_adapters

            payload: Any = str(path) if kind == "lora" and takes_adapters(engine) else \
                load_weights_folder(path, kind, config.model)
            if version is None:
                return int(engine.publish_sync(payload))
            return int(engine.publish_sync(payload, version=version))

        async with publish_lock:
            try:
                new_version = await asyncio.to_thread(work)
            except Exception as exc:  # noqa: BLE001 - the weights are bad; the served ones stay
                log.warning("publishing weights from %s failed: %s: %s", path, type(exc).__name__, exc)
                raise APIError(400, f"The weights could not be published as kind {kind!r} (not the served "
                               "model's weights); the served weights are unchanged. See the server log.",
                               "invalid_request_error", "path", "invalid_weights") from None
        return {"policy_version": new_version}

    async def next_version(request: Request) -> Any:
        authorise(request)
        body = await read_json_object(request, ADMIN_BODY_BYTES)
        at_least = _integer(body, "at_least", 0, minimum=0)
        return {"version": await _store_call(store.next_version, at_least)}

    async def record_version(request: Request) -> Any:
        authorise(request)
        body = await read_json_object(request, ADMIN_BODY_BYTES)
        version = _integer(body, "version", minimum=0)
        step = _integer(body, "step", minimum=0)
        status = _string(body, "status")[:40]
        evidence = _object(body, "evidence")
        await _store_call(store.record_version, version, step, status, evidence)
        return {"version": version, "recorded": True}

    async def record_event(request: Request) -> Any:
        authorise(request)
        body = await read_json_object(request, ADMIN_BODY_BYTES)
        kind = _string(body, "kind")[:80]
        detail = _object(body, "detail")
        step = None if body.get("step") is None else _integer(body, "step", minimum=0)
        version = None if body.get("version") is None else _integer(body, "version", minimum=0)
        await _store_call(store.record_event, kind, detail, step, version)
        return {"kind": kind, "recorded": True}

    async def record_rollback(request: Request) -> Any:
        authorise(request)
        body = await read_json_object(request, ADMIN_BODY_BYTES)
        to_version = _integer(body, "to_version", minimum=0)
        from_version = _integer(body, "from_version", minimum=0)
        detail = _object(body, "detail")
        return {"rolled_back": await _store_call(store.record_rollback, to_version, from_version, detail)}

    async def recent_prompts(request: Request) -> Any:
        authorise(request)
        try:
            n = int(request.query_params.get("n", "0"))
        except ValueError:
            n = -1
        if not 0 <= n <= MAX_RECENT_PROMPTS:
            raise APIError(400, f"'n' must be an integer in [0, {MAX_RECENT_PROMPTS}].", "invalid_request_error",
                           "n", "invalid_value")
        corrected = request.query_params.get("corrected", "0") in ("1", "true")
        found = await _store_call(lambda: store.recent_prompts(n, corrected=corrected))
        prompts = [{"turn_id": t, "prompt_ids": ids, "messages": messages} for t, ids, messages in found]
        return {"corrected": corrected, "prompts": prompts}

    async def state(request: Request) -> Any:
        authorise(request)

        def work() -> dict[str, Any]:
            last = store.last_step()
            return {"step": last[0] if last else 0, "policy_version": int(engine.policy_version),
                    "waiting": store.ready_count()}

        return await _store_call(work)

    app.add_api_route("/v1/trainer/lease", lease, methods=["POST"])
    app.add_api_route("/v1/trainer/heartbeat", heartbeat, methods=["POST"])
    app.add_api_route("/v1/trainer/commit", commit, methods=["POST"])
    app.add_api_route("/v1/trainer/release", release, methods=["POST"])
    app.add_api_route("/v1/trainer/drop", drop, methods=["POST"])
    app.add_api_route("/v1/trainer/weights", weights, methods=["POST"])
    app.add_api_route("/v1/trainer/state", state, methods=["GET"])
    app.add_api_route("/v1/trainer/next_version", next_version, methods=["POST"])
    app.add_api_route("/v1/trainer/versions", record_version, methods=["POST"])
    app.add_api_route("/v1/trainer/events", record_event, methods=["POST"])
    app.add_api_route("/v1/trainer/rollbacks", record_rollback, methods=["POST"])
    app.add_api_route("/v1/trainer/recent_prompts", recent_prompts, methods=["GET"])
