"""The run's history: optimizer steps, steps whose weights were lost, published versions and events.

Nothing here is ever deleted. Steps whose weights were lost in a crash stay in ``steps`` and are marked by a copy
in ``requeued_steps`` on resume (step numbers are never reused); ``versions`` indexes the published versions
(their weights are in ``RUN_DIR/versions``; status ``accepted``, ``rolled_back``, ``uncommitted`` for one whose
step a crash kept from committing, ``archived`` after a fresh start) and ``events`` records gate decisions,
rollbacks, requeues and repairs with their evidence.

The module functions write in a transaction the caller holds, for the moves that change samples and history
together (a commit records its step, a requeue marks the lost steps, recovery marks uncommitted versions).
"""

from __future__ import annotations

import json
import sqlite3
import time
from typing import Any

from clawloop.store.database import Database, owned_rows


def insert_event(db: sqlite3.Connection, kind: str, detail: dict[str, Any], step: int | None = None,
                 version: int | None = None) -> None:
    db.execute("INSERT INTO events (created_at, kind, step, version, detail) VALUES (?,?,?,?,?)",
               (time.time(), kind, step, version, json.dumps(detail, default=str)))


def put_meta(db: sqlite3.Connection, key: str, value: str) -> None:
    """Set ``meta[key]`` in the caller's transaction."""
    db.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value", (key, value))


def retire_versions_from(db: sqlite3.Connection, step: int, status: str) -> list[int]:
    """Mark every version of the shared policy of step ``step`` or later (version 0, the starting weights, never)
    with ``status``, in the caller's transaction; returns them in order."""
    retired = [int(r["version"]) for r in db.execute(
        "SELECT version FROM versions WHERE step >= ? AND version > 0 AND owner='' ORDER BY version", (int(step),))]
    db.execute("UPDATE versions SET status=? WHERE step >= ? AND version > 0 AND owner=''", (status, int(step)))
    return retired


def retire_owner_versions(db: sqlite3.Connection, owner: str, status: str) -> list[int]:
    """Mark every version of ``owner``'s own policy (per-user policies) with ``status``, in the caller's
    transaction; returns them in order."""
    retired = [int(r["version"]) for r in db.execute(
        "SELECT version FROM versions WHERE owner=? ORDER BY version", (owner,))]
    db.execute("UPDATE versions SET status=? WHERE owner=?", (status, owner))
    return retired


def shared_steps(db: sqlite3.Connection, steps: list[int]) -> list[int]:
    """Those of ``steps`` that trained the shared policy (not one user's own), in order."""
    owned = {int(r["step"]) for r in db.execute("SELECT step FROM steps WHERE owner != ''")}
    return [s for s in steps if s not in owned]


def insert_step(db: sqlite3.Connection, step: int, now: float, policy_version: int, metrics: dict[str, Any],
                turn_ids: list[int], owner: str = "") -> None:
    db.execute("INSERT INTO steps (step, created_at, policy_version, metrics, turn_ids, owner) VALUES (?,?,?,?,?,?)",
               (step, now, policy_version, json.dumps(metrics), json.dumps(turn_ids), owner))


def mark_steps_requeued(db: sqlite3.Connection, after_step: int, now: float, owner: str | None = None) -> list[int]:
    """The steps after ``after_step`` (only ``owner``'s when given) not marked before get their copy in
    ``requeued_steps``. Returns them."""
    where, args = owned_rows(owner)
    not_yet_requeued = (f" FROM steps s WHERE s.step > ?{where.replace('owner', 's.owner')} AND NOT EXISTS"
                        " (SELECT 1 FROM requeued_steps r WHERE r.step = s.step AND r.created_at = s.created_at)")
    lost = [r["step"] for r in db.execute("SELECT s.step" + not_yet_requeued + " ORDER BY s.step",
                                          (after_step, *args))]
    db.execute("INSERT INTO requeued_steps (step, created_at, policy_version, metrics, turn_ids, requeued_at,"
               " resumed_from_step) SELECT s.step, s.created_at, s.policy_version, s.metrics, s.turn_ids, ?, ?"
               + not_yet_requeued, (now, after_step, after_step, *args))
    return lost


def mark_uncommitted_versions(db: sqlite3.Connection) -> list[int]:
    """Crash repair, at start-up: a version is recorded (and published) just before its step commits, so a
    process killed in between leaves an ``accepted`` version for a step that never committed; the resumed
    trainer then numbers its next step the same. Such versions become ``uncommitted``: never listed as
    accepted, never rolled back to. They are the accepted versions of a step after the last committed one,
    and, where several accepted versions claim one step (a store written before this repair), all but the
    newest (numbers only grow, so the newest is the one whose step committed). An ``uncommitted`` event
    names them. Returns them."""
    last = db.execute("SELECT MAX(step) FROM steps").fetchone()[0]
    rows = db.execute("SELECT version, step FROM versions WHERE status='accepted' ORDER BY version").fetchall()
    newest_of_step = {r["step"]: r["version"] for r in rows}
    lost = [(r["version"], r["step"]) for r in rows
            if last is None or r["step"] > last or newest_of_step[r["step"]] != r["version"]]
    if not lost:
        return []
    db.executemany("UPDATE versions SET status='uncommitted' WHERE version=?", [(v,) for v, _ in lost])
    insert_event(db, "uncommitted", {"versions": [v for v, _ in lost], "steps": [s for _, s in lost],
                                     "last_committed_step": last}, step=last)
    return [v for v, _ in lost]


def _step_row(r: sqlite3.Row) -> dict[str, Any]:
    return {"step": r["step"], "created_at": r["created_at"], "policy_version": r["policy_version"],
            "metrics": json.loads(r["metrics"]), "turn_ids": json.loads(r["turn_ids"]),
            **({"owner": r["owner"]} if "owner" in r.keys() else {})}


def _event_row(r: sqlite3.Row) -> dict[str, Any]:
    return {"id": r["id"], "created_at": r["created_at"], "kind": r["kind"], "step": r["step"],
            "version": r["version"], "detail": json.loads(r["detail"])}


class History:
    """The history half of ``Store`` (see the module docstring)."""

    db: Database

    # ---- steps -----------------------------------------------------------------------------------------
    def last_step(self, *, owner: str | None = None) -> tuple[int, dict[str, Any]] | None:
        """The newest step and its metrics (only ``owner``'s when given)."""
        where, args = owned_rows(owner)
        with self.db.read() as db:
            row = db.execute(f"SELECT * FROM steps WHERE 1{where} ORDER BY step DESC LIMIT 1", args).fetchone()
        return None if row is None else (row["step"], json.loads(row["metrics"]))

    def steps(self, *, in_weights_only: bool = False) -> list[dict[str, Any]]:
        """Every recorded step in order. ``requeued`` is True for a step whose weights were lost in a crash (its
        samples were trained again by a later step after a resume); ``in_weights_only`` leaves those out."""
        with self.db.read() as db:
            rows = db.execute(
                "SELECT s.*, EXISTS (SELECT 1 FROM requeued_steps r WHERE r.step = s.step AND r.created_at = "
                "s.created_at) AS requeued FROM steps s ORDER BY s.step").fetchall()
        return [{**_step_row(r), "requeued": bool(r["requeued"])} for r in rows
                if not (in_weights_only and r["requeued"])]

    def step_count_and_last(self) -> tuple[int, dict[str, Any] | None]:
        """How many steps are recorded and the last one (what a status line needs, without reading every row)."""
        with self.db.read() as db:
            count = int(db.execute("SELECT COUNT(*) FROM steps").fetchone()[0])
            row = db.execute("SELECT * FROM steps ORDER BY step DESC LIMIT 1").fetchone()
        return count, None if row is None else _step_row(row)

    def requeued_steps(self) -> list[dict[str, Any]]:
        """Steps whose weights were lost in a crash and whose samples were trained again after a resume (a copy
        made at the requeue; stores written before step rows were kept have them only here)."""
        with self.db.read() as db:
            rows = db.execute("SELECT * FROM requeued_steps ORDER BY id").fetchall()
        return [{**_step_row(r), "requeued_at": r["requeued_at"], "resumed_from_step": r["resumed_from_step"]}
                for r in rows]

    # ---- versions --------------------------------------------------------------------------------------
    def next_version(self, at_least: int = 0) -> int:
        """A version number never used before in this run: above every version recorded anywhere (versions,
        steps, requeued steps, served turns) and above ``at_least - 1``."""
        with self.db.read() as db:
            row = db.execute(
                "SELECT MAX(v) FROM (SELECT MAX(version) AS v FROM versions UNION ALL SELECT MAX(policy_version) "
                "FROM steps UNION ALL SELECT MAX(policy_version) FROM requeued_steps UNION ALL "
                "SELECT MAX(policy_version) FROM turns)").fetchone()
        return max(int(row[0] or 0) + 1, int(at_least))

    def record_version(self, version: int, step: int, status: str, evidence: dict[str, Any], *,
                       owner: str = "") -> None:
        """Record a version (raises if the number was recorded before for another step, status or owner: a number
        names one set of weights, across every user's policy; the same record made again, a retry whose answer was
        lost, stands as it is). ``owner``: whose policy it is (per-user policies; "" for the shared one)."""
        with self.db.tx() as db:
            known = db.execute("SELECT step, status, owner FROM versions WHERE version=?", (int(version),)).fetchone()
            if known is not None and (known["step"], known["status"], known["owner"]) == (int(step), status, owner):
                return
            db.execute("INSERT INTO versions (version, step, created_at, status, evidence, owner) VALUES (?,?,?,?,?,?)",
                       (int(version), int(step), time.time(), status, json.dumps(evidence, default=str), owner))

    def version_status(self, version: int) -> str | None:
        """The recorded status of ``version`` (None: not recorded, e.g. version 0, the starting weights)."""
        with self.db.read() as db:
            row = db.execute("SELECT status FROM versions WHERE version=?", (int(version),)).fetchone()
        return None if row is None else row["status"]

    def archive_versions(self, detail: dict[str, Any]) -> list[int]:
        """A fresh start moved the version folders away: the accepted versions become ``archived`` (no longer
        served or rolled back to; their rows and evidence stay) and a ``fresh_start`` event records ``detail``.
        Returns them."""
        with self.db.tx() as db:
            archived = [r["version"] for r in db.execute(
                "SELECT version FROM versions WHERE status='accepted' ORDER BY version")]
            db.execute("UPDATE versions SET status='archived' WHERE status='accepted'")
            insert_event(db, "fresh_start", {"archived_versions": archived, **detail})
        return archived

    def versions(self, *, owner: str | None = None) -> list[dict[str, Any]]:
        """Every recorded version in order (only ``owner``'s when given)."""
        where, args = owned_rows(owner)
        with self.db.read() as db:
            rows = db.execute(f"SELECT * FROM versions WHERE 1{where} ORDER BY version", args).fetchall()
        return [{"version": r["version"], "step": r["step"], "created_at": r["created_at"], "status": r["status"],
                 "evidence": json.loads(r["evidence"]), "owner": r["owner"]} for r in rows]

    # ---- events ----------------------------------------------------------------------------------------
    def record_event(self, kind: str, detail: dict[str, Any], step: int | None = None,
                     version: int | None = None) -> None:
        """An event of the run's weights (gate decision, rollback, requeue) with its evidence."""
        with self.db.tx() as db:
            insert_event(db, kind, detail, step, version)

    def record_rollback(self, to_version: int, from_version: int, detail: dict[str, Any], *,
                        owner: str | None = None) -> list[int]:
        """Mark the accepted versions after ``to_version`` (only ``owner``'s when given: per-user policies roll back
        one user's) rolled back and record the rollback. Returns them."""
        where, args = owned_rows(owner)
        with self.db.tx() as db:
            later = [r["version"] for r in db.execute(
                f"SELECT version FROM versions WHERE version > ? AND status='accepted'{where} ORDER BY version",
                (int(to_version), *args))]
            db.execute(f"UPDATE versions SET status='rolled_back' WHERE version > ? AND status='accepted'{where}",
                       (int(to_version), *args))
            insert_event(db, "rollback", {"from_version": from_version, "rolled_back": later, **detail,
                                          **({"owner": owner} if owner is not None else {})},
                         version=int(to_version))
        return later

    def latest_accepted_version(self) -> int | None:
        """The highest version whose status is ``accepted`` (None: none is)."""
        with self.db.read() as db:
            row = db.execute("SELECT MAX(version) FROM versions WHERE status='accepted'").fetchone()
        return None if row[0] is None else int(row[0])

    def event_counts(self) -> dict[str, int]:
        """Events by kind (their details, which hold the gate's evidence, are not read)."""
        with self.db.read() as db:
            rows = db.execute("SELECT kind, COUNT(*) AS n FROM events GROUP BY kind").fetchall()
        return {r["kind"]: int(r["n"]) for r in rows}

    def recent_events(self, n: int) -> list[dict[str, Any]]:
        """The ``n`` newest events, oldest first, as ``events`` gives them."""
        with self.db.read() as db:
            rows = db.execute("SELECT * FROM events ORDER BY id DESC LIMIT ?", (int(n),)).fetchall()
        return [_event_row(r) for r in reversed(rows)]

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        with self.db.read() as db:
            if kind is None:
                rows = db.execute("SELECT * FROM events ORDER BY id").fetchall()
            else:
                rows = db.execute("SELECT * FROM events WHERE kind=? ORDER BY id", (kind,)).fetchall()
        return [_event_row(r) for r in rows]
