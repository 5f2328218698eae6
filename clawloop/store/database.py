"""The run's SQLite file: its schema, how it is opened (and brought up to date), and its transactions.

One connection per ``Database``, shared by the threads of the process under one lock; every write is one
``BEGIN IMMEDIATE`` transaction (``tx``), every read runs under the lock (``read``). WAL journal with
``synchronous=NORMAL``: a process crash (kill -9) loses nothing committed, only an OS crash can lose the last
commits.

Schema changes are only ever additions, made in place on open: new tables (``CREATE TABLE IF NOT EXISTS``), new
columns (``ADDED_COLUMNS``, old rows get the default) and data moves recorded in ``meta`` so they run once (stores
written before the sample kind had its own place kept it in ``turns.reason``; it is read from ``samples.kind``
and such a reason is cleared on open). A read-only handle (a dashboard beside the running server, or on a finished
run) changes nothing: tables an older file lacks read as empty.

Every writable handle holds a shared ``flock`` on a lock file beside the store (``<store>.lock``), released when
it is closed or its process dies (kill -9 included). It stops nothing ordinary; it lets an operation that must be
alone with the file (forgetting a user rewrites the whole file, ``exclusive``) find out that a server or another
writer has it open, and refuse, instead of racing them.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SCHEMA_VERSION = 1

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
CREATE TABLE IF NOT EXISTS context_turns (
    turn_id INTEGER PRIMARY KEY REFERENCES turns(id),
    source_turn_id INTEGER NOT NULL REFERENCES turns(id),
    context_index INTEGER NOT NULL,
    created_at REAL NOT NULL,
    UNIQUE (source_turn_id, context_index)
);
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

ADDED_COLUMNS = (("turns", "owner", "TEXT NOT NULL DEFAULT ''"), ("steps", "owner", "TEXT NOT NULL DEFAULT ''"),
                 ("versions", "owner", "TEXT NOT NULL DEFAULT ''"))
"""Columns newer than a store file may be; added in place on open (old rows get the default)."""



def owned_samples(owner: str | None) -> tuple[str, tuple[str, ...]]:
    """The ``AND ...`` clause and its arguments that keep a query on ``samples`` to one owner's (per-user
    policies); nothing for ``None``."""
    if owner is None:
        return "", ()
    return " AND turn_id IN (SELECT id FROM turns WHERE owner=?)", (owner,)


def owned_rows(owner: str | None) -> tuple[str, tuple[str, ...]]:
    """The same for a table with an ``owner`` column of its own (``steps``, ``versions``)."""
    if owner is None:
        return "", ()
    return " AND owner=?", (owner,)


KIND_OUT_OF_REASON = "sample_kind_out_of_turn_reason"
"""``meta`` key set once a store's ``turns.reason`` holds only drop reasons."""


STORE_FILENAME = "store.sqlite"


class StoreInUse(RuntimeError):
    """An operation that must be alone with the store found another writer."""


def lock_path(path: Path) -> Path:
    """The lock file beside store ``path`` that every writable handle holds shared."""
    return path.with_name(path.name + ".lock")


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


class Database:
    """The open SQLite file and the lock its connection is used under."""

    def __init__(self, path: str | Path, readonly: bool = False, busy_timeout_s: float = 30.0):
        """``busy_timeout_s``: how long a statement waits for another connection's write lock before SQLite
        raises ``OperationalError('database is locked')``."""
        self.path = Path(path)
        self.readonly = readonly
        self.lock = threading.RLock()
        self._lock_fd: int | None = None
        if readonly:
            # A reader beside the process that writes the run (or of a finished run): SQLite's read-only mode, no
            # schema or journal changes, and a lock of its own, so reads never queue behind the writer's lock.
            self.connection = sqlite3.connect(self.path.resolve().as_uri() + "?mode=ro", uri=True,
                                              check_same_thread=False, isolation_level=None, timeout=busy_timeout_s)
            self.connection.row_factory = sqlite3.Row
            self._stand_in_for_missing_tables()
            self._stand_in_for_missing_columns()
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(lock_path(self.path), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_SH)
            self.connection = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                                              timeout=busy_timeout_s)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self.connection.row_factory = sqlite3.Row
        self.connection.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode survives a process crash (kill -9); only an OS crash can lose the last commits.
        self.connection.execute("PRAGMA synchronous=NORMAL")
        self.connection.execute("PRAGMA foreign_keys=ON")
        self.connection.executescript(_SCHEMA)
        self._add_missing_columns()
        with self.tx() as db:
            row = db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif int(row["value"]) != SCHEMA_VERSION:
                raise RuntimeError(f"{self.path} has schema {row['value']}, this clawloop reads {SCHEMA_VERSION}")
            self._take_kind_out_of_reason(db)

    def _stand_in_for_missing_tables(self) -> None:
        """Read-only handle on a store older than this code: the tables it lacks read as empty (connection-local
        TEMP tables; the file is not touched)."""
        have = {r["name"] for r in self.connection.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        for statement in _SCHEMA.split(";"):
            head = statement.split("(", 1)[0].split()
            if head[:5] == ["CREATE", "TABLE", "IF", "NOT", "EXISTS"] and head[5] not in have:
                self.connection.execute(statement.replace("CREATE TABLE", "CREATE TEMP TABLE", 1))

    def _stand_in_for_missing_columns(self) -> None:
        """Read-only handle on a store written before a column of ``ADDED_COLUMNS`` existed: the table reads through
        a connection-local TEMP view that adds the column with its default (SQLite looks a name up in ``temp``
        before ``main``), so every query reads the old file as a writer would after adding the column."""
        for table, column, decl in ADDED_COLUMNS:
            have = {r["name"] for r in self.connection.execute(f"PRAGMA main.table_info({table})").fetchall()}
            if have and column not in have:
                default = decl.split(" DEFAULT ", 1)[1]
                self.connection.execute(f"CREATE TEMP VIEW {table} AS SELECT *, {default} AS {column} "
                                        f"FROM main.{table}")

    def _add_missing_columns(self) -> None:
        with self.tx() as db:
            for table, column, decl in ADDED_COLUMNS:
                have = {r["name"] for r in db.execute(f"PRAGMA table_info({table})").fetchall()}
                if column not in have:
                    db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
            # Made once the column exists (an older store gains it just above): a user's newest turns
            # (``recent_prompts``) are read through it without scanning every turn.
            db.execute("CREATE INDEX IF NOT EXISTS turns_owner ON turns(owner, id)")

    @staticmethod
    def _take_kind_out_of_reason(db: sqlite3.Connection) -> None:
        """Stores written before the sample kind had its own place copied it into ``turns.reason`` when the
        sample was written; the kind is read from ``samples.kind``, so such a copy is cleared (once). A dropped
        turn's reason is why it was dropped and stays."""
        if db.execute("SELECT 1 FROM meta WHERE key=?", (KIND_OUT_OF_REASON,)).fetchone() is not None:
            return
        db.execute("UPDATE turns SET reason='' WHERE state != 'dropped' AND reason != '' AND reason = "
                   "(SELECT kind FROM samples WHERE samples.turn_id = turns.id)")
        db.execute("INSERT INTO meta VALUES (?, '1')", (KIND_OUT_OF_REASON,))

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (``BEGIN IMMEDIATE``): committed when the block ends, rolled back when it raises."""
        with self.lock:
            db = self.connection
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                if db.in_transaction:  # SQLite may have rolled back already (e.g. on a full disk)
                    db.execute("ROLLBACK")
                raise
            try:
                db.execute("COMMIT")
            except sqlite3.Error:
                # A failed COMMIT (disk full) leaves the transaction open: roll it back so the next transaction
                # can begin once space returns, then report the failure.
                if db.in_transaction:
                    try:
                        db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                raise

    @contextmanager
    def read(self) -> Iterator[sqlite3.Connection]:
        """The connection, under the lock, for reads."""
        with self.lock:
            yield self.connection

    @contextmanager
    def exclusive(self, what: str) -> Iterator[None]:
        """This handle alone has the file open for writing while the block runs; ``StoreInUse`` (and nothing
        done) when another handle, in this process or another, has it open. ``what`` names the operation for
        the message."""
        if self._lock_fd is None:
            raise StoreInUse(f"{self.path} is open read-only; {what} needs it open for writing")
        with self.lock:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fcntl.flock(self._lock_fd, fcntl.LOCK_SH)  # a failed conversion may have dropped the shared lock
                raise StoreInUse(
                    f"{self.path} is open for writing elsewhere (a running server or trainer of this run?); stop "
                    f"it, then {what} again") from None
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_SH)

    def close(self) -> None:
        with self.lock:
            self.connection.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the shared lock
                self._lock_fd = None
