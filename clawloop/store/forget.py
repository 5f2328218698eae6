"""Forgetting one user: their records deleted from the store, and none of their text left in its files.

What a user leaves in a run's store, and what ``forget_owner`` does with it, in one transaction:

* their turns (``turns.owner``), with the context turns sampled from them (``context_turns``), the votes and hints
  the judge wrote on them (``votes``) and their samples (``samples``): deleted;
* the publication gate's evidence (``versions.evidence``, ``events.detail``): the probes it made of their prompts
  (``recent:<turn id>`` and ``fixed:<turn id>``) keep their verdicts but lose their prompt and answers, and any
  other string there that quotes one of those prompts (a reason such as "1 earlier fix broken (…)") has it cut;
* the steps that trained on them (``steps.turn_ids``, ``requeued_steps.turn_ids``) hold ids only: kept, so the
  record still says which steps and versions the deleted samples went into, and the receipt lists them.

Deleting a row is not enough to take its text out of the files: SQLite leaves freed pages as they were, and in
WAL mode the old page images stay in the ``-wal`` file until a checkpoint overwrites the database and the log is
truncated. So the deletes run with ``PRAGMA secure_delete`` on (freed content is overwritten with zeros), and
afterwards ``VACUUM`` rebuilds the file and ``PRAGMA wal_checkpoint(TRUNCATE)`` empties the log. Another process
reading the store (a dashboard) can hold the log open; then the checkpoint cannot finish, and
``ForgetResult.log_truncated`` says so: the caller reports it, and forgetting again once the reader has gone
finishes the job (the deletes are already committed; a second run finds nothing more to delete and truncates).

It runs only while no other handle has the store open for writing (``Database.exclusive``: a running server
makes it raise ``StoreInUse`` before anything is deleted); readers need not stop.

What the weights learnt from the deleted samples is not the store's business: the caller decides what the steps
listed in ``ForgetResult.steps`` mean for the versions trained on them.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from clawloop.store.database import Database

CUT = "[forgotten]"
"""What replaces a forgotten user's prompt where another record quoted it."""

PROBE_SOURCES = ("recent", "fixed")
"""Gate probe sources made from a stored turn: ``<source>:<turn id>``."""

PROBE_TEXT_FIELDS = ("prompt", "answer", "accepted_answer")
"""Fields of a probe outcome that hold a prompt or an answer to it."""


@dataclass
class ForgetResult:
    """What ``forget_owner`` deleted and changed: counts and ids, never text."""

    owner: str
    turn_ids: list[int] = field(default_factory=list)
    """Every deleted turn: the user's own and the context turns sampled from them."""
    sessions: int = 0
    votes: int = 0
    samples: int = 0
    context_turns: int = 0
    steps: list[int] = field(default_factory=list)
    """Optimizer steps that trained on a deleted sample (committed or later requeued), in order."""
    versions_scrubbed: list[int] = field(default_factory=list)
    """Versions whose gate evidence quoted the user and was cut."""
    events_scrubbed: int = 0
    log_truncated: bool = False
    """Whether the WAL file was checkpointed and truncated to zero bytes (False: a reader held it)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def forget_owner(database: Database, owner: str, *, reader_wait_s: float = 30.0,
                 within: Callable[[sqlite3.Connection, ForgetResult], None] | None = None) -> ForgetResult:
    """Delete every record of ``owner`` (a ``turns.owner`` value, never "") and cut their text from the gate's
    evidence; then rebuild the file and truncate its log so that no byte of it is left, waiting up to
    ``reader_wait_s`` for readers of the log to finish. Idempotent: forgetting an owner with nothing left
    deletes nothing and only compacts. ``within`` runs in the deleting transaction, after the deletes: what it
    writes (a record of what is left to do outside the store) commits with them or not at all."""
    if not owner:
        raise ValueError("an owner is needed: turns served without per-user keys have none, and forgetting them "
                         "would forget everyone")
    result = ForgetResult(owner=owner)
    with database.exclusive("forget the user"):
        connection = database.connection
        connection.execute("PRAGMA secure_delete=ON")
        try:
            with database.tx() as db:
                _delete_records(db, owner, result)
                if within is not None:
                    within(db, result)
            connection.execute("VACUUM")
            (timeout_ms,) = connection.execute("PRAGMA busy_timeout").fetchone()
            connection.execute(f"PRAGMA busy_timeout={int(reader_wait_s * 1000)}")
            try:
                busy, _, _ = connection.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            finally:
                connection.execute(f"PRAGMA busy_timeout={int(timeout_ms)}")
            result.log_truncated = busy == 0
        finally:
            connection.execute("PRAGMA secure_delete=OFF")
    return result


def _delete_records(db: sqlite3.Connection, owner: str, result: ForgetResult) -> None:
    result.sessions = int(db.execute("SELECT COUNT(DISTINCT session_id) FROM turns WHERE owner=?",
                                     (owner,)).fetchone()[0])
    hints = owner_hints(db, owner)
    # The ids go in a temporary table rather than in bound parameters: a long-time user's turns can outnumber
    # what one statement may bind.
    db.execute("CREATE TEMP TABLE IF NOT EXISTS forget_ids (id INTEGER PRIMARY KEY)")
    db.execute("DELETE FROM forget_ids")
    db.execute("INSERT INTO forget_ids SELECT id FROM turns WHERE owner=?", (owner,))
    db.execute("INSERT OR IGNORE INTO forget_ids SELECT turn_id FROM context_turns "
               "WHERE source_turn_id IN (SELECT id FROM forget_ids)")
    ids = {int(r["id"]) for r in db.execute("SELECT id FROM forget_ids")}
    result.turn_ids = sorted(ids)
    if ids:
        chosen = "IN (SELECT id FROM forget_ids)"
        result.votes = db.execute(f"DELETE FROM votes WHERE turn_id {chosen}").rowcount
        result.context_turns = db.execute(
            f"DELETE FROM context_turns WHERE turn_id {chosen} OR source_turn_id {chosen}").rowcount
        result.samples = db.execute(f"DELETE FROM samples WHERE turn_id {chosen}").rowcount
        db.execute(f"DELETE FROM turns WHERE id {chosen}")
    db.execute("DROP TABLE forget_ids")
    if not ids:
        return
    steps: set[int] = set()
    for table in ("steps", "requeued_steps"):
        for row in db.execute(f"SELECT step, turn_ids FROM {table}"):
            if ids.intersection(int(t) for t in json.loads(row["turn_ids"])):
                steps.add(int(row["step"]))
    result.steps = sorted(steps)
    sources = probe_sources(ids)
    for row in db.execute("SELECT version, evidence FROM versions").fetchall():
        evidence = json.loads(row["evidence"])
        if scrub_quotes(evidence, sources, hints):
            db.execute("UPDATE versions SET evidence=? WHERE version=?", (json.dumps(evidence), row["version"]))
            result.versions_scrubbed.append(int(row["version"]))
    for row in db.execute("SELECT id, detail FROM events").fetchall():
        detail = json.loads(row["detail"])
        if scrub_quotes(detail, sources, hints):
            db.execute("UPDATE events SET detail=? WHERE id=?", (json.dumps(detail), row["id"]))
            result.events_scrubbed += 1


def owner_hints(db: sqlite3.Connection, owner: str) -> set[str]:
    """Every hint written from ``owner``'s turns (their votes' and samples' hints): text of theirs that other
    records quote (the gate's preference check names the hint it reads), to be cut where it is quoted."""
    hints = {r["hint"] for r in db.execute(
        "SELECT DISTINCT v.hint FROM votes v JOIN turns t ON t.id = v.turn_id WHERE t.owner=? AND v.hint != ''",
        (owner,))}
    for row in db.execute("SELECT s.hints FROM samples s JOIN turns t ON t.id = s.turn_id WHERE t.owner=?",
                          (owner,)):
        hints.update(h for h in json.loads(row["hints"]) if isinstance(h, str) and h)
    return hints


def probe_sources(turn_ids: Iterable[int]) -> set[str]:
    """The gate probe sources made from these turns."""
    return {f"{kind}:{int(turn_id)}" for kind in PROBE_SOURCES for turn_id in turn_ids}


def scrub_quotes(record: Any, sources: set[str], texts: Iterable[str] = ()) -> bool:
    """Blank the text fields of every probe outcome in ``record`` whose source is in ``sources``, then cut what
    those fields held, and ``texts`` (the user's hints: the gate's preference check quotes the hint it reads), from
    every string. In place; True when anything changed."""
    quoted: set[str] = set()

    def blank(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("source") in sources:
                for key in PROBE_TEXT_FIELDS:
                    if isinstance(node.get(key), str) and node[key]:
                        quoted.add(node[key])
                        node[key] = CUT
            for value in node.values():
                blank(value)
        elif isinstance(node, list):
            for value in node:
                blank(value)

    blank(record)
    changed = bool(quoted)
    longest_first = sorted({q for q in quoted | set(texts) if q and q != CUT}, key=len, reverse=True)
    if not longest_first:
        return changed

    def cut(node: Any) -> Any:
        nonlocal changed
        if isinstance(node, str):
            for text in longest_first:
                if text in node:
                    node = node.replace(text, CUT)
                    changed = True
            return node
        if isinstance(node, dict):
            for key, value in node.items():
                node[key] = cut(value)
        elif isinstance(node, list):
            node[:] = [cut(value) for value in node]
        return node

    cut(record)
    return changed
