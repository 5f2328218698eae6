"""The durable state of a run: turns, votes, samples, steps — one SQLite file (WAL) in the run directory.

A turn moves through these states (``TurnState``); every move is a compare-and-set in one transaction, so two
workers never take the same turn and a crash leaves each turn in exactly one state:

    awaiting_next ──(next request of the session)──▶ judgeable ──▶ judging ──▶ ready ──▶ leased ──▶ consumed
          │                                              │            │                   │
          └──(session end / idle)──▶ dropped(no_next_state)          └──▶ dropped(reason) └─(lease expiry)─▶ ready

``judging`` covers the judge votes and the teacher targets; work left there by a crash is picked up again at
restart (``recover()`` moves it back to ``judgeable``; votes of the interrupted attempt are discarded).
A sample is written in the same transaction that moves its turn to ``ready``; the trainer leases samples and
acknowledges them with the optimizer step that used them. ``requeue_after_step(n)`` returns samples consumed by
steps after the checkpoint a run resumes from, so no sample is trained twice or skipped.

Nothing is ever deleted or truncated: the store is the record. ``export_jsonl`` appends to files. Steps whose
weights were lost in a crash stay in ``steps`` and are marked by a copy in ``requeued_steps`` on resume (step
numbers are never reused); ``versions`` indexes the published
versions (their weights are in ``RUN_DIR/versions``; status ``accepted``, ``rolled_back``, ``uncommitted`` for one
whose step a crash kept from committing, ``archived`` after a fresh start) and ``events`` records gate decisions,
rollbacks, requeues and repairs with their evidence. Tables are only ever added, so an older store opens as it is.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

SCHEMA_VERSION = 1


class TurnState(StrEnum):
    AWAITING_NEXT = "awaiting_next"
    JUDGEABLE = "judgeable"
    JUDGING = "judging"
    READY = "ready"
    LEASED = "leased"
    CONSUMED = "consumed"
    DROPPED = "dropped"


@dataclass
class TurnRecord:
    """One main-line turn exactly as served."""

    session_id: str
    messages: list[dict[str, Any]]
    """The request messages (normalised), i.e. the context the answer was generated for."""
    prompt_ids: list[int]
    """The rendered prompt token ids the engine saw."""
    response_ids: list[int]
    """The generated token ids, exactly as sampled (trained on as-is, never re-rendered)."""
    logprobs: list[float]
    """Behaviour log-probs of ``response_ids`` under the sampling distribution."""
    temperature: float
    top_p: float
    policy_version: int
    response_text: str = ""
    assistant_message: dict[str, Any] = field(default_factory=dict)
    """The assistant message as returned to the client (content, tool_calls)."""
    tools: list[dict[str, Any]] | None = None
    finish_reason: str = "stop"
    turn_index: int = 0
    created_at: float = field(default_factory=time.time)
    owner: str = ""
    """Fingerprint of the per-user key whose session this is ("" without per-user keys); never the key."""
    # Filled later:
    next_state: list[dict[str, Any]] | None = None
    """All messages that came after the stored answer in the session's next main request."""
    state: str = TurnState.AWAITING_NEXT
    reason: str = ""
    id: int | None = None
    updated_at: float = 0.0


@dataclass
class VoteRecord:
    turn_id: int
    kind: str
    """'eval' or 'hint'."""
    index: int
    score: int | None
    """Parsed vote, None when invalid (timeout, HTTP error, no box)."""
    raw_text: str = ""
    hint: str = ""
    error: str = ""
    latency_s: float = 0.0
    attempt: int = 0


@dataclass
class SampleRecord:
    """A finished training sample: the turn's ids plus what the judge and teacher made of it."""

    turn_id: int
    reward: float
    """Majority evaluative vote in {+1, -1, 0}."""
    kind: str
    """'rl+opd', 'opd' or 'rl'."""
    hints: list[str] = field(default_factory=list)
    targets: dict[str, torch.Tensor] | None = None
    """Teacher-side tensors of ``clawloop.losses.TopKTargets`` (and anything else the trainer needs), or None."""
    teacher_version: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    state: str = TurnState.READY
    lease_id: str = ""
    consumed_step: int | None = None
    created_at: float = field(default_factory=time.time)


def _ids_blob(ids: Iterable[int]) -> bytes:
    return array("i", ids).tobytes()


def _ids_from(blob: bytes | None) -> list[int]:
    a = array("i")
    if blob:
        a.frombytes(blob)
    return a.tolist()


def _floats_blob(xs: Iterable[float]) -> bytes:
    return array("f", xs).tobytes()


def _floats_from(blob: bytes | None) -> list[float]:
    a = array("f")
    if blob:
        a.frombytes(blob)
    return a.tolist()


_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS turns (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id TEXT NOT NULL,
    turn_index INTEGER NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    messages TEXT NOT NULL,
    tools TEXT,
    prompt_ids BLOB NOT NULL,
    response_ids BLOB NOT NULL,
    logprobs BLOB NOT NULL,
    temperature REAL NOT NULL,
    top_p REAL NOT NULL,
    policy_version INTEGER NOT NULL,
    response_text TEXT NOT NULL,
    assistant_message TEXT NOT NULL,
    finish_reason TEXT NOT NULL,
    next_state TEXT
);
CREATE INDEX IF NOT EXISTS turns_state ON turns(state);
CREATE INDEX IF NOT EXISTS turns_session ON turns(session_id, turn_index);
CREATE TABLE IF NOT EXISTS votes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    turn_id INTEGER NOT NULL REFERENCES turns(id),
    kind TEXT NOT NULL,
    vote_index INTEGER NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0,
    score INTEGER,
    hint TEXT NOT NULL DEFAULT '',
    raw_text TEXT NOT NULL DEFAULT '',
    error TEXT NOT NULL DEFAULT '',
    latency_s REAL NOT NULL DEFAULT 0,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS votes_turn ON votes(turn_id);
CREATE TABLE IF NOT EXISTS samples (
    turn_id INTEGER PRIMARY KEY REFERENCES turns(id),
    state TEXT NOT NULL,
    reward REAL NOT NULL,
    kind TEXT NOT NULL,
    hints TEXT NOT NULL,
    targets BLOB,
    teacher_version INTEGER NOT NULL,
    info TEXT NOT NULL,
    lease_id TEXT NOT NULL DEFAULT '',
    lease_expires REAL NOT NULL DEFAULT 0,
    consumed_step INTEGER,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS samples_state ON samples(state);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY,
    created_at REAL NOT NULL,
    policy_version INTEGER NOT NULL,
    metrics TEXT NOT NULL,
    turn_ids TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS requeued_steps (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    step INTEGER NOT NULL,
    created_at REAL NOT NULL,
    policy_version INTEGER NOT NULL,
    metrics TEXT NOT NULL,
    turn_ids TEXT NOT NULL,
    requeued_at REAL NOT NULL,
    resumed_from_step INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS versions (
    version INTEGER PRIMARY KEY,
    step INTEGER NOT NULL,
    created_at REAL NOT NULL,
    status TEXT NOT NULL,
    evidence TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at REAL NOT NULL,
    kind TEXT NOT NULL,
    step INTEGER,
    version INTEGER,
    detail TEXT NOT NULL
);
"""


STORE_FILENAME = "store.sqlite"


def find_store(run_dir: str | Path) -> Path:
    """The run's SQLite store: ``RUN_DIR/store.sqlite``, or the only ``*.sqlite``/``*.db`` file there."""
    run_dir = Path(run_dir)
    default = run_dir / STORE_FILENAME
    if default.exists():
        return default
    found = sorted(p for pattern in ("*.sqlite", "*.db") for p in run_dir.glob(pattern))
    if len(found) == 1:
        return found[0]
    if not found:
        raise FileNotFoundError(f"{run_dir} holds no store ({STORE_FILENAME})")
    raise FileNotFoundError(f"{run_dir} holds several stores ({', '.join(p.name for p in found)}); "
                            f"which one is the run's is ambiguous")


class Store:
    """Thread-safe access to the run's SQLite file. Every public method is one short transaction."""

    def __init__(self, path: str | Path, readonly: bool = False):
        self.path = Path(path)
        self._lock = threading.RLock()
        self._recovered = False
        if readonly:
            # A reader beside the process that writes the run (or of a finished run): SQLite's read-only mode, no
            # schema or journal changes, and a lock of its own, so reads never queue behind the writer's lock.
            self._db = sqlite3.connect(self.path.resolve().as_uri() + "?mode=ro", uri=True, check_same_thread=False,
                                       isolation_level=None, timeout=30.0)
            self._db.row_factory = sqlite3.Row
            self._stand_in_for_missing_tables()
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30.0)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode survives a process crash (kill -9); only an OS crash can lose the last commits.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        self._add_missing_columns()
        with self._tx() as db:
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row["value"]) != SCHEMA_VERSION:
                raise RuntimeError(f"{self.path} has schema {row['value']}, this clawloop reads {SCHEMA_VERSION}")

    # ---- plumbing -------------------------------------------------------------------------------------
    def _stand_in_for_missing_tables(self) -> None:
        """Read-only handle on a store older than this code: the tables it lacks read as empty (connection-local
        TEMP tables; the file is not touched)."""
        have = {r["name"] for r in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        for statement in _SCHEMA.split(";"):
            head = statement.split("(", 1)[0].split()
            if head[:5] == ["CREATE", "TABLE", "IF", "NOT", "EXISTS"] and head[5] not in have:
                self._db.execute(statement.replace("CREATE TABLE", "CREATE TEMP TABLE", 1))

    _ADDED_COLUMNS = (("turns", "owner", "TEXT NOT NULL DEFAULT ''"),)
    """Columns newer than a store file may be; added in place on open (old rows get the default)."""

    def _add_missing_columns(self) -> None:
        with self._tx() as db:
            for table, column, decl in self._ADDED_COLUMNS:
                have = {r["name"] for r in db.execute(f"PRAGMA table_info({table})").fetchall()}
                if column not in have:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")

    class _Tx:
        def __init__(self, store: "Store"):
            self.store = store

        def __enter__(self) -> sqlite3.Connection:
            self.store._lock.acquire()
            self.store._db.execute("BEGIN IMMEDIATE")
            return self.store._db

        def __exit__(self, exc_type, exc, tb) -> None:
            db = self.store._db
            try:
                if exc_type:
                    db.execute("ROLLBACK")
                else:
                    try:
                        db.execute("COMMIT")
                    except sqlite3.Error:
                        # A failed COMMIT (disk full) leaves the transaction open: roll it back so the next
                        # transaction can begin once space returns, then report the failure.
                        if db.in_transaction:
                            try:
                                db.execute("ROLLBACK")
                            except sqlite3.Error:
                                pass
                        raise
            finally:
                self.store._lock.release()

    def _tx(self) -> "Store._Tx":
        return Store._Tx(self)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ---- meta ------------------------------------------------------------------------------------------
    def get_meta(self, key: str, default: str | None = None) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return default if row is None else row["value"]

    def set_meta(self, key: str, value: str) -> None:
        with self._tx() as db:
            db.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                       (key, value))

    # ---- turns -----------------------------------------------------------------------------------------
    def add_turn(self, turn: TurnRecord) -> int:
        """Commit a served main turn (before its answer is returned). Returns its id."""
        now = time.time()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO turns (session_id, owner, turn_index, state, reason, created_at, updated_at, messages,"
                " tools, prompt_ids, response_ids, logprobs, temperature, top_p, policy_version, response_text,"
                " assistant_message, finish_reason, next_state) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (turn.session_id, turn.owner, turn.turn_index, str(turn.state), turn.reason, turn.created_at, now,
                 json.dumps(turn.messages, ensure_ascii=False),
                 None if turn.tools is None else json.dumps(turn.tools, ensure_ascii=False),
                 _ids_blob(turn.prompt_ids), _ids_blob(turn.response_ids), _floats_blob(turn.logprobs),
                 turn.temperature, turn.top_p, turn.policy_version, turn.response_text,
                 json.dumps(turn.assistant_message, ensure_ascii=False), turn.finish_reason,
                 None if turn.next_state is None else json.dumps(turn.next_state, ensure_ascii=False)),
            )
            turn.id = int(cur.lastrowid)
            turn.updated_at = now
        return turn.id

    @staticmethod
    def _turn_from_row(row: sqlite3.Row) -> TurnRecord:
        return TurnRecord(
            id=row["id"], session_id=row["session_id"], owner=row["owner"] if "owner" in row.keys() else "",
            turn_index=row["turn_index"],
            state=row["state"],
            reason=row["reason"], created_at=row["created_at"], updated_at=row["updated_at"],
            messages=json.loads(row["messages"]), tools=json.loads(row["tools"]) if row["tools"] else None,
            prompt_ids=_ids_from(row["prompt_ids"]), response_ids=_ids_from(row["response_ids"]),
            logprobs=_floats_from(row["logprobs"]), temperature=row["temperature"], top_p=row["top_p"],
            policy_version=row["policy_version"], response_text=row["response_text"],
            assistant_message=json.loads(row["assistant_message"]), finish_reason=row["finish_reason"],
            next_state=json.loads(row["next_state"]) if row["next_state"] else None,
        )

    def get_turn(self, turn_id: int) -> TurnRecord:
        with self._lock:
            row = self._db.execute("SELECT * FROM turns WHERE id=?", (turn_id,)).fetchone()
        if row is None:
            raise KeyError(f"no turn {turn_id}")
        return self._turn_from_row(row)

    def turns(self, state: str | None = None, session_id: str | None = None, limit: int = 1_000_000,
              after_id: int = 0) -> list[TurnRecord]:
        query, args = "SELECT * FROM turns WHERE id > ?", [after_id]
        if state is not None:
            query += " AND state=?"
            args.append(str(state))
        if session_id is not None:
            query += " AND session_id=?"
            args.append(session_id)
        query += " ORDER BY id LIMIT ?"
        args.append(limit)
        with self._lock:
            rows = self._db.execute(query, args).fetchall()
        return [self._turn_from_row(r) for r in rows]

    def set_next_state(self, turn_id: int, next_state: list[dict[str, Any]]) -> bool:
        """awaiting_next -> judgeable with the messages that followed the answer. False if not awaiting."""
        with self._tx() as db:
            cur = db.execute(
                "UPDATE turns SET next_state=?, state=?, updated_at=? WHERE id=? AND state=?",
                (json.dumps(next_state, ensure_ascii=False), TurnState.JUDGEABLE, time.time(), turn_id,
                 TurnState.AWAITING_NEXT))
            return cur.rowcount == 1

    def transition(self, turn_id: int, from_states: Iterable[str], to_state: str, reason: str | None = None) -> bool:
        """Compare-and-set a turn's state. Returns False (and changes nothing) if it is not in ``from_states``."""
        froms = [str(s) for s in from_states]
        marks = ",".join("?" * len(froms))
        with self._tx() as db:
            if reason is None:
                cur = db.execute(f"UPDATE turns SET state=?, updated_at=? WHERE id=? AND state IN ({marks})",
                                 (str(to_state), time.time(), turn_id, *froms))
            else:
                cur = db.execute(
                    f"UPDATE turns SET state=?, reason=?, updated_at=? WHERE id=? AND state IN ({marks})",
                    (str(to_state), reason, time.time(), turn_id, *froms))
            return cur.rowcount == 1

    def drop_turn(self, turn_id: int, reason: str, from_states: Iterable[str] | None = None) -> bool:
        """Close a turn without a sample, recording why (never silently)."""
        froms = from_states or (TurnState.AWAITING_NEXT, TurnState.JUDGEABLE, TurnState.JUDGING)
        return self.transition(turn_id, froms, TurnState.DROPPED, reason)

    def claim_judgeable(self, limit: int = 1) -> list[TurnRecord]:
        """Atomically move up to ``limit`` judgeable turns to judging and return them (oldest first)."""
        with self._tx() as db:
            rows = db.execute("SELECT * FROM turns WHERE state=? ORDER BY id LIMIT ?",
                              (TurnState.JUDGEABLE, limit)).fetchall()
            now = time.time()
            for r in rows:
                db.execute("UPDATE turns SET state=?, updated_at=? WHERE id=?", (TurnState.JUDGING, now, r["id"]))
        turns = [self._turn_from_row(r) for r in rows]
        for t in turns:
            t.state = TurnState.JUDGING
        return turns

    def count_turns(self, owner: str | None = None) -> dict[str, int]:
        """Turns by state; only ``owner``'s when given."""
        where, args = ("WHERE owner=?", (owner,)) if owner is not None else ("", ())
        with self._lock:
            rows = self._db.execute(f"SELECT state, COUNT(*) AS n FROM turns {where} GROUP BY state", args).fetchall()
        return {r["state"]: r["n"] for r in rows}

    def drop_reasons(self, owner: str | None = None) -> dict[str, int]:
        """Dropped turns by reason; only ``owner``'s when given."""
        where, args = (" AND owner=?", (owner,)) if owner is not None else ("", ())
        with self._lock:
            rows = self._db.execute(f"SELECT reason, COUNT(*) AS n FROM turns WHERE state=?{where} GROUP BY reason",
                                    (TurnState.DROPPED, *args)).fetchall()
        return {r["reason"]: r["n"] for r in rows}

    def vote_stats(self, top_errors: int = 3) -> dict[str, Any]:
        """Judge votes recorded: how many, how many were invalid (no score), and the commonest errors."""
        with self._lock:
            row = self._db.execute("SELECT COUNT(*) AS n, SUM(score IS NULL) AS bad FROM votes").fetchone()
            errors = self._db.execute(
                "SELECT substr(error, 1, 120) AS e, COUNT(*) AS n FROM votes WHERE score IS NULL AND error != '' "
                "GROUP BY e ORDER BY n DESC LIMIT ?", (int(top_errors),)).fetchall()
        total, invalid = int(row["n"] or 0), int(row["bad"] or 0)
        return {"votes": total, "invalid": invalid, "invalid_rate": round(invalid / total, 4) if total else None,
                "top_errors": {r["e"]: r["n"] for r in errors}}

    def recover(self) -> dict[str, int]:
        """At start-up: put interrupted work back where it can be picked up again.

        judging -> judgeable (its partial votes are marked superseded by bumping the attempt on the next run);
        leased samples -> ready (the trainer that held them is gone with the old process);
        versions whose step never committed -> uncommitted (``_mark_uncommitted_versions``).

        Once per opened store: whoever starts first (the server that opened the store, or a pipeline given one)
        recovers, and later calls change nothing and return zeros, so that work this process has started since
        (a turn being judged, a lease of a trainer in this process) is never taken back.
        """
        with self._tx() as db:
            if self._recovered:
                return {"judging_to_judgeable": 0, "leased_to_ready": 0}
            self._recovered = True
            judged = db.execute("UPDATE turns SET state=?, updated_at=? WHERE state=?",
                                (TurnState.JUDGEABLE, time.time(), TurnState.JUDGING)).rowcount
            leased = [r["turn_id"] for r in db.execute("SELECT turn_id FROM samples WHERE state=?",
                                                       (TurnState.LEASED,)).fetchall()]
            self._back_to_ready(db, leased)
            self._mark_uncommitted_versions(db)
        return {"judging_to_judgeable": judged, "leased_to_ready": len(leased)}

    # ---- votes -----------------------------------------------------------------------------------------
    def add_votes(self, votes: Iterable[VoteRecord]) -> None:
        now = time.time()
        with self._tx() as db:
            db.executemany(
                "INSERT INTO votes (turn_id, kind, vote_index, attempt, score, hint, raw_text, error, latency_s,"
                " created_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                [(v.turn_id, v.kind, v.index, v.attempt, v.score, v.hint, v.raw_text, v.error, v.latency_s, now)
                 for v in votes])

    def votes(self, turn_id: int) -> list[VoteRecord]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM votes WHERE turn_id=? ORDER BY id", (turn_id,)).fetchall()
        return [VoteRecord(turn_id=r["turn_id"], kind=r["kind"], index=r["vote_index"], attempt=r["attempt"],
                           score=r["score"], hint=r["hint"], raw_text=r["raw_text"], error=r["error"],
                           latency_s=r["latency_s"]) for r in rows]

    # ---- samples ---------------------------------------------------------------------------------------
    def put_sample(self, sample: SampleRecord) -> bool:
        """Write a sample and move its turn judging -> ready in one transaction. False if already written or the
        turn is not being judged (so a sample can never be produced twice)."""
        blob = None if sample.targets is None else st_save({k: v.contiguous() for k, v in sample.targets.items()})
        with self._tx() as db:
            cur = db.execute("UPDATE turns SET state=?, reason=?, updated_at=? WHERE id=? AND state=?",
                             (TurnState.READY, sample.kind, time.time(), sample.turn_id, TurnState.JUDGING))
            if cur.rowcount != 1:
                return False
            db.execute(
                "INSERT INTO samples (turn_id, state, reward, kind, hints, targets, teacher_version, info,"
                " created_at) VALUES (?,?,?,?,?,?,?,?,?)",
                (sample.turn_id, TurnState.READY, sample.reward, sample.kind,
                 json.dumps(sample.hints, ensure_ascii=False), blob, sample.teacher_version,
                 json.dumps(sample.info, ensure_ascii=False), sample.created_at))
        return True

    @staticmethod
    def _sample_from_row(row: sqlite3.Row) -> SampleRecord:
        return SampleRecord(
            turn_id=row["turn_id"], reward=row["reward"], kind=row["kind"], hints=json.loads(row["hints"]),
            targets=None if row["targets"] is None else st_load(row["targets"]),
            teacher_version=row["teacher_version"], info=json.loads(row["info"]), state=row["state"],
            lease_id=row["lease_id"], consumed_step=row["consumed_step"], created_at=row["created_at"])

    def get_sample(self, turn_id: int) -> SampleRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM samples WHERE turn_id=?", (int(turn_id),)).fetchone()
        return None if row is None else self._sample_from_row(row)

    def latest_sample_id(self) -> int | None:
        """The turn id of the newest sample with teacher targets, else of the newest sample (None: no sample)."""
        with self._lock:
            row = self._db.execute("SELECT turn_id FROM samples ORDER BY targets IS NOT NULL DESC, turn_id DESC"
                                   " LIMIT 1").fetchone()
        return None if row is None else int(row["turn_id"])

    def session_summaries(self, limit: int = 200) -> list[dict[str, Any]]:
        """The most recently active sessions, newest first: turn count, time span and turns by state."""
        with self._lock:
            rows = self._db.execute(
                "SELECT session_id, COUNT(*) AS turns, MIN(created_at) AS started_at, MAX(updated_at) AS updated_at,"
                " MAX(id) AS last_turn_id, GROUP_CONCAT(state) AS states FROM turns GROUP BY session_id"
                " ORDER BY last_turn_id DESC LIMIT ?", (int(limit),)).fetchall()
        out = []
        for r in rows:
            states: dict[str, int] = {}
            for s in (r["states"] or "").split(","):
                states[s] = states.get(s, 0) + 1
            out.append({"session_id": r["session_id"], "turns": r["turns"], "started_at": r["started_at"],
                        "updated_at": r["updated_at"], "last_turn_id": r["last_turn_id"], "states": states})
        return out

    def turn_activity(self, since: float) -> dict[str, float]:
        """Turns stored since ``since`` (epoch seconds) and their response tokens."""
        with self._lock:
            row = self._db.execute("SELECT COUNT(*) AS n, SUM(LENGTH(response_ids)) AS b FROM turns WHERE created_at"
                                   " >= ?", (float(since),)).fetchone()
        return {"turns": int(row["n"] or 0), "response_tokens": int(row["b"] or 0) // array("i").itemsize}

    def ready_count(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM samples WHERE state=?", (TurnState.READY,)).fetchone()[0]

    def oldest_ready_at(self) -> float | None:
        """When the oldest ready sample was written (epoch seconds); None when none is ready."""
        with self._lock:
            row = self._db.execute("SELECT MIN(created_at) FROM samples WHERE state=?", (TurnState.READY,)).fetchone()
        return None if row[0] is None else float(row[0])

    def lease_samples(self, n: int, lease_s: float = 3600.0, min_n: int | None = None) -> tuple[str, list[SampleRecord]]:
        """Lease up to ``n`` ready samples (oldest first) under a new lease id. With ``min_n``, lease nothing
        unless at least that many are ready. Expired leases are returned to ready first."""
        lease_id = uuid.uuid4().hex
        now = time.time()
        with self._tx() as db:
            self._expire_leases(db, now)
            rows = db.execute("SELECT turn_id FROM samples WHERE state=? ORDER BY created_at, turn_id LIMIT ?",
                              (TurnState.READY, n)).fetchall()
            if min_n is not None and len(rows) < min_n:
                return lease_id, []
            ids = [r["turn_id"] for r in rows]
            for tid in ids:
                db.execute("UPDATE samples SET state=?, lease_id=?, lease_expires=? WHERE turn_id=?",
                           (TurnState.LEASED, lease_id, now + lease_s, tid))
                db.execute("UPDATE turns SET state=?, updated_at=? WHERE id=?", (TurnState.LEASED, now, tid))
            rows = [db.execute("SELECT * FROM samples WHERE turn_id=?", (tid,)).fetchone() for tid in ids]
        return lease_id, [self._sample_from_row(r) for r in rows]

    def _expire_leases(self, db: sqlite3.Connection, now: float) -> int:
        expired = [r["turn_id"] for r in db.execute(
            "SELECT turn_id FROM samples WHERE state=? AND lease_expires < ?", (TurnState.LEASED, now)).fetchall()]
        self._back_to_ready(db, expired)
        return len(expired)

    @staticmethod
    def _back_to_ready(db: sqlite3.Connection, turn_ids: Iterable[int]) -> None:
        """Leased samples go back to ready, and their turns with them, in the caller's transaction: a sample and
        its turn always change state together."""
        for tid in turn_ids:
            db.execute("UPDATE samples SET state=?, lease_id='', lease_expires=0 WHERE turn_id=?",
                       (TurnState.READY, tid))
            db.execute("UPDATE turns SET state=? WHERE id=?", (TurnState.READY, tid))

    def extend_lease(self, lease_id: str, lease_s: float) -> int:
        """Heartbeat of a remote trainer: push the lease's expiry to now + ``lease_s``. Returns how many samples
        the lease still holds (0 = the lease was lost: expired and taken back, or already committed)."""
        with self._tx() as db:
            return db.execute("UPDATE samples SET lease_expires=? WHERE lease_id=? AND state=?",
                              (time.time() + lease_s, lease_id, TurnState.LEASED)).rowcount

    def release_lease(self, lease_id: str) -> int:
        """Give a lease's samples back (e.g. the step failed)."""
        with self._tx() as db:
            ids = [r["turn_id"] for r in db.execute("SELECT turn_id FROM samples WHERE lease_id=? AND state=?",
                                                    (lease_id, TurnState.LEASED)).fetchall()]
            self._back_to_ready(db, ids)
        return len(ids)

    def drop_leased_sample(self, turn_id: int, reason: str, lease_id: str | None = None) -> bool:
        """A leased sample the trainer will not use (too stale, too long): record why, never retry it. Only a
        sample that is leased (under ``lease_id`` when given) moves; returns whether it did, and the turn moves
        with it or not at all."""
        with self._tx() as db:
            if lease_id is None:
                cur = db.execute("UPDATE samples SET state=?, lease_id='' WHERE turn_id=? AND state=?",
                                 (TurnState.DROPPED, turn_id, TurnState.LEASED))
            else:
                cur = db.execute("UPDATE samples SET state=?, lease_id='' WHERE turn_id=? AND state=? AND lease_id=?",
                                 (TurnState.DROPPED, turn_id, TurnState.LEASED, lease_id))
            if cur.rowcount != 1:
                return False
            db.execute("UPDATE turns SET state=?, reason=?, updated_at=? WHERE id=?",
                       (TurnState.DROPPED, reason, time.time(), turn_id))
            return True

    def commit_step(self, lease_id: str, step: int, policy_version: int, metrics: dict[str, Any],
                    turn_ids: list[int]) -> None:
        """Record an optimizer step and mark the samples it used consumed, atomically. Raises if the lease was
        lost (expired and re-leased), so the caller knows the step's samples are not exclusively its own."""
        now = time.time()
        with self._tx() as db:
            for tid in turn_ids:
                cur = db.execute(
                    "UPDATE samples SET state=?, consumed_step=?, lease_id='' WHERE turn_id=? AND lease_id=? "
                    "AND state=?", (TurnState.CONSUMED, step, tid, lease_id, TurnState.LEASED))
                if cur.rowcount != 1:
                    raise RuntimeError(f"sample {tid} is no longer held by lease {lease_id}")
                db.execute("UPDATE turns SET state=?, updated_at=? WHERE id=?", (TurnState.CONSUMED, now, tid))
            db.execute("INSERT INTO steps (step, created_at, policy_version, metrics, turn_ids) VALUES (?,?,?,?,?)",
                       (step, now, policy_version, json.dumps(metrics), json.dumps(turn_ids)))
            # Anything else still under this lease (dropped samples were already moved) goes back to ready.
            rest = [r["turn_id"] for r in db.execute(
                "SELECT turn_id FROM samples WHERE lease_id=? AND state=?", (lease_id, TurnState.LEASED))]
            self._back_to_ready(db, rest)

    def requeue_after_step(self, step: int) -> int:
        """Resume support: samples consumed by steps after ``step`` (whose weights were lost) become ready
        again. Those steps keep their rows in ``steps`` (step numbers are never reused: the resumed trainer goes
        on after the last recorded step) and are marked requeued by a copy in ``requeued_steps`` with the time
        of the requeue; a ``requeue`` event records it. Nothing is deleted."""
        now = time.time()
        with self._tx() as db:
            ids = [r["turn_id"] for r in db.execute(
                "SELECT turn_id FROM samples WHERE state=? AND consumed_step > ?", (TurnState.CONSUMED, step))]
            for tid in ids:
                db.execute("UPDATE samples SET state=?, consumed_step=NULL WHERE turn_id=?", (TurnState.READY, tid))
                db.execute("UPDATE turns SET state=? WHERE id=?", (TurnState.READY, tid))
            not_yet_requeued = (" FROM steps s WHERE s.step > ? AND NOT EXISTS (SELECT 1 FROM requeued_steps r"
                                " WHERE r.step = s.step AND r.created_at = s.created_at)")
            lost = [r["step"] for r in db.execute("SELECT s.step" + not_yet_requeued + " ORDER BY s.step", (step,))]
            db.execute("INSERT INTO requeued_steps (step, created_at, policy_version, metrics, turn_ids, requeued_at,"
                       " resumed_from_step) SELECT s.step, s.created_at, s.policy_version, s.metrics, s.turn_ids, ?, ?"
                       + not_yet_requeued, (now, step, step))
            if ids or lost:
                db.execute("INSERT INTO events (created_at, kind, step, version, detail) VALUES (?,?,?,?,?)",
                           (now, "requeue", step, None, json.dumps({"steps": lost, "turn_ids": ids})))
        return len(ids)

    def requeued_steps(self) -> list[dict[str, Any]]:
        """Steps whose weights were lost in a crash and whose samples were trained again after a resume (a copy
        made at the requeue; stores written before step rows were kept have them only here)."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM requeued_steps ORDER BY id").fetchall()
        return [{"step": r["step"], "created_at": r["created_at"], "policy_version": r["policy_version"],
                 "metrics": json.loads(r["metrics"]), "turn_ids": json.loads(r["turn_ids"]),
                 "requeued_at": r["requeued_at"], "resumed_from_step": r["resumed_from_step"]} for r in rows]

    # ---- versions and events ------------------------------------------------------------------------------
    def next_version(self, at_least: int = 0) -> int:
        """A version number never used before in this run: above every version recorded anywhere (versions,
        steps, requeued steps, served turns) and above ``at_least - 1``."""
        with self._lock:
            row = self._db.execute(
                "SELECT MAX(v) FROM (SELECT MAX(version) AS v FROM versions UNION ALL SELECT MAX(policy_version) "
                "FROM steps UNION ALL SELECT MAX(policy_version) FROM requeued_steps UNION ALL "
                "SELECT MAX(policy_version) FROM turns)").fetchone()
        return max(int(row[0] or 0) + 1, int(at_least))

    def record_version(self, version: int, step: int, status: str, evidence: dict[str, Any]) -> None:
        """Record a version (raises if the number was recorded before: a number names one set of weights)."""
        with self._tx() as db:
            db.execute("INSERT INTO versions (version, step, created_at, status, evidence) VALUES (?,?,?,?,?)",
                       (int(version), int(step), time.time(), status, json.dumps(evidence, default=str)))

    def _mark_uncommitted_versions(self, db: sqlite3.Connection) -> list[int]:
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
        db.execute("INSERT INTO events (created_at, kind, step, version, detail) VALUES (?,?,?,?,?)",
                   (time.time(), "uncommitted", last, None,
                    json.dumps({"versions": [v for v, _ in lost], "steps": [s for _, s in lost],
                                "last_committed_step": last})))
        return [v for v, _ in lost]

    def version_status(self, version: int) -> str | None:
        """The recorded status of ``version`` (None: not recorded, e.g. version 0, the starting weights)."""
        with self._lock:
            row = self._db.execute("SELECT status FROM versions WHERE version=?", (int(version),)).fetchone()
        return None if row is None else row["status"]

    def archive_versions(self, detail: dict[str, Any]) -> list[int]:
        """A fresh start moved the version folders away: the accepted versions become ``archived`` (no longer
        served or rolled back to; their rows and evidence stay) and a ``fresh_start`` event records ``detail``.
        Returns them."""
        with self._tx() as db:
            archived = [r["version"] for r in db.execute(
                "SELECT version FROM versions WHERE status='accepted' ORDER BY version")]
            db.execute("UPDATE versions SET status='archived' WHERE status='accepted'")
            db.execute("INSERT INTO events (created_at, kind, step, version, detail) VALUES (?,?,?,?,?)",
                       (time.time(), "fresh_start", None, None,
                        json.dumps({"archived_versions": archived, **detail}, default=str)))
        return archived

    def versions(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM versions ORDER BY version").fetchall()
        return [{"version": r["version"], "step": r["step"], "created_at": r["created_at"], "status": r["status"],
                 "evidence": json.loads(r["evidence"])} for r in rows]

    def record_event(self, kind: str, detail: dict[str, Any], step: int | None = None,
                     version: int | None = None) -> None:
        """An event of the run's weights (gate decision, rollback, requeue) with its evidence."""
        with self._tx() as db:
            db.execute("INSERT INTO events (created_at, kind, step, version, detail) VALUES (?,?,?,?,?)",
                       (time.time(), kind, step, version, json.dumps(detail, default=str)))

    def record_rollback(self, to_version: int, from_version: int, detail: dict[str, Any]) -> list[int]:
        """Mark the accepted versions after ``to_version`` rolled back and record the rollback. Returns them."""
        with self._tx() as db:
            later = [r["version"] for r in db.execute(
                "SELECT version FROM versions WHERE version > ? AND status='accepted' ORDER BY version",
                (int(to_version),))]
            db.execute("UPDATE versions SET status='rolled_back' WHERE version > ? AND status='accepted'",
                       (int(to_version),))
            db.execute("INSERT INTO events (created_at, kind, step, version, detail) VALUES (?,?,?,?,?)",
                       (time.time(), "rollback", None, int(to_version),
                        json.dumps({"from_version": from_version, "rolled_back": later, **detail}, default=str)))
        return later

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            if kind is None:
                rows = self._db.execute("SELECT * FROM events ORDER BY id").fetchall()
            else:
                rows = self._db.execute("SELECT * FROM events WHERE kind=? ORDER BY id", (kind,)).fetchall()
        return [{"id": r["id"], "created_at": r["created_at"], "kind": r["kind"], "step": r["step"],
                 "version": r["version"], "detail": json.loads(r["detail"])} for r in rows]

    def recent_prompts(self, n: int, *, scan: int = 200) -> list[tuple[int, list[int], list[dict[str, Any]]]]:
        """The ``n`` most recent distinct prompts, newest first: ``(turn id, prompt ids, request messages)``. A prompt
        equal to a newer one (a retried request, the same question asked again) is skipped; at most the ``scan``
        newest turns are read."""
        if n <= 0:
            return []
        with self._lock:
            rows = self._db.execute("SELECT id, prompt_ids FROM turns ORDER BY id DESC LIMIT ?",
                                    (max(int(n), int(scan)),)).fetchall()
            kept: list[Any] = []
            seen: set[bytes] = set()
            for r in rows:
                if bytes(r["prompt_ids"]) not in seen:
                    seen.add(bytes(r["prompt_ids"]))
                    kept.append(r)
                    if len(kept) == n:
                        break
            messages = {r["id"]: json.loads(r["messages"]) for r in self._db.execute(
                f"SELECT id, messages FROM turns WHERE id IN ({','.join('?' * len(kept))})",
                [r["id"] for r in kept])} if kept else {}
        return [(r["id"], _ids_from(r["prompt_ids"]), messages[r["id"]]) for r in kept]

    def samples(self, state: str | None = None) -> list[SampleRecord]:
        with self._lock:
            if state is None:
                rows = self._db.execute("SELECT * FROM samples ORDER BY turn_id").fetchall()
            else:
                rows = self._db.execute("SELECT * FROM samples WHERE state=? ORDER BY turn_id",
                                        (str(state),)).fetchall()
        return [self._sample_from_row(r) for r in rows]

    def count_samples(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT state, COUNT(*) AS n FROM samples GROUP BY state").fetchall()
        return {r["state"]: r["n"] for r in rows}

    # ---- steps -----------------------------------------------------------------------------------------
    def last_step(self) -> tuple[int, dict[str, Any]] | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM steps ORDER BY step DESC LIMIT 1").fetchone()
        return None if row is None else (row["step"], json.loads(row["metrics"]))

    def steps(self, *, in_weights_only: bool = False) -> list[dict[str, Any]]:
        """Every recorded step in order. ``requeued`` is True for a step whose weights were lost in a crash (its
        samples were trained again by a later step after a resume); ``in_weights_only`` leaves those out."""
        with self._lock:
            rows = self._db.execute(
                "SELECT s.*, EXISTS (SELECT 1 FROM requeued_steps r WHERE r.step = s.step AND r.created_at = "
                "s.created_at) AS requeued FROM steps s ORDER BY s.step").fetchall()
        return [{"step": r["step"], "created_at": r["created_at"], "policy_version": r["policy_version"],
                 "metrics": json.loads(r["metrics"]), "turn_ids": json.loads(r["turn_ids"]),
                 "requeued": bool(r["requeued"])} for r in rows if not (in_weights_only and r["requeued"])]

    # ---- export ----------------------------------------------------------------------------------------
    def iter_export(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(file name, record) pairs for every turn (with its votes and sample summary) and every step."""
        for turn in self.turns():
            rec = asdict(turn)
            rec["votes"] = [asdict(v) for v in self.votes(turn.id)]
            yield "turns.jsonl", rec
        for s in self.samples():
            rec = asdict(s)
            rec["targets"] = None if s.targets is None else {k: list(v.shape) for k, v in s.targets.items()}
            yield "samples.jsonl", rec
        for st in self.steps():
            yield "steps.jsonl", st
        for st in self.requeued_steps():
            yield "requeued_steps.jsonl", st
        for v in self.versions():
            yield "versions.jsonl", v
        for e in self.events():
            yield "events.jsonl", e

    def export_jsonl(self, out_dir: str | Path) -> dict[str, int]:
        """Append every record to JSONL files in ``out_dir`` (never truncates). Returns lines written per file."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        counts: dict[str, int] = {}
        handles: dict[str, Any] = {}
        try:
            for name, rec in self.iter_export():
                if name not in handles:
                    handles[name] = open(out / name, "a", encoding="utf-8")
                handles[name].write(json.dumps(rec, ensure_ascii=False, default=str) + "\n")
                counts[name] = counts.get(name, 0) + 1
        finally:
            for h in handles.values():
                h.close()
        return counts
