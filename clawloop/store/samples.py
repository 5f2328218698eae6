"""Samples and their leases: a judged turn's training sample, from ``ready`` to ``consumed`` or ``dropped``.

A sample's state::

    ready ──(lease_samples)──▶ leased ──(commit_step)──▶ consumed
      ▲                          │  │
      └──(lease expiry, release, └──(drop_leased_sample)──▶ dropped(reason)
          recovery, requeue)

A sample is written in the same transaction that moves its turn from ``judging`` on (``put_sample``); the trainer
leases samples and acknowledges them with the optimizer step that used them (``commit_step``, which raises
``LeaseLost`` when the lease no longer holds them). ``requeue_after_step(n)`` returns samples consumed by steps
after the checkpoint a run resumes from, so no sample is trained twice or skipped.

A turn with a sample is in its sample's state; ``move`` is the one place that writes a sample's state, and it
moves the turn with it in the same statement group, so the two never disagree.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from clawloop.store.contexts import ContextSample, insert_context
from clawloop.store.database import Database, owned_samples
from clawloop.store.history import insert_event, insert_step, mark_steps_requeued
from clawloop.store.records import LeaseLost, SampleRecord, TurnState


def move(db: sqlite3.Connection, turn_ids: Iterable[int], state: TurnState, *, touched_at: float | None = None,
         reason: str | None = None, **sample_fields: Any) -> None:
    """Move samples to ``state`` (setting ``sample_fields`` too) and their turns with them, in the caller's
    transaction. ``touched_at``: the turns' new ``updated_at`` (unchanged when None); ``reason``: why, for a
    dropped one."""
    sample_sets = ", ".join(["state=?"] + [f"{name}=?" for name in sample_fields])
    turn_sets = ["state=?"] + (["updated_at=?"] if touched_at is not None else []) + (
        ["reason=?"] if reason is not None else [])
    turn_args = [str(state)] + ([touched_at] if touched_at is not None else []) + (
        [reason] if reason is not None else [])
    for tid in turn_ids:
        db.execute(f"UPDATE samples SET {sample_sets} WHERE turn_id=?", (str(state), *sample_fields.values(), tid))
        db.execute(f"UPDATE turns SET {', '.join(turn_sets)} WHERE id=?", (*turn_args, tid))


def back_to_ready(db: sqlite3.Connection, turn_ids: Iterable[int]) -> None:
    """Leased samples go back to ready (their lease cleared), in the caller's transaction."""
    move(db, turn_ids, TurnState.READY, lease_id="", lease_expires=0)


def leased_back_to_ready(db: sqlite3.Connection) -> int:
    """Crash repair, in the caller's transaction: every leased sample (its trainer died with the old process)
    goes back to ready. Returns how many."""
    leased = [r["turn_id"] for r in db.execute("SELECT turn_id FROM samples WHERE state=?",
                                               (TurnState.LEASED,)).fetchall()]
    back_to_ready(db, leased)
    return len(leased)


def sample_from_row(row: sqlite3.Row) -> SampleRecord:
    return SampleRecord(
        turn_id=row["turn_id"], reward=row["reward"], kind=row["kind"], hints=json.loads(row["hints"]),
        targets=None if row["targets"] is None else st_load(row["targets"]),
        teacher_version=row["teacher_version"], info=json.loads(row["info"]), state=row["state"],
        lease_id=row["lease_id"], consumed_step=row["consumed_step"], created_at=row["created_at"])


def _expire_leases(db: sqlite3.Connection, now: float) -> int:
    expired = [r["turn_id"] for r in db.execute(
        "SELECT turn_id FROM samples WHERE state=? AND lease_expires < ?", (TurnState.LEASED, now)).fetchall()]
    back_to_ready(db, expired)
    return len(expired)


def _held(db: sqlite3.Connection, turn_id: int, lease_id: str | None) -> bool:
    """Whether sample ``turn_id`` is leased (under ``lease_id`` when given)."""
    if lease_id is None:
        row = db.execute("SELECT 1 FROM samples WHERE turn_id=? AND state=?", (turn_id, TurnState.LEASED))
    else:
        row = db.execute("SELECT 1 FROM samples WHERE turn_id=? AND state=? AND lease_id=?",
                         (turn_id, TurnState.LEASED, lease_id))
    return row.fetchone() is not None


def _committed_before(db: sqlite3.Connection, step: int, turn_ids: list[int], owner: str) -> bool:
    """Whether step ``step`` is recorded already (for ``owner``) with exactly these samples, each still consumed
    by it: the same commit, made before. Not so once a resume requeued them."""
    row = db.execute("SELECT turn_ids FROM steps WHERE step=? AND owner=?", (step, owner)).fetchone()
    if row is None or set(json.loads(row["turn_ids"])) != set(turn_ids):
        return False
    placeholders = ",".join("?" * len(turn_ids))
    consumed = db.execute(f"SELECT COUNT(*) AS n FROM samples WHERE turn_id IN ({placeholders}) AND state=? "
                          "AND consumed_step=?", (*turn_ids, TurnState.CONSUMED, step)).fetchone()["n"]
    return consumed == len(turn_ids)


class Samples:
    """The sample and lease half of ``Store`` (see the module docstring). Each check of a lease and the write
    that depends on it run in one ``BEGIN IMMEDIATE`` transaction, so no other writer comes between them."""

    db: Database

    def put_sample(self, sample: SampleRecord, context: Sequence[ContextSample] = ()) -> bool:
        """Write a sample and move its turn judging -> ready in one transaction. False if already written or the
        turn is not being judged (so a sample can never be produced twice).

        ``context``: the turn's context answers (``clawloop.store.contexts``), written in the same transaction as
        turns and samples of their own (each gets its turn id); an index stored already is skipped."""
        blob = None if sample.targets is None else st_save({k: v.contiguous() for k, v in sample.targets.items()})
        with self.db.tx() as db:
            judging = db.execute("SELECT 1 FROM turns WHERE id=? AND state=?",
                                 (sample.turn_id, TurnState.JUDGING)).fetchone()
            if judging is None:
                return False
            db.execute(
                "INSERT INTO samples (turn_id, state, reward, kind, hints, targets, teacher_version, info,"
                " created_at) VALUES (?,?,?,?,?,?,?,?,?)",
                (sample.turn_id, TurnState.READY, sample.reward, sample.kind,
                 json.dumps(sample.hints, ensure_ascii=False), blob, sample.teacher_version,
                 json.dumps(sample.info, ensure_ascii=False), sample.created_at))
            now = time.time()
            move(db, [sample.turn_id], TurnState.READY, touched_at=now)
            for item in context:
                insert_context(db, sample.turn_id, item, now)
        return True

    def get_sample(self, turn_id: int) -> SampleRecord | None:
        with self.db.read() as db:
            row = db.execute("SELECT * FROM samples WHERE turn_id=?", (int(turn_id),)).fetchone()
        return None if row is None else sample_from_row(row)

    def lease_samples(self, n: int, lease_s: float = 3600.0, min_n: int | None = None, *,
                      owner: str | None = None, lease_id: str | None = None) -> tuple[str, list[SampleRecord]]:
        """Lease up to ``n`` ready samples (oldest first) under a new lease id. With ``min_n``, lease nothing
        unless at least that many are ready; with ``owner``, only that owner's samples (per-user policies).
        Expired leases are returned to ready first. ``lease_id``: the caller's own id for the lease, so that a
        request retried after its answer was lost gets the samples its first attempt leased, not a second lease
        (the first one's samples would otherwise wait for it to expire)."""
        lease_id = lease_id or uuid.uuid4().hex
        now = time.time()
        where, args = owned_samples(owner)
        with self.db.tx() as db:
            held = db.execute("SELECT * FROM samples WHERE lease_id=? AND state=? ORDER BY created_at, turn_id",
                              (lease_id, TurnState.LEASED)).fetchall()
            if held:
                return lease_id, [sample_from_row(r) for r in held]
            _expire_leases(db, now)
            rows = db.execute(f"SELECT turn_id FROM samples WHERE state=?{where} ORDER BY created_at, turn_id LIMIT ?",
                              (TurnState.READY, *args, n)).fetchall()
            if min_n is not None and len(rows) < min_n:
                return lease_id, []
            ids = [r["turn_id"] for r in rows]
            move(db, ids, TurnState.LEASED, touched_at=now, lease_id=lease_id, lease_expires=now + lease_s)
            rows = [db.execute("SELECT * FROM samples WHERE turn_id=?", (tid,)).fetchone() for tid in ids]
        return lease_id, [sample_from_row(r) for r in rows]

    def extend_lease(self, lease_id: str, lease_s: float) -> int:
        """Heartbeat of a remote trainer: push the lease's expiry to now + ``lease_s``. Returns how many samples
        the lease still holds (0 = the lease was lost: expired and taken back, or already committed)."""
        with self.db.tx() as db:
            return db.execute("UPDATE samples SET lease_expires=? WHERE lease_id=? AND state=?",
                              (time.time() + lease_s, lease_id, TurnState.LEASED)).rowcount

    def release_lease(self, lease_id: str) -> int:
        """Give a lease's samples back (e.g. the step failed)."""
        with self.db.tx() as db:
            ids = [r["turn_id"] for r in db.execute("SELECT turn_id FROM samples WHERE lease_id=? AND state=?",
                                                    (lease_id, TurnState.LEASED)).fetchall()]
            back_to_ready(db, ids)
        return len(ids)

    def drop_leased_sample(self, turn_id: int, reason: str, lease_id: str | None = None) -> bool:
        """A leased sample the trainer will not use (too stale, too long): record why, never retry it. Only a
        sample that is leased (under ``lease_id`` when given) moves; returns whether it did, and the turn moves
        with it or not at all."""
        with self.db.tx() as db:
            if not _held(db, turn_id, lease_id):
                return False
            move(db, [turn_id], TurnState.DROPPED, touched_at=time.time(), reason=reason, lease_id="")
            return True

    def commit_step(self, lease_id: str, step: int, policy_version: int, metrics: dict[str, Any],
                    turn_ids: list[int], scores: dict[int, dict[str, torch.Tensor]] | None = None, *,
                    owner: str = "") -> None:
        """Record an optimizer step and mark the samples it used consumed, atomically. Raises ``LeaseLost``
        (and changes nothing) if the lease was lost (expired and re-leased), so the caller knows the step's samples
        are not exclusively its own; a failure of the write itself raises the ``sqlite3`` error unchanged.

        ``scores``: the teacher scores the step trained on, by turn id (``clawloop.wire.TeacherScores`` in tensor
        form), kept as the sample's ``targets``: the dashboard's per-token view reads them, and a requeued sample
        trained again at the very same ids reuses them instead of asking the teacher again. ``owner``: the user whose
        policy the step trained (per-user policies; "" for the shared one)."""
        now = time.time()
        turn_ids = list(dict.fromkeys(turn_ids))  # a sample named twice is still one sample
        with self.db.tx() as db:
            if _committed_before(db, step, turn_ids, owner):
                return  # a retry of this very commit whose answer was lost (over HTTP): it stands as it is
            for tid in turn_ids:
                if not _held(db, tid, lease_id):
                    raise LeaseLost(f"sample {tid} is no longer held by lease {lease_id}")
                move(db, [tid], TurnState.CONSUMED, touched_at=now, consumed_step=step, lease_id="")
            for tid, tensors in (scores or {}).items():
                if tid in turn_ids:
                    db.execute("UPDATE samples SET targets=? WHERE turn_id=?",
                               (st_save({k: v.contiguous() for k, v in tensors.items()}), int(tid)))
            insert_step(db, step, now, policy_version, metrics, turn_ids, owner)
            # Anything else still under this lease (dropped samples were already moved) goes back to ready.
            rest = [r["turn_id"] for r in db.execute(
                "SELECT turn_id FROM samples WHERE lease_id=? AND state=?", (lease_id, TurnState.LEASED))]
            back_to_ready(db, rest)

    def requeue_after_step(self, step: int, *, owner: str | None = None) -> int:
        """Resume support: samples consumed by steps after ``step`` (whose weights were lost) become ready
        again. Those steps keep their rows in ``steps`` (step numbers are never reused: the resumed trainer goes
        on after the last recorded step) and are marked requeued by a copy in ``requeued_steps`` with the time
        of the requeue; a ``requeue`` event records it. Nothing is deleted. With ``owner`` (per-user policies),
        only that owner's samples and steps: the others' policies lost nothing."""
        now = time.time()
        where, args = owned_samples(owner)
        with self.db.tx() as db:
            ids = [r["turn_id"] for r in db.execute(
                f"SELECT turn_id FROM samples WHERE state=? AND consumed_step > ?{where}",
                (TurnState.CONSUMED, step, *args))]
            move(db, ids, TurnState.READY, consumed_step=None)
            lost = mark_steps_requeued(db, step, now, owner)
            if ids or lost:
                insert_event(db, "requeue", {"steps": lost, "turn_ids": ids,
                                             **({"owner": owner} if owner is not None else {})}, step=step)
        return len(ids)
