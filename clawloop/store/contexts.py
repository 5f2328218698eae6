"""Context samples: the teacher's own answers to a hinted turn, stored as turns and samples of their own.

A context sample (docs/context-distillation.md) is trained like any sample: leased, committed with a step,
requeued on resume. The store's samples are keyed by their turn, so each context answer is written as a turn of
its own (the judged turn's session, owner, request and un-hinted prompt ids, the teacher's sampled ids as its
response) with a sample of kind ``CONTEXT_KIND``. It is born ``ready``: nobody judges it.

``context_turns`` links each such turn to the judged turn it came from and its index among that turn's context
answers; the pair is unique, so the same context answer can never be stored twice. They are written in the
transaction that writes the judged turn's own sample (``Samples.put_sample``), which only a turn still being
judged can take: a crash before it leaves nothing behind (the turn is judged and its context answers sampled
again), a crash after it leaves everything, and a retry finds the turn no longer judging.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from typing import Any

from clawloop.store.database import Database
from clawloop.store.records import ID_BYTES, SampleRecord, TurnRecord, TurnState, floats_blob, ids_blob

CONTEXT_KIND = "context"
"""``SampleRecord.kind`` (and ``TurnRecord.sample_kind``) of a context sample."""


@dataclass
class ContextSample:
    """One context answer ready to store: its turn (the judged turn's request, the teacher's response) and its
    sample. ``index`` numbers the answers of one judged turn from 0."""

    index: int
    turn: TurnRecord
    sample: SampleRecord


def insert_context(db: sqlite3.Connection, source_turn_id: int, context: ContextSample, now: float) -> int | None:
    """Write one context answer's turn, sample and link in the caller's transaction. Returns the new turn id, or
    None (and writes nothing) when this (judged turn, index) is stored already."""
    seen = db.execute("SELECT 1 FROM context_turns WHERE source_turn_id=? AND context_index=?",
                      (source_turn_id, context.index)).fetchone()
    if seen is not None:
        return None
    turn, sample = context.turn, context.sample
    cur = db.execute(
        "INSERT INTO turns (session_id, owner, turn_index, state, reason, created_at, updated_at, messages,"
        " tools, prompt_ids, response_ids, logprobs, temperature, top_p, policy_version, response_text,"
        " assistant_message, finish_reason, next_state) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (turn.session_id, turn.owner, turn.turn_index, str(TurnState.READY), "", now, now,
         json.dumps(turn.messages, ensure_ascii=False),
         None if turn.tools is None else json.dumps(turn.tools, ensure_ascii=False),
         ids_blob(turn.prompt_ids), ids_blob(turn.response_ids), floats_blob(turn.logprobs),
         turn.temperature, turn.top_p, turn.policy_version, turn.response_text,
         json.dumps(turn.assistant_message, ensure_ascii=False), turn.finish_reason, None))
    turn_id = int(cur.lastrowid)
    db.execute("INSERT INTO context_turns (turn_id, source_turn_id, context_index, created_at) VALUES (?,?,?,?)",
               (turn_id, source_turn_id, context.index, now))
    info = {**sample.info, "context_of": source_turn_id, "context_index": context.index}
    db.execute(
        "INSERT INTO samples (turn_id, state, reward, kind, hints, targets, teacher_version, info, created_at)"
        " VALUES (?,?,?,?,?,?,?,?,?)",
        (turn_id, TurnState.READY, sample.reward, CONTEXT_KIND, json.dumps(sample.hints, ensure_ascii=False),
         None, sample.teacher_version, json.dumps(info, ensure_ascii=False), now))
    turn.id, turn.state, turn.updated_at = turn_id, TurnState.READY, now
    sample.turn_id, sample.kind, sample.info, sample.created_at = turn_id, CONTEXT_KIND, info, now
    return turn_id


class Contexts:
    """The context-sample reads of ``Store`` (the writes ride with ``Samples.put_sample``)."""

    db: Database

    def context_turn_ids(self, source_turn_id: int) -> list[int]:
        """The turn ids of a judged turn's context answers, by index."""
        with self.db.read() as db:
            rows = db.execute("SELECT turn_id FROM context_turns WHERE source_turn_id=? ORDER BY context_index",
                              (int(source_turn_id),)).fetchall()
        return [int(r["turn_id"]) for r in rows]

    def context_source(self, turn_id: int) -> int | None:
        """The judged turn a context answer came from (None: ``turn_id`` is a served turn)."""
        with self.db.read() as db:
            row = db.execute("SELECT source_turn_id FROM context_turns WHERE turn_id=?", (int(turn_id),)).fetchone()
        return None if row is None else int(row["source_turn_id"])

    def count_samples_by_kind(self) -> dict[str, dict[str, int]]:
        """Samples by kind, then by state: ``{"rl": {"ready": 3, ...}, "context": {...}}``."""
        with self.db.read() as db:
            rows = db.execute("SELECT kind, state, COUNT(*) AS n FROM samples GROUP BY kind, state").fetchall()
        out: dict[str, dict[str, int]] = {}
        for r in rows:
            out.setdefault(r["kind"], {})[r["state"]] = int(r["n"])
        return out

    def context_turn_activity(self, since: float) -> dict[str, Any]:
        """Context turns stored since ``since`` (epoch seconds) and their response tokens: the part of
        ``turn_activity`` that was not served to anyone."""
        with self.db.read() as db:
            row = db.execute("SELECT COUNT(*) AS n, SUM(LENGTH(t.response_ids)) AS b FROM context_turns c"
                             " JOIN turns t ON t.id = c.turn_id WHERE t.created_at >= ?", (float(since),)).fetchone()
        return {"turns": int(row["n"] or 0), "response_tokens": int(row["b"] or 0) // ID_BYTES}
