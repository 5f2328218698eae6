"""The turn state machine and the judge's votes on each turn.

A turn is stored when it is served (``awaiting_next``), moves to ``judgeable`` with the messages that followed
its answer, to ``judging`` when a judge worker claims it, and is dropped (with its reason) when it cannot become a
sample. Every move is a compare-and-set in one transaction, so two workers never take the same turn. From
``ready`` on a turn is in its sample's state, which ``clawloop.store.samples`` moves.

A turn is read with its sample's kind (``TurnRecord.sample_kind``, from ``samples.kind``).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable
from typing import Any

from clawloop.store.database import Database
from clawloop.store.records import TurnRecord, TurnState, VoteRecord, floats_blob, floats_from, ids_blob, ids_from

TURN_SELECT = "SELECT t.*, COALESCE(s.kind, '') AS sample_kind FROM turns t LEFT JOIN samples s ON s.turn_id = t.id"
"""Turns with their sample's kind; add ``WHERE`` clauses on ``t``."""


def turn_from_row(row: sqlite3.Row) -> TurnRecord:
    keys = row.keys()
    return TurnRecord(
        id=row["id"], session_id=row["session_id"], owner=row["owner"] if "owner" in keys else "",
        turn_index=row["turn_index"],
        state=row["state"],
        reason=row["reason"], sample_kind=row["sample_kind"] if "sample_kind" in keys else "",
        created_at=row["created_at"], updated_at=row["updated_at"],
        messages=json.loads(row["messages"]), tools=json.loads(row["tools"]) if row["tools"] else None,
        prompt_ids=ids_from(row["prompt_ids"]), response_ids=ids_from(row["response_ids"]),
        logprobs=floats_from(row["logprobs"]), temperature=row["temperature"], top_p=row["top_p"],
        policy_version=row["policy_version"], response_text=row["response_text"],
        assistant_message=json.loads(row["assistant_message"]), finish_reason=row["finish_reason"],
        next_state=json.loads(row["next_state"]) if row["next_state"] else None,
    )


def judging_back_to_judgeable(db: sqlite3.Connection) -> int:
    """Crash repair, in the caller's transaction: turns a dead process was judging can be judged again."""
    return db.execute("UPDATE turns SET state=?, updated_at=? WHERE state=?",
                      (TurnState.JUDGEABLE, time.time(), TurnState.JUDGING)).rowcount


class Turns:
    """The turn and vote half of ``Store`` (see the module docstring)."""

    db: Database

    def add_turn(self, turn: TurnRecord) -> int:
        """Commit a served main turn (before its answer is returned). Returns its id."""
        now = time.time()
        with self.db.tx() as db:
            cur = db.execute(
                "INSERT INTO turns (session_id, owner, turn_index, state, reason, created_at, updated_at, messages,"
                " tools, prompt_ids, response_ids, logprobs, temperature, top_p, policy_version, response_text,"
                " assistant_message, finish_reason, next_state) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (turn.session_id, turn.owner, turn.turn_index, str(turn.state), turn.reason, turn.created_at, now,
                 json.dumps(turn.messages, ensure_ascii=False),
                 None if turn.tools is None else json.dumps(turn.tools, ensure_ascii=False),
                 ids_blob(turn.prompt_ids), ids_blob(turn.response_ids), floats_blob(turn.logprobs),
                 turn.temperature, turn.top_p, turn.policy_version, turn.response_text,
                 json.dumps(turn.assistant_message, ensure_ascii=False), turn.finish_reason,
                 None if turn.next_state is None else json.dumps(turn.next_state, ensure_ascii=False)),
            )
            turn.id = int(cur.lastrowid)
            turn.updated_at = now
        return turn.id

    def get_turn(self, turn_id: int) -> TurnRecord:
        with self.db.read() as db:
            row = db.execute(TURN_SELECT + " WHERE t.id=?", (turn_id,)).fetchone()
        if row is None:
            raise KeyError(f"no turn {turn_id}")
        return turn_from_row(row)

    def turns(self, state: str | None = None, session_id: str | None = None, limit: int = 1_000_000,
              after_id: int = 0, owner: str | None = None) -> list[TurnRecord]:
        """Stored turns in order, those in ``state``, of ``session_id`` or of ``owner`` only when given (a session
        id names a session only together with its owner: users choose their ids)."""
        query, args = TURN_SELECT + " WHERE t.id > ?", [after_id]
        if state is not None:
            query += " AND t.state=?"
            args.append(str(state))
        if session_id is not None:
            query += " AND t.session_id=?"
            args.append(session_id)
        if owner is not None:
            query += " AND t.owner=?"
            args.append(owner)
        query += " ORDER BY t.id LIMIT ?"
        args.append(limit)
        with self.db.read() as db:
            rows = db.execute(query, args).fetchall()
        return [turn_from_row(r) for r in rows]

    def set_next_state(self, turn_id: int, next_state: list[dict[str, Any]]) -> bool:
        """awaiting_next -> judgeable with the messages that followed the answer. False if not awaiting."""
        with self.db.tx() as db:
            cur = db.execute(
                "UPDATE turns SET next_state=?, state=?, updated_at=? WHERE id=? AND state=?",
                (json.dumps(next_state, ensure_ascii=False), TurnState.JUDGEABLE, time.time(), turn_id,
                 TurnState.AWAITING_NEXT))
            return cur.rowcount == 1

    def transition(self, turn_id: int, from_states: Iterable[str], to_state: str, reason: str | None = None) -> bool:
        """Compare-and-set a turn's state. Returns False (and changes nothing) if it is not in ``from_states``."""
        froms = [str(s) for s in from_states]
        marks = ",".join("?" * len(froms))
        with self.db.tx() as db:
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
        with self.db.tx() as db:
            rows = db.execute(TURN_SELECT + " WHERE t.state=? ORDER BY t.id LIMIT ?",
                              (TurnState.JUDGEABLE, limit)).fetchall()
            now = time.time()
            for r in rows:
                db.execute("UPDATE turns SET state=?, updated_at=? WHERE id=?", (TurnState.JUDGING, now, r["id"]))
        turns = [turn_from_row(r) for r in rows]
        for t in turns:
            t.state = TurnState.JUDGING
        return turns

    # ---- votes -----------------------------------------------------------------------------------------
    def add_votes(self, votes: Iterable[VoteRecord]) -> None:
        now = time.time()
        with self.db.tx() as db:
            db.executemany(
                "INSERT INTO votes (turn_id, kind, vote_index, attempt, score, hint, raw_text, error, latency_s,"
                " created_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                [(v.turn_id, v.kind, v.index, v.attempt, v.score, v.hint, v.raw_text, v.error, v.latency_s, now)
                 for v in votes])

    def votes(self, turn_id: int) -> list[VoteRecord]:
        with self.db.read() as db:
            rows = db.execute("SELECT * FROM votes WHERE turn_id=? ORDER BY id", (turn_id,)).fetchall()
        return [VoteRecord(turn_id=r["turn_id"], kind=r["kind"], index=r["vote_index"], attempt=r["attempt"],
                           score=r["score"], hint=r["hint"], raw_text=r["raw_text"], error=r["error"],
                           latency_s=r["latency_s"]) for r in rows]
