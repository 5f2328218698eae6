"""The trainer's side door into the API process: remote trainers lease batches, acknowledge them and report
new weights over authenticated HTTP, so the trainer can run as its own process (or ``torchrun`` job).

Routes (all ``POST`` with a JSON body, except ``GET /v1/trainer/state``):

* ``/v1/trainer/lease {n, min_n, lease_s}`` → ``{lease_id, samples: [...], waiting}``; each sample carries its
  turn (prompt/response ids exactly as generated, behaviour log-probs, temperature, policy version, messages)
  and its judge/teacher outcome (reward, kind, hints, targets as base64 safetensors).
* ``/v1/trainer/heartbeat {lease_id, lease_s}`` extends the lease; 409 when it was lost.
* ``/v1/trainer/commit {lease_id, step, policy_version, metrics, turn_ids}`` → ``store.commit_step``; 409 when
  the lease was lost (its samples expired and went to another trainer), so a step is acknowledged at most once.
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
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI
from safetensors.torch import load_file as st_load_file
from starlette.requests import Request

from clawloop.api import safejson
from clawloop.api.auth import require_admin
from clawloop.api.errors import APIError
from clawloop.store import Store
from clawloop.wire import sample_to_json

log = logging.getLogger("clawloop.api")

MAX_LEASE_S = 24 * 3600.0
MAX_INT = 2**31 - 1
"""Largest count, step, turn id or policy version a route accepts."""


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


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = safejson.loads(await request.body())
    except ValueError:
        raise APIError(400, "The body must be a JSON object.", "invalid_request_error", None, None) from None
    if not isinstance(body, dict):
        raise APIError(400, "The body must be a JSON object.", "invalid_request_error", None, None)
    return body


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
        body = await _body(request)
        n = _integer(body, "n", minimum=1)
        min_n = body.get("min_n")
        min_n = None if min_n is None else _integer(body, "min_n", minimum=0)
        lease_s = min(_number(body, "lease_s", 600.0, minimum=0.001), MAX_LEASE_S)

        def work() -> dict[str, Any]:
            lease_id, samples = store.lease_samples(n, lease_s=lease_s, min_n=min_n)
            return {"lease_id": lease_id, "lease_s": lease_s,
                    "samples": [sample_to_json(s, store.get_turn(s.turn_id)) for s in samples],
                    "waiting": store.ready_count()}

        return await asyncio.to_thread(work)

    async def heartbeat(request: Request) -> Any:
        authorise(request)
        body = await _body(request)
        lease_id = _string(body, "lease_id")
        lease_s = min(_number(body, "lease_s", 600.0, minimum=0.001), MAX_LEASE_S)
        held = await asyncio.to_thread(store.extend_lease, lease_id, lease_s)
        if held == 0:
            raise APIError(409, f"Lease {lease_id} holds no samples (expired, committed or released).",
                           "invalid_request_error", "lease_id", "lease_lost")
        return {"lease_id": lease_id, "held": held, "lease_s": lease_s}

    async def commit(request: Request) -> Any:
        authorise(request)
        body = await _body(request)
        lease_id = _string(body, "lease_id")
        step = _integer(body, "step", minimum=1)
        version = _integer(body, "policy_version", minimum=0)
        metrics = body.get("metrics") or {}
        turn_ids = body.get("turn_ids")
        if not isinstance(metrics, dict) or not isinstance(turn_ids, list) or not turn_ids \
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_INT for t in turn_ids):
            raise APIError(400, "'metrics' must be an object and 'turn_ids' a non-empty list of integers.",
                           "invalid_request_error", None, None)
        try:
            await asyncio.to_thread(store.commit_step, lease_id, step, version, metrics, turn_ids)
        except RuntimeError as exc:  # a sample is no longer held by this lease
            raise APIError(409, str(exc), "invalid_request_error", "lease_id", "lease_lost") from None
        except Exception as exc:  # e.g. the step number already exists
            raise APIError(409, f"commit refused: {exc}", "invalid_request_error", "step", "commit_conflict") \
                from None
        return {"lease_id": lease_id, "step": step, "committed": len(turn_ids)}

    async def release(request: Request) -> Any:
        authorise(request)
        body = await _body(request)
        lease_id = _string(body, "lease_id")
        return {"lease_id": lease_id, "released": await asyncio.to_thread(store.release_lease, lease_id)}

    async def drop(request: Request) -> Any:
        authorise(request)
        body = await _body(request)
        turn_id = _integer(body, "turn_id", minimum=0)
        reason = _string(body, "reason")[:200]
        lease_id = None if body.get("lease_id") is None else _string(body, "lease_id")
        if not await asyncio.to_thread(store.drop_leased_sample, turn_id, reason, lease_id):
            raise APIError(409, f"Sample {turn_id} is not leased{' by this lease' if lease_id else ''}; nothing "
                           "was dropped.", "invalid_request_error", "turn_id", "sample_not_leased")
        return {"turn_id": turn_id, "dropped": True}

    async def weights(request: Request) -> Any:
        authorise(request)
        body = await _body(request)
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

    async def state(request: Request) -> Any:
        authorise(request)

        def work() -> dict[str, Any]:
            last = store.last_step()
            return {"step": last[0] if last else 0, "policy_version": int(engine.policy_version),
                    "waiting": store.ready_count()}

        return await asyncio.to_thread(work)

    app.add_api_route("/v1/trainer/lease", lease, methods=["POST"])
    app.add_api_route("/v1/trainer/heartbeat", heartbeat, methods=["POST"])
    app.add_api_route("/v1/trainer/commit", commit, methods=["POST"])
    app.add_api_route("/v1/trainer/release", release, methods=["POST"])
    app.add_api_route("/v1/trainer/drop", drop, methods=["POST"])
    app.add_api_route("/v1/trainer/weights", weights, methods=["POST"])
    app.add_api_route("/v1/trainer/state", state, methods=["GET"])
