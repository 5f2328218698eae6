"""The durable state of a run: turns, votes, samples, steps — one SQLite file (WAL) in the run directory.

A turn moves through these states (``TurnState``); every move is a compare-and-set in one transaction, so two
workers never take the same turn and a crash leaves each turn in exactly one state:

    awaiting_next ──(next request of the session)──▶ judgeable ──▶ judging ──▶ ready ──▶ leased ──▶ consumed
          │                                              │            │                   │
          └──(session end / idle)──▶ dropped(no_next_state)          └──▶ dropped(reason) └─(lease expiry)─▶ ready

``judging`` covers the judge votes and the teacher targets; work left there by a crash is picked up again at
restart (``recover()`` moves it back to ``judgeable``; votes of the interrupted attempt are discarded). From
``ready`` on the turn has a sample and is in its sample's state.

``Store`` is the one object callers hold; it is made of parts with one job each:

* ``turns.Turns`` — the turn state machine and the judge's votes;
* ``samples.Samples`` — samples and their leases, with their own states (``samples.move`` is the one place a
  sample's state is written, its turn's with it), the commit of a step and the requeue on resume;
* ``history.History`` — steps, requeued steps, versions, events and rollbacks;
* ``queries.Queries`` — read-only counts and listings for the dashboard and ``/v1/status``;
* ``contexts.Contexts`` — context samples: the teacher's own answers to a hinted turn, each a turn and sample of
  its own (kind ``context``), linked to the judged turn they came from;
* ``export`` — every record appended to JSONL files;
* ``forget`` — one user's records deleted, and their text taken out of the file and its log;

over ``database.Database`` (the file, its schema and migrations, its transactions) and the records of
``records``. Nothing is deleted or truncated except by an explicit ``forget_owner`` (one user's records, on
request): otherwise the store is the record. Tables and columns are only ever
added, so an older store opens as it is (``database`` has the details).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from clawloop.store.contexts import CONTEXT_KIND, ContextSample, Contexts
from clawloop.store.database import SCHEMA_VERSION, STORE_FILENAME, Database, StoreInUse, find_store
from clawloop.store.export import export_jsonl, iter_export
from clawloop.store.forget import ForgetResult, forget_owner, owner_hints
from clawloop.store.history import History, mark_uncommitted_versions, put_meta
from clawloop.store.queries import Queries
from clawloop.store.records import LeaseLost, SampleRecord, TurnRecord, TurnState, VoteRecord
from clawloop.store.samples import Samples, leased_back_to_ready
from clawloop.store.turns import Turns, judging_back_to_judgeable

__all__ = ["CONTEXT_KIND", "SCHEMA_VERSION", "STORE_FILENAME", "ContextSample", "ForgetResult", "LeaseLost",
           "SampleRecord", "Store", "StoreInUse", "TurnRecord", "TurnState", "VoteRecord", "find_store"]


class Store(Turns, Samples, History, Queries, Contexts):
    """Thread-safe access to the run's SQLite file. Every public method is one short transaction."""

    def __init__(self, path: str | Path, readonly: bool = False, busy_timeout_s: float = 30.0):
        """``readonly``: SQLite's read-only mode (a reader beside the writing process, or of a finished run).
        ``busy_timeout_s``: how long a statement waits for another connection's write lock before SQLite raises
        ``OperationalError('database is locked')``."""
        self.db = Database(path, readonly=readonly, busy_timeout_s=busy_timeout_s)
        self.path = self.db.path
        self._recovered = False
        self._on_close: list[Callable[[], None]] = []

    def check_alone(self, what: str) -> None:
        """``StoreInUse`` when another handle, in this process or another, has the file open for writing: what
        ``what`` (an operation that must be alone with the store, a forget) would meet, asked before it begins."""
        with self.db.exclusive(what):
            pass

    def release_on_close(self, release: Callable[[], None]) -> None:
        """Call ``release`` once the store is closed (a lock that is held as long as the store is open)."""
        self._on_close.append(release)

    def close(self) -> None:
        try:
            self.db.close()
        finally:
            while self._on_close:
                self._on_close.pop()()

    # ---- meta ------------------------------------------------------------------------------------------
    def get_meta(self, key: str, default: str | None = None) -> str | None:
        with self.db.read() as db:
            row = db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return default if row is None else row["value"]

    def set_meta(self, key: str, value: str) -> None:
        with self.db.tx() as db:
            put_meta(db, key, value)

    # ---- crash recovery --------------------------------------------------------------------------------
    def recover(self) -> dict[str, int]:
        """At start-up: put interrupted work back where it can be picked up again, in one transaction.

        judging -> judgeable (its partial votes are marked superseded by bumping the attempt on the next run);
        leased samples -> ready (the trainer that held them is gone with the old process);
        versions whose step never committed -> uncommitted (``history.mark_uncommitted_versions``).

        Once per opened store: whoever starts first (the server that opened the store, or a pipeline given one)
        recovers, and later calls change nothing and return zeros, so that work this process has started since
        (a turn being judged, a lease of a trainer in this process) is never taken back.
        """
        with self.db.tx() as db:
            if self._recovered:
                return {"judging_to_judgeable": 0, "leased_to_ready": 0}
            self._recovered = True
            judged = judging_back_to_judgeable(db)
            leased = leased_back_to_ready(db)
            mark_uncommitted_versions(db)
        return {"judging_to_judgeable": judged, "leased_to_ready": leased}

    # ---- forgetting ------------------------------------------------------------------------------------
    def forget_owner(self, owner: str, *, reader_wait_s: float = 30.0,
                     within: Callable[[sqlite3.Connection, ForgetResult], None] | None = None) -> ForgetResult:
        """Delete every record of ``owner`` and leave none of their text in the file or its log
        (``clawloop.store.forget``)."""
        return forget_owner(self.db, owner, reader_wait_s=reader_wait_s, within=within)

    def owner_hints(self, owner: str) -> set[str]:
        """The hints written from ``owner``'s turns (what other records may quote of them; never stored
        elsewhere by a forget)."""
        with self.db.read() as db:
            return owner_hints(db, owner)

    # ---- export ----------------------------------------------------------------------------------------
    def iter_export(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(file name, record) pairs for every turn (with its votes and sample summary) and every step."""
        return iter_export(self)

    def export_jsonl(self, out_dir: str | Path) -> dict[str, int]:
        """Append every record to JSONL files in ``out_dir`` (never truncates). Returns lines written per file."""
        return export_jsonl(self, out_dir)
