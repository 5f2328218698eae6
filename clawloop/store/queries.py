"""Read-only questions about the run, for the dashboard, ``/v1/status``, the trainer's wait and the gate's
probes: counts by state, drop reasons, vote statistics, session summaries, recent prompts, the samples. Nothing
here writes."""

from __future__ import annotations

import json
from typing import Any

from clawloop.store.contexts import CONTEXT_KIND
from clawloop.store.database import Database, owned_samples
from clawloop.store.records import ID_BYTES, SampleRecord, TurnState, ids_from
from clawloop.store.samples import sample_from_row


class Queries:
    """The read-only half of ``Store`` (see the module docstring)."""

    db: Database

    def count_turns(self, owner: str | None = None, *, served_only: bool = False) -> dict[str, int]:
        """Turns by state; only ``owner``'s when given; with ``served_only``, not the context samples' turns (the
        teacher's own answers, stored as turns nobody was served)."""
        conditions = (["owner=?"] if owner is not None else []) + (
            ["NOT EXISTS (SELECT 1 FROM samples s WHERE s.turn_id = turns.id AND s.kind = ?)"] if served_only else [])
        where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
        args = ((owner,) if owner is not None else ()) + ((CONTEXT_KIND,) if served_only else ())
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
        """The most recently active sessions, newest first: whose (``owner``), turn count, time span and turns by
        state. A session is its owner's: two users who both name theirs ``main`` have two sessions, as serving
        keeps them apart."""
        with self.db.read() as db:
            rows = db.execute(
                "SELECT session_id, owner, COUNT(*) AS turns, MIN(created_at) AS started_at, MAX(updated_at) AS "
                "updated_at, MAX(id) AS last_turn_id, GROUP_CONCAT(state) AS states FROM turns GROUP BY owner, "
                "session_id ORDER BY last_turn_id DESC LIMIT ?", (int(limit),)).fetchall()
        out = []
        for r in rows:
            states: dict[str, int] = {}
            for s in (r["states"] or "").split(","):
                states[s] = states.get(s, 0) + 1
            out.append({"session_id": r["session_id"], "owner": r["owner"], "turns": r["turns"],
                        "started_at": r["started_at"], "updated_at": r["updated_at"],
                        "last_turn_id": r["last_turn_id"], "states": states})
        return out

    def turn_activity(self, since: float) -> dict[str, float]:
        """Turns stored since ``since`` (epoch seconds) and their response tokens."""
        with self.db.read() as db:
            row = db.execute("SELECT COUNT(*) AS n, SUM(LENGTH(response_ids)) AS b FROM turns WHERE created_at"
                             " >= ?", (float(since),)).fetchone()
        return {"turns": int(row["n"] or 0), "response_tokens": int(row["b"] or 0) // ID_BYTES}

    def recent_prompts(self, n: int, *, corrected: bool = False, scan: int = 200,
                       owner: str | None = None) -> list[tuple[int, list[int], list[dict[str, Any]]]]:
        """Up to ``n`` distinct recent prompts, spread across users and sessions: ``(turn id, prompt ids, request
        messages)``.

        The rule (``spread_prompts``): the ``scan`` newest turns of each of the ``n`` most recently active owners
        are read (newest first; per owner, so that one owner's flood of requests cannot push the others out of
        what is read) and a prompt equal to a newer one (a retried request, the same question asked again) is
        skipped. The rest are grouped by owner (the
        API key's name) and, within an owner, by session. Owners take turns, the owner with the newest turn first;
        each turn of an owner takes that owner's next session in the same way (sessions by their newest turn, a
        session's prompts newest first), so one user or one session cannot fill the slots while others have
        prompts: with 20 prompts from one owner and one each from two others, all three owners are among 3 slots.

        ``corrected``: only the run's corrected prompts, the turns whose answer got a hint or a -1 vote and whose
        sample was trained into weights the gate accepted (consumed by a step that an accepted version includes and
        no gate rejection undid), read the same way; the gate re-asks them to keep earlier fixes fixed.

        ``owner`` (per-user policies): only that owner's turns, and for ``corrected`` only what that owner's own
        accepted versions hold, so no other user's prompts check (or steer) a user's adapter."""
        if n <= 0:
            return []
        mine = owner is not None
        where = ("JOIN samples s ON s.turn_id = t.id WHERE (s.hints != '[]' OR s.reward < 0)"
                 " AND s.consumed_step IS NOT NULL"
                 " AND EXISTS (SELECT 1 FROM versions v WHERE v.status = 'accepted' AND v.step >= s.consumed_step"
                 + (" AND v.owner = t.owner" if mine else "") + ")"
                 " AND NOT EXISTS (SELECT 1 FROM events e, json_each(e.detail, '$.steps') j"
                 " WHERE e.kind = 'gate_rejected' AND j.value = s.consumed_step)") if corrected else ""
        if mine:
            where += (" AND" if where else " WHERE") + " t.owner = ?"
        one_owner = where + (" AND" if where else " WHERE") + " t.owner = ?"
        owned = (owner,) if mine else ()
        with self.db.read() as db:
            # The most recently active owners, then each one's newest turns (the (owner, id) index reads them
            # without going through every turn of the run).
            active = [r[0] for r in db.execute(f"SELECT t.owner FROM turns t {where} GROUP BY t.owner"
                                               f" ORDER BY MAX(t.id) DESC LIMIT ?", owned + (int(n),))]
            rows = sorted((r for who in active for r in db.execute(
                f"SELECT t.id AS id, t.owner AS owner, t.session_id AS session_id, t.prompt_ids AS prompt_ids"
                f" FROM turns t {one_owner} ORDER BY t.id DESC LIMIT ?",
                owned + (who, max(int(n), int(scan)))).fetchall()), key=lambda r: -r["id"])
            distinct: list[Any] = []
            seen: set[bytes] = set()
            for r in rows:
                if bytes(r["prompt_ids"]) not in seen:
                    seen.add(bytes(r["prompt_ids"]))
                    distinct.append(r)
            kept = spread_prompts(distinct, n)
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

    def ready_count(self, *, owner: str | None = None) -> int:
        """Samples ready to train (only ``owner``'s when given)."""
        where, args = owned_samples(owner)
        with self.db.read() as db:
            return db.execute(f"SELECT COUNT(*) FROM samples WHERE state=?{where}",
                              (TurnState.READY, *args)).fetchone()[0]

    def oldest_ready_at(self, *, owner: str | None = None) -> float | None:
        """When the oldest ready sample (only ``owner``'s when given) was written (epoch seconds); None when none
        is ready."""
        where, args = owned_samples(owner)
        with self.db.read() as db:
            row = db.execute(f"SELECT MIN(created_at) FROM samples WHERE state=?{where}",
                             (TurnState.READY, *args)).fetchone()
        return None if row[0] is None else float(row[0])

    def ready_by_owner(self) -> dict[str, tuple[int, float]]:
        """Per owner with ready samples: how many, and when the oldest was written (per-user policies' scheduling)."""
        with self.db.read() as db:
            rows = db.execute("SELECT t.owner AS owner, COUNT(*) AS n, MIN(s.created_at) AS oldest FROM samples s"
                              " JOIN turns t ON t.id = s.turn_id WHERE s.state=? GROUP BY t.owner",
                              (TurnState.READY,)).fetchall()
        return {r["owner"]: (int(r["n"]), float(r["oldest"])) for r in rows}

    def latest_sample_id(self) -> int | None:
        """The turn id of the newest sample with teacher targets, else of the newest sample (None: no sample)."""
        with self.db.read() as db:
            row = db.execute("SELECT turn_id FROM samples ORDER BY targets IS NOT NULL DESC, turn_id DESC"
                             " LIMIT 1").fetchone()
        return None if row is None else int(row["turn_id"])


def _round_robin(groups: list[list[Any]]) -> list[Any]:
    """The groups' items interleaved: the first of each group in order, then the second of each, and so on."""
    out: list[Any] = []
    for i in range(max((len(g) for g in groups), default=0)):
        out.extend(g[i] for g in groups if i < len(g))
    return out


def spread_prompts(rows_newest_first: list[Any], n: int) -> list[Any]:
    """The first ``n`` of ``rows_newest_first`` (each with ``owner`` and ``session_id``) taken round-robin over
    owners, each owner's rows round-robin over its sessions; owners and sessions ordered by their newest row,
    rows within a session newest first (``Queries.recent_prompts``)."""
    owners: dict[str, dict[str, list[Any]]] = {}
    for r in rows_newest_first:  # dicts keep insertion order: the first seen is the newest
        owners.setdefault(r["owner"], {}).setdefault(r["session_id"], []).append(r)
    return _round_robin([_round_robin(list(sessions.values())) for sessions in owners.values()])[:max(n, 0)]
