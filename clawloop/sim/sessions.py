"""What the simulated user received, session by session: the opening answer of each session, the version that
wrote it, and the two readings of a run built on them.

The first answer of a session answers the session's opening question before the user has asked for anything in
that session (no correction in its context), so it shows what the served policy does unprompted: the training-time
counterpart of a held-out question. Its version is the one the server reports in the response (the ``clawloop``
field's ``policy_version``, also sent as ``X-Policy-Version``), i.e. the weights that actually wrote it.

* ``sessions_to_stable_effect``: the 1-based index of the first session of the first run of ``STABLE_RUN``
  consecutive sessions whose first answer follows the preference (the persona's checker) and passes the
  degeneracy guard (with the topic rule where the persona uses it): the same test as the held-out score. ``None``
  when no such run happened.
* ``sessions_per_version`` / ``share_after_base``: how many sessions each version opened, and the share opened by
  a version newer than v0.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from clawloop.sim.driver import SimSession

STABLE_RUN = 3
"""Consecutive successful sessions that count as a stable effect: one or two can be luck of the sampling."""


def session_record(index: int, session: SimSession) -> dict[str, Any]:
    """The per-session facts the readings below use; ``index`` is 1-based."""
    first = session.turns[0]
    return {
        "index": index,
        "first_answer_version": first.policy_version,
        "first_satisfied": bool(first.satisfied),
        "first_sound": bool(first.sound),
        "answer_versions": [t.policy_version for t in session.turns],
    }


def first_answer_ok(record: Mapping[str, Any]) -> bool:
    """The session's first answer followed the preference and passed the guard. Records written before the two were
    kept apart hold only their conjunction, ``first_followed``."""
    if "first_satisfied" in record:
        return bool(record["first_satisfied"]) and bool(record["first_sound"])
    return bool(record.get("first_followed"))


def sessions_to_stable_effect(records: Iterable[Mapping[str, Any]], run: int = STABLE_RUN) -> int | None:
    """1-based index of the session that starts the first run of ``run`` consecutive good first answers."""
    streak_start = streak = 0
    for position, record in enumerate(records, start=1):
        if first_answer_ok(record):
            if streak == 0:
                streak_start = int(record.get("index", position))
            streak += 1
            if streak >= run:
                return streak_start
        else:
            streak = 0
    return None


def _version_key(version: Any) -> str:
    return "unknown" if version is None else f"v{version}"


def sessions_per_version(records: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Sessions per version that wrote their first answer, in version order (``unknown`` when not reported)."""
    counts: dict[Any, int] = {}
    for record in records:
        version = record.get("first_answer_version")
        counts[version] = counts.get(version, 0) + 1
    ordered = sorted(counts, key=lambda v: (v is None, v if v is not None else 0))
    return {_version_key(v): counts[v] for v in ordered}


def share_after_base(records: Iterable[Mapping[str, Any]]) -> float | None:
    """Share of the sessions whose first answer a version newer than v0 wrote (None without sessions)."""
    versions = [r.get("first_answer_version") for r in records]
    if not versions:
        return None
    return sum(1 for v in versions if v is not None and int(v) > 0) / len(versions)


def served_summary(records: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The three readings together, as a run's summary stores them."""
    return {
        "sessions_to_stable_effect": sessions_to_stable_effect(records),
        "stable_run": STABLE_RUN,
        "sessions_per_version": sessions_per_version(records),
        "share_after_v0": share_after_base(records),
    }
