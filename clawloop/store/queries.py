"""Read-only questions about the run, for the dashboard, ``/v1/status``, the trainer's wait and the gate's
probes: counts by state, drop reasons, vote statistics, session summaries, recent prompts, the samples. Nothing
here writes."""

from __future__ import annotations

import json
from typing import Any

from clawloop.store.database import Database
from clawloop.store.records import ID_BYTES, SampleRecord, TurnState, ids_from
from clawloop.store.samples import sample_from_row


class Queries:
    """The read-only half of ``Store`` (see the module docstring)."""

    db: Database

    def count_turns(self, owner: str | None = None) -> dict[str, int]:
        """Turns by state; only ``owner``'s when given."""
        where, args = ("WHERE owner=?", (owner,)) if owner is not None else ("", ())
        with self.db.read() as db:
            rows = db.execute(f"SELECT state, COUNT(*) AS n FROM turns {where} GROUP BY state", args).fetchall()
        return {r["state"]: r["n"] for r in rows}

    def drop_reasons(self, owner: str | None = None) -> dict[str, int]:
        """Dropped turns by reason; only ``owner``'s when given."""
        where, args = (" AND owner=?", (owner,)) if owner is not None else ("", ())
        with self.db.read() as db:
            rows = db.execute(f"SELECT reason, COUNT(*) AS n FROM turns WHERE state=?{where} GROUP BY reason",
                              (TurnState.DROPPED, *args)).fetchall()
        return {r["reason"]: r["n"] for r in rows}

    def vote_stats(self, top_errors: int = 3) -> dict[str, Any]:
        """Judge votes recorded: how many, how many were invalid (no score), and the commonest errors."""
        with self.db.read() as db:
            row = db.execute("SELECT COUNT(*) AS n, SUM(score IS NULL) AS bad FROM votes").fetchone()
            errors = db.execute(
                "SELECT substr(error, 1, 120) AS e, COUNT(*) AS n FROM votes WHERE score IS NULL AND error != '' "
                "GROUP BY e ORDER BY n DESC LIMIT ?", (int(top_errors),)).fetchall()
        total, invalid = int(row["n"] or 0), int(row["bad"] or 0)
        return {"votes": total, "invalid": invalid, "invalid_rate": round(invalid / total, 4) if total else None,
                "top_errors": {r["e"]: r["n"] for r in errors}}

    def session_summaries(self, limit: int = 200) -> list[dict[str, Any]]:
        """The most recently active sessions, newest first: turn count, time span and turns by state."""
        with self.db.read() as db:
            rows = db.execute(
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
        with self.db.read() as db:
            row = db.execute("SELECT COUNT(*) AS n, SUM(LENGTH(response_ids)) AS b FROM turns WHERE created_at"
                             " >= ?", (float(since),)).fetchone()
        return {"turns": int(row["n"] or 0), "response_tokens": int(row["b"] or 0) // ID_BYTES}

    def recent_prompts(self, n: int, *, scan: int = 200) -> list[tuple[int, list[int], list[dict[str, Any]]]]:
        """The ``n`` most recent distinct prompts, newest first: ``(turn id, prompt ids, request messages)``. A prompt
        equal to a newer one (a retried request, the same question asked again) is skipped; at most the ``scan``
        newest turns are read."""
        if n <= 0:
            return []
        with self.db.read() as db:
            rows = db.execute("SELECT id, prompt_ids FROM turns ORDER BY id DESC LIMIT ?",
                              (max(int(n), int(scan)),)).fetchall()
            kept: list[Any] = []
            seen: set[bytes] = set()
            for r in rows:
                if bytes(r["prompt_ids"]) not in seen:
                    seen.add(bytes(r["prompt_ids"]))
                    kept.append(r)
                    if len(kept) == n:
                        break
            messages = {r["id"]: json.loads(r["messages"]) for r in db.execute(
                f"SELECT id, messages FROM turns WHERE id IN ({','.join('?' * len(kept))})",
                [r["id"] for r in kept])} if kept else {}
        return [(r["id"], ids_from(r["prompt_ids"]), messages[r["id"]]) for r in kept]

    # ---- samples ---------------------------------------------------------------------------------------
    def samples(self, state: str | None = None) -> list[SampleRecord]:
        with self.db.read() as db:
            if state is None:
                rows = db.execute("SELECT * FROM samples ORDER BY turn_id").fetchall()
            else:
                rows = db.execute("SELECT * FROM samples WHERE state=? ORDER BY turn_id", (str(state),)).fetchall()
        return [sample_from_row(r) for r in rows]

    def count_samples(self) -> dict[str, int]:
        with self.db.read() as db:
            rows = db.execute("SELECT state, COUNT(*) AS n FROM samples GROUP BY state").fetchall()
        return {r["state"]: r["n"] for r in rows}

    def ready_count(self) -> int:
        with self.db.read() as db:
            return db.execute("SELECT COUNT(*) FROM samples WHERE state=?", (TurnState.READY,)).fetchone()[0]

    def oldest_ready_at(self) -> float | None:
        """When the oldest ready sample was written (epoch seconds); None when none is ready."""
        with self.db.read() as db:
            row = db.execute("SELECT MIN(created_at) FROM samples WHERE state=?", (TurnState.READY,)).fetchone()
        return None if row[0] is None else float(row[0])

    def latest_sample_id(self) -> int | None:
        """The turn id of the newest sample with teacher targets, else of the newest sample (None: no sample)."""
        with self.db.read() as db:
            row = db.execute("SELECT turn_id FROM samples ORDER BY targets IS NOT NULL DESC, turn_id DESC"
                             " LIMIT 1").fetchone()
        return None if row is None else int(row["turn_id"])
