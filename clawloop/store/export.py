"""Export: every record of the run appended to JSONL files (never truncated: an export adds to what is there)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from clawloop.store.records import SampleRecord, TurnRecord, VoteRecord


class Exportable(Protocol):
    """The reads an export is made of (``Store`` has them)."""

    def turns(self) -> list[TurnRecord]: ...

    def votes(self, turn_id: int) -> list[VoteRecord]: ...

    def samples(self) -> list[SampleRecord]: ...

    def steps(self) -> list[dict[str, Any]]: ...

    def requeued_steps(self) -> list[dict[str, Any]]: ...

    def versions(self) -> list[dict[str, Any]]: ...

    def events(self) -> list[dict[str, Any]]: ...


def iter_export(store: Exportable) -> Iterator[tuple[str, dict[str, Any]]]:
    """(file name, record) pairs for every turn (with its votes and sample summary) and every step."""
    for turn in store.turns():
        rec = asdict(turn)
        rec["votes"] = [asdict(v) for v in store.votes(int(turn.id or 0))]
        yield "turns.jsonl", rec
    for s in store.samples():
        rec = asdict(s)
        rec["targets"] = None if s.targets is None else {k: list(v.shape) for k, v in s.targets.items()}
        yield "samples.jsonl", rec
    for st in store.steps():
        yield "steps.jsonl", st
    for st in store.requeued_steps():
        yield "requeued_steps.jsonl", st
    for v in store.versions():
        yield "versions.jsonl", v
    for e in store.events():
        yield "events.jsonl", e


def export_jsonl(store: Exportable, out_dir: str | Path) -> dict[str, int]:
    """Append every record to JSONL files in ``out_dir`` (never truncates). Returns lines written per file."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    handles: dict[str, Any] = {}
    try:
        for name, rec in iter_export(store):
            if name not in handles:
                handles[name] = open(out / name, "a", encoding="utf-8")
            handles[name].write(json.dumps(rec, ensure_ascii=False, default=str) + "\n")
            counts[name] = counts.get(name, 0) + 1
    finally:
        for h in handles.values():
            h.close()
    return counts
