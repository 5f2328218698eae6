"""``RemoteStore``: the part of ``clawloop.store.Store`` a trainer uses, over the API process's trainer routes
(``clawloop.api.trainer_routes``), so the same trainer code runs in its own process.

The leased turns arrive with their samples and are kept until the lease is committed or released, so
``get_turn`` (used when a batch is prepared) needs no extra round trip. Every call has a timeout; transport
errors and 503 answers (the API's store failed for a reason worth another try: disk full, database locked) are
retried with backoff; other HTTP answers are not. A 409 means the lease was lost and is raised as
``clawloop.store.LeaseLost``, as ``Store.commit_step`` raises it when its samples are no longer held. A 503 still
failing after the retries is raised as ``StoreUnavailable``, which the trainer loop tries again later (its
update is in the weights; the batch is never given back for it).

Versions, gate events and rollbacks are recorded in the API's store as the embedded trainer records them in its
own (``trainer.contracts.SampleSource``), and the gate's recent prompts come from it too.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import torch

from clawloop.retry import Backoff, retry_sync
from clawloop.store import LeaseLost, SampleRecord, TurnRecord
from clawloop.wire import encode_tensors, sample_from_json

__all__ = ["LeaseLost", "RemoteStore", "StoreUnavailable"]


class StoreUnavailable(RuntimeError):
    """The API answered 503: its store failed for a reason worth another try."""


class RemoteStore:
    def __init__(self, api_url: str, admin_key: str = "", *, timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 0.5, transport: httpx.BaseTransport | None = None):
        """``transport``: httpx's, for a network path of one's own (a proxy, a test that loses answers)."""
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self._client = httpx.Client(base_url=api_url.rstrip("/"), headers=headers, timeout=timeout_s,
                                    transport=transport)
        self.retries = retries
        self.backoff_s = backoff_s
        self._turns: dict[int, TurnRecord] = {}
        self._lease_turns: dict[str, list[int]] = {}
        self._waiting = 0

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        def attempt(_: int) -> httpx.Response:
            response = self._client.request(method, path, json=body)
            if response.status_code == 503:
                raise StoreUnavailable(response.text)
            return response

        response = retry_sync(attempt, Backoff(self.retries, self.backoff_s),
                              retryable=lambda exc: isinstance(exc, (httpx.TransportError, StoreUnavailable)))
        if response.status_code == 409:
            raise LeaseLost(response.text)
        response.raise_for_status()
        return response.json()

    # ---- the Store subset ---------------------------------------------------------------------------
    def lease_samples(self, n: int, lease_s: float = 3600.0,
                      min_n: int | None = None) -> tuple[str, list[SampleRecord]]:
        # Our own lease id: a retry after a lost answer (a read timeout) gets the same samples, not a second lease.
        out = self._call("POST", "/v1/trainer/lease", {"n": n, "min_n": min_n, "lease_s": lease_s,
                                                      "lease_id": uuid.uuid4().hex})
        lease_id = out["lease_id"]
        samples = []
        for d in out["samples"]:
            sample, turn = sample_from_json(d, lease_id)
            self._turns[sample.turn_id] = turn
            samples.append(sample)
        self._lease_turns[lease_id] = [s.turn_id for s in samples]
        self._waiting = int(out.get("waiting", 0))
        return lease_id, samples

    def get_turn(self, turn_id: int) -> TurnRecord:
        try:
            return self._turns[turn_id]
        except KeyError:
            raise KeyError(f"turn {turn_id} is not part of a lease held here") from None

    def heartbeat(self, lease_id: str, lease_s: float = 3600.0) -> int:
        return int(self._call("POST", "/v1/trainer/heartbeat", {"lease_id": lease_id, "lease_s": lease_s})["held"])

    extend_lease = heartbeat

    def commit_step(self, lease_id: str, step: int, policy_version: int, metrics: dict[str, Any],
                    turn_ids: list[int], scores: dict[int, dict[str, torch.Tensor]] | None = None) -> None:
        self._call("POST", "/v1/trainer/commit", {"lease_id": lease_id, "step": step,
                                                  "policy_version": policy_version, "metrics": metrics,
                                                  "turn_ids": list(turn_ids),
                                                  "scores": {str(tid): encode_tensors(tensors)
                                                             for tid, tensors in (scores or {}).items()}})
        self._forget(lease_id)

    def release_lease(self, lease_id: str) -> int:
        released = int(self._call("POST", "/v1/trainer/release", {"lease_id": lease_id})["released"])
        self._forget(lease_id)
        return released

    def drop_leased_sample(self, turn_id: int, reason: str, lease_id: str | None = None) -> bool:
        body: dict[str, Any] = {"turn_id": turn_id, "reason": reason}
        if lease_id is not None:
            body["lease_id"] = lease_id
        try:
            self._call("POST", "/v1/trainer/drop", body)
        except LeaseLost:  # the sample is no longer leased: nothing was dropped
            return False
        return True

    def ready_count(self) -> int:
        """Samples waiting as of the last lease (no extra round trip per step)."""
        return self._waiting

    def state(self) -> dict[str, Any]:
        return self._call("GET", "/v1/trainer/state")

    def last_step(self) -> tuple[int, dict[str, Any]] | None:
        step = int(self.state()["step"])
        return (step, {}) if step > 0 else None

    def report_weights(self, path: str, version: int | None = None, kind: str = "full") -> int:
        body: dict[str, Any] = {"path": str(path), "kind": kind}
        if version is not None:
            body["version"] = int(version)
        return int(self._call("POST", "/v1/trainer/weights", body)["policy_version"])

    def next_version(self, at_least: int = 0) -> int:
        return int(self._call("POST", "/v1/trainer/next_version", {"at_least": int(at_least)})["version"])

    def record_version(self, version: int, step: int, status: str, evidence: dict[str, Any]) -> None:
        self._call("POST", "/v1/trainer/versions", {"version": int(version), "step": int(step), "status": status,
                                                    "evidence": evidence})

    def record_event(self, kind: str, detail: dict[str, Any], step: int | None = None,
                     version: int | None = None) -> None:
        self._call("POST", "/v1/trainer/events", {"kind": kind, "detail": detail, "step": step, "version": version})

    def record_rollback(self, to_version: int, from_version: int, detail: dict[str, Any]) -> list[int]:
        out = self._call("POST", "/v1/trainer/rollbacks", {"to_version": int(to_version),
                                                           "from_version": int(from_version), "detail": detail})
        return [int(v) for v in out["rolled_back"]]

    def recent_prompts(self, n: int, *, corrected: bool = False) -> list[tuple[int, list[int], list[dict[str, Any]]]]:
        """The store's ``recent_prompts`` over HTTP (the same rule: spread across owners and sessions)."""
        out = self._call("GET", f"/v1/trainer/recent_prompts?n={int(n)}&corrected={int(bool(corrected))}")
        return [(int(p["turn_id"]), [int(i) for i in p["prompt_ids"]], p["messages"]) for p in out["prompts"]]

    def _forget(self, lease_id: str) -> None:
        for tid in self._lease_turns.pop(lease_id, []):
            self._turns.pop(tid, None)

    def close(self) -> None:
        self._client.close()
