"""What the dashboard shows, as JSON-ready dicts read from a run: its store (opened read-only), its
``metrics.jsonl`` and the demo's evaluation files. Nothing here writes; docs/dashboard.md describes each view.

``RunView`` is built once per server. In ``clawloop serve`` it also gets a ``live`` callable returning what only
the running process knows (the served policy version, request latency, live sessions); ``clawloop dashboard
RUN_DIR`` has none and derives the version from the records.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from clawloop.losses import HINT_SELECTIONS, select_hints, topk_overlap
from clawloop.store import CONTEXT_KIND, SampleRecord, Store, TurnState, find_store
from clawloop.trainer.forget import RECEIPTS_DIR

MAX_TOKENS_SHOWN = 512
"""Longest response shown token by token (the rest is summarised)."""
TOPK_SHOWN = 8
"""Top-k entries listed per token on hover."""

TokenText = Callable[[int], str]
LiveInfo = Callable[[], dict[str, Any]]


def _finite(x: float | None) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every parseable line of a JSONL file (a line being written right now is skipped, not an error)."""
    if not path.is_file():
        return []
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


JUDGE_META = "judge_setup"
"""Store meta key under which the serving process keeps its judge set-up (JSON) from start-up on."""


def record_judge_setup(store: Store, judge: dict[str, Any]) -> None:
    """Keep the judge set-up in the run's store, so that the run's folder names its judge after the server is gone.
    Called by the serving process at start-up (the read model itself never writes)."""
    store.set_meta(JUDGE_META, json.dumps(judge, sort_keys=True))


def recorded_judge_setup(store: Store) -> dict[str, Any] | None:
    """The judge set-up the serving process recorded (None: a run recorded before it was kept)."""
    raw = store.get_meta(JUDGE_META)
    try:
        data = json.loads(raw) if raw else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


VIEW_META = "dashboard_settings"
"""Store meta key under which the serving process keeps what the dashboard reads a run with: the model (for its
tokenizer), ``hint_selection`` and ``adv_diff_clip``."""


def record_view_settings(store: Store, settings: dict[str, Any]) -> None:
    """Keep the settings a run's tokens and hints are shown with, so that ``clawloop dashboard RUN_DIR`` of a run
    that no demo summarised (``clawloop serve``, ``clawloop openclaw``) reads it as its server did."""
    store.set_meta(VIEW_META, json.dumps(settings, sort_keys=True))


def recorded_view_settings(store_path: str | Path) -> dict[str, Any]:
    """The settings ``record_view_settings`` kept ({} for a run recorded before they were, or no store)."""
    try:
        store = Store(store_path, readonly=True)
    except sqlite3.Error:
        return {}
    try:
        raw = store.get_meta(VIEW_META)
    finally:
        store.close()
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


# ---- which weights a step's update ended up in ----------------------------------------------------------------
def gate_decisions(versions: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every recorded decision about trained weights, ordered by the step it was taken at: a version (its steps
    are in it), a gate rejection that restored the last accepted weights (its steps were thrown away; one after
    which training went on from the rejected weights decides nothing) and a
    rollback (steps not yet published were thrown away). ``steps`` is the list the record names, when it names
    one (the trainer's gate events do)."""
    named = {e["version"]: e["detail"].get("steps") for e in events
             if e["kind"] == "gate_accepted" and isinstance(e["detail"], dict)}
    out = []
    for v in versions:
        if v["status"] != "uncommitted":  # its step never committed: it holds no step
            out.append({"kind": "version", "step": v["step"], "time": v["created_at"], "version": v["version"],
                        "version_status": v["status"], "steps": named.get(v["version"])})
    recorded = {v["version"] for v in versions}
    for e in events:
        detail = e["detail"] if isinstance(e["detail"], dict) else {}
        if e["kind"] == "gate_accepted" and e["step"] is not None and e["version"] not in recorded:
            out.append({"kind": "version", "step": e["step"], "time": e["created_at"], "version": e["version"],
                        "version_status": "accepted", "steps": detail.get("steps")})
        elif e["kind"] == "gate_rejected" and e["step"] is not None and not kept_training(detail):
            out.append({"kind": "rejected", "step": e["step"], "time": e["created_at"],
                        "restored_version": detail.get("restored_version", e["version"]), "steps": detail.get("steps")})
        elif e["kind"] == "rollback" and isinstance(detail.get("step"), int):
            out.append({"kind": "rollback", "step": detail["step"], "time": e["created_at"], "to_version": e["version"],
                        "steps": None})
    return sorted(out, key=lambda d: (d["step"], d["time"]))


def kept_training(detail: dict[str, Any]) -> bool:
    """Whether a gate rejection left training going on from the rejected weights (``gate_restore_after`` > 1):
    its steps are not thrown away, the next decision names them."""
    return "restored_version" in detail and detail["restored_version"] is None


def step_fates(steps: list[dict[str, Any]], versions: list[dict[str, Any]],
               events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """``policy_fates`` for each policy of the run: the shared one, and under per-user policies every user's own
    (their steps, versions and events carry their ``owner``), so a step only ever goes to its own policy's
    decisions."""
    def owner_of_event(e: dict[str, Any]) -> str:
        return str(e["detail"].get("owner", "")) if isinstance(e["detail"], dict) else ""

    fates: dict[int, dict[str, Any]] = {}
    for owner in {s.get("owner", "") for s in steps}:
        fates.update(policy_fates([s for s in steps if s.get("owner", "") == owner],
                                  [v for v in versions if v.get("owner", "") == owner],
                                  [e for e in events if owner_of_event(e) == owner]))
    return fates


def policy_fates(steps: list[dict[str, Any]], versions: list[dict[str, Any]],
                 events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Step number -> where its update went: ``in_version`` (with ``version`` and ``version_status``),
    ``rejected`` by the gate, ``discarded`` by a rollback, ``unchecked`` (the gate checks it later) or ``unknown``
    (a run recorded before versions were). A step belongs to the decision that names it, else to the first
    decision taken at or after it: the trainer checks, publishes or throws away all steps since the last one.
    Steps whose weights were lost in a crash (requeued: their samples trained again later) have none."""
    decisions = gate_decisions(versions, events)
    trained = [s for s in steps if not s.get("requeued")]
    numbers = {s["step"] for s in trained}
    fates: dict[int, dict[str, Any]] = {}
    for d in decisions:
        for n in d["steps"] or ():
            if n in numbers:
                fates.setdefault(n, fate_of_decision(d))
    for s in trained:
        if s["step"] in fates:
            continue
        later = next((d for d in decisions if d["step"] >= s["step"]), None)
        if later is not None:
            fates[s["step"]] = fate_of_decision(later)
        else:
            # Not checked yet, or rejected while training went on from it: the gate's next decision settles it.
            pending = "gate_due_in" in s["metrics"] or s["metrics"].get("gate_restored") == 0.0
            fates[s["step"]] = {"disposition": "unchecked" if pending else "unknown"}
    return fates


def fate_of_decision(d: dict[str, Any]) -> dict[str, Any]:
    if d["kind"] == "version":
        return {"disposition": "in_version", "version": d["version"], "version_status": d["version_status"]}
    if d["kind"] == "rejected":
        return {"disposition": "rejected", "restored_version": d["restored_version"], "gate_step": d["step"]}
    return {"disposition": "discarded", "rollback_to": d["to_version"]}


def trained_fate(step: int, where: dict[str, Any] | None) -> dict[str, Any]:
    """The fate of a sample consumed by ``step``, saying whether that step's update reached a version."""
    where = where or {"disposition": "unknown"}
    kind = where["disposition"]
    if kind == "in_version":
        status = where["version_status"]
        if status == "accepted":
            return {"fate": "trained", "step": step, "version": where["version"],
                    "text": f"trained at step {step}, published in v{where['version']}"}
        return {"fate": "withdrawn", "step": step, "version": where["version"],
                "text": f"trained at step {step}, in v{where['version']} ({status.replace('_', ' ')})"}
    if kind == "rejected":
        return {"fate": "rejected", "step": step,
                "text": f"trained at step {step}, rejected by the gate, not in any served version"}
    if kind == "discarded":
        return {"fate": "discarded", "step": step,
                "text": f"trained at step {step}, discarded by a rollback to v{where['rollback_to']}, "
                        "not in any served version"}
    if kind == "unchecked":
        return {"fate": "unchecked", "step": step,
                "text": f"trained at step {step}, waiting for the gate's next check (not served yet)"}
    return {"fate": "trained", "step": step, "text": f"trained at step {step}"}


def fate_of(turn_state: str, reason: str, sample: SampleRecord | None,
            fates: dict[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    """What became of a turn as a training sample, in one short phrase plus its parts. ``fates`` (from
    ``step_fates``) says where each step's update went."""
    if sample is not None and sample.consumed_step is not None:
        return trained_fate(sample.consumed_step, (fates or {}).get(sample.consumed_step))
    if turn_state == TurnState.DROPPED:
        return {"fate": "dropped", "reason": reason, "text": f"dropped: {reason or 'no reason recorded'}"}
    if sample is not None:
        return {"fate": "waiting", "text": f"sample {sample.state}, not trained yet"}
    return {"fate": "pending", "text": {
        TurnState.AWAITING_NEXT: "waiting for the next message",
        TurnState.JUDGEABLE: "waiting for the judge",
        TurnState.JUDGING: "being judged",
    }.get(turn_state, turn_state)}


def latency_summary(histogram: Any, route: str) -> dict[str, Any] | None:
    """Count, mean and bucket-bound p50/p95 of one route in a ``ServingMetrics`` latency histogram."""
    key = (("route", route),)
    counts = histogram.counts.get(key)
    if not counts or counts[-1] == 0:
        return None
    total = counts[-1]

    def quantile(q: float) -> float | None:
        for upper, c in zip(histogram.buckets, counts):
            if c >= q * total:
                return upper
        return None  # above the largest bucket

    return {"count": total, "mean_s": round(histogram.sums[key] / total, 4), "p50_le_s": quantile(0.5),
            "p95_le_s": quantile(0.95)}


class RunView:
    """Read model of one run (see the module docstring). Safe to call from several threads."""

    def __init__(self, run_dir: str | Path, *, store_path: str | Path | None = None,
                 token_text: TokenText | None = None, hint_selection: str = "sequence_optimal",
                 adv_diff_clip: float = 1.0, judge: dict[str, Any] | None = None, live: LiveInfo | None = None):
        if hint_selection not in HINT_SELECTIONS:
            raise ValueError(f"hint_selection must be one of {HINT_SELECTIONS}, got {hint_selection!r}")
        self.run_dir = Path(run_dir)
        self.store_path = Path(store_path) if store_path is not None else None
        self.token_text = token_text
        self.hint_selection = hint_selection
        self.adv_diff_clip = float(adv_diff_clip)
        self.judge = judge
        self.live = live

    # ---- plumbing ---------------------------------------------------------------------------------------
    def open_store(self) -> Store:
        """A read-only handle on the store for one view (closed after it: a stopped server keeps no file open, and
        a live run may create its store after the dashboard started)."""
        path = self.store_path if self.store_path is not None else find_store(self.run_dir)
        if not Path(path).exists():
            raise FileNotFoundError(f"{path} does not exist yet")
        return Store(path, readonly=True)

    def _read(self, fn: Callable[..., Any], *args: Any) -> Any:
        store = self.open_store()
        try:
            return fn(store, *args)
        finally:
            store.close()

    def overview(self) -> dict[str, Any]:
        return self._read(self._overview)

    def sessions(self, limit: int = 200) -> dict[str, Any]:
        return self._read(lambda store: {"sessions": store.session_summaries(limit)})

    def session(self, session_id: str, owner: str = "") -> dict[str, Any] | None:
        """One session of ``owner`` (the API key's name; "" without per-user keys)."""
        return self._read(self._session, session_id, owner)

    def sample_tokens(self, turn_id: int) -> dict[str, Any] | None:
        return self._read(self._sample_tokens, int(turn_id))

    def latest_sample_turn(self) -> int | None:
        return self._read(lambda store: store.latest_sample_id())

    def training(self) -> dict[str, Any]:
        return self._read(self._training)

    def versions(self) -> dict[str, Any]:
        return self._read(self._versions)

    def _text(self, token_id: int) -> str:
        if self.token_text is None:
            return f"<{int(token_id)}>"
        try:
            return self.token_text(int(token_id))
        except Exception:  # noqa: BLE001 - an id the tokenizer does not know is shown as an id
            return f"<{int(token_id)}>"

    # ---- overview ---------------------------------------------------------------------------------------
    def _overview(self, store: Store) -> dict[str, Any]:
        turns = store.count_turns(served_only=True)  # the context samples' turns are counted on their own
        samples = store.count_samples()
        by_kind = store.count_samples_by_kind()
        # Counts and the newest rows only: the page polls this every 2 s, and gate events hold a check's evidence.
        step_count, last = store.step_count_and_last()
        event_counts = store.event_counts()
        recent_events = store.recent_events(8)
        now = time.time()
        # Context samples are stored as turns of their own that nobody was served: left out of what was served.
        recent = store.turn_activity(now - 300.0)
        unserved = store.context_turn_activity(now - 300.0)
        recent = {k: recent[k] - unserved[k] for k in recent}
        context_turns = sum(by_kind.get(CONTEXT_KIND, {}).values())
        live = self.live() if self.live is not None else {}
        if "policy_version" in live:
            version, version_from = live["policy_version"], "served now"
        else:
            accepted = store.latest_accepted_version()
            version = accepted if accepted is not None else (last["policy_version"] if last else 0)
            version_from = "latest accepted version in the records"
        return {
            "run_dir": str(self.run_dir),
            "live": self.live is not None,
            "time": now,
            "policy_version": version,
            "policy_version_from": version_from,
            "steps": step_count,
            "last_step": None if last is None else {"step": last["step"], "created_at": last["created_at"],
                                                    "loss": last["metrics"].get("loss")},
            "samples_waiting": int(samples.get(TurnState.READY, 0)),
            "samples_by_state": samples,
            "samples_by_kind": {kind: sum(states.values()) for kind, states in sorted(by_kind.items())},
            "samples_by_kind_and_state": by_kind,
            "turns_by_state": turns,
            "turns_total": sum(turns.values()),
            "context_turns": context_turns,
            "drop_reasons": store.drop_reasons(),
            "judge": {**self._judge_setup(store), **store.vote_stats()},
            "gate": {"events_by_kind": event_counts,
                     "recent": [self._event(e) for e in recent_events][::-1]},
            "rollbacks": event_counts.get("rollback", 0),
            "throughput": {"window_s": 300, "turns": recent["turns"],
                           "turns_per_min": round(recent["turns"] / 5.0, 2),
                           "response_tokens_per_s": round(recent["response_tokens"] / 300.0, 3)},
            "serving": live.get("serving"),
        }

    def _judge_setup(self, store: Store) -> dict[str, Any]:
        """A live server's own judge set-up; for a run read from its folder, the one its server recorded at
        start-up (else what the demo's summary says, handed in as ``judge``)."""
        if self.live is not None:
            return dict(self.judge or {})
        recorded = recorded_judge_setup(store)
        if recorded is not None:
            return recorded
        return dict(self.judge) if self.judge else {"recorded": False}

    def _step_fates(self, store: Store) -> dict[int, dict[str, Any]]:
        return step_fates(store.steps(), store.versions(), store.events())

    @staticmethod
    def _event(e: dict[str, Any]) -> dict[str, Any]:
        detail = e["detail"] if isinstance(e["detail"], dict) else {}
        brief = {k: v for k, v in detail.items() if isinstance(v, (int, float, str, bool)) or v is None}
        return {"id": e["id"], "created_at": e["created_at"], "kind": e["kind"], "step": e["step"],
                "version": e["version"], "detail": brief}

    # ---- conversations ----------------------------------------------------------------------------------
    def _session(self, store: Store, session_id: str, owner: str) -> dict[str, Any] | None:
        turns = store.turns(session_id=session_id, owner=owner)
        if not turns:
            return None
        fates = self._step_fates(store)
        out = []
        for turn in turns:
            sample = store.get_sample(int(turn.id))
            votes = store.votes(int(turn.id))
            last_attempt = max((v.attempt for v in votes), default=0)
            out.append({
                "turn_id": turn.id, "turn_index": turn.turn_index, "created_at": turn.created_at,
                "context_of": store.context_source(int(turn.id)),
                "context_turn_ids": store.context_turn_ids(int(turn.id)),
                "policy_version": turn.policy_version, "state": turn.state, "reason": turn.reason,
                "request_tail": turn.messages[-2:],
                "answer": turn.response_text, "assistant_message": turn.assistant_message,
                "finish_reason": turn.finish_reason, "response_tokens": len(turn.response_ids),
                "next_state": turn.next_state,
                "votes": [{"kind": v.kind, "index": v.index, "attempt": v.attempt, "score": v.score,
                           "hint": v.hint, "raw_text": v.raw_text, "error": v.error,
                           "latency_s": round(v.latency_s, 3), "superseded": v.attempt < last_attempt}
                          for v in votes],
                "sample": None if sample is None else {
                    "kind": sample.kind, "reward": sample.reward, "hints": sample.hints, "state": sample.state,
                    "chosen_hint": self._chosen_hint(sample), "has_targets": sample.targets is not None,
                    "info": {k: sample.info.get(k) for k in ("kind_reason", "candidates", "teacher_error",
                                                             "hint", "context_loss", "context_answers",
                                                             "context_error", "context_unsound")
                                      if k in sample.info}},
                "fate": fate_of(turn.state, turn.reason, sample, fates),
            })
        return {"session_id": session_id, "owner": owner, "turns": out}

    def _h_star(self, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        overlap_C_T = topk_overlap(targets["student_ids_T_K"], targets["teacher_ids_C_T_K"])
        return select_hints(overlap_C_T, self.hint_selection)

    def _chosen_hint(self, sample: SampleRecord) -> dict[str, Any] | None:
        t = sample.targets
        if not t or "student_ids_T_K" not in t or "teacher_ids_C_T_K" not in t or not sample.hints:
            return None
        h_star_T = self._h_star(t)
        if h_star_T.numel() == 0:
            return None
        index = int(torch.mode(h_star_T).values)
        return {"index": index, "hint": sample.hints[index] if index < len(sample.hints) else "",
                "selection": self.hint_selection}

    # ---- one sample, token by token -----------------------------------------------------------------------
    def _sample_tokens(self, store: Store, turn_id: int) -> dict[str, Any] | None:
        """Per response token: text, behaviour log-prob, the OPD advantage under the chosen hint and the top-k sets.

        advantage_t = clip(ℓ_T(h*)(a_t) − ℓ_old(a_t), ±adv_diff_clip) with both log-probs as recorded when the
        sample was built (the teacher's at the sampled token, the student's at judging time). Samples recorded
        before those were stored fall back to the teacher's value at the student top-k (when a_t is in it) and
        the behaviour log-prob; otherwise the advantage is null (no colour).
        """
        try:
            turn = store.get_turn(int(turn_id))
        except KeyError:
            return None
        sample = store.get_sample(int(turn_id))
        ids = list(turn.response_ids)
        shown = min(len(ids), MAX_TOKENS_SHOWN)
        t = (sample.targets if sample is not None else None) or {}
        has_topk = "student_ids_T_K" in t and "teacher_ids_C_T_K" in t and t["student_ids_T_K"].shape[0] == len(ids)
        h_star_T = self._h_star(t) if has_topk else None
        votes = store.votes(int(turn_id))
        tokens = []
        for i in range(shown):
            tok: dict[str, Any] = {"i": i, "id": ids[i], "text": self._text(ids[i]),
                                   "behaviour_logprob": _finite(turn.logprobs[i]) if i < len(turn.logprobs) else None}
            if h_star_T is not None:
                tok.update(self._token_topk(t, i, int(h_star_T[i]), ids[i], tok["behaviour_logprob"]))
            tokens.append(tok)
        clip = self.adv_diff_clip
        return {
            "turn_id": turn.id, "session_id": turn.session_id, "owner": turn.owner,
            "policy_version": turn.policy_version,
            "answer": turn.response_text, "response_tokens": len(ids), "shown_tokens": shown,
            "tokens": tokens, "adv_clip": clip if clip > 0 else None, "hint_selection": self.hint_selection,
            "hints": sample.hints if sample is not None else [],
            "chosen_hint": self._chosen_hint(sample) if sample is not None else None,
            "has_targets": has_topk,
            "grpo": None if sample is None else {
                "reward": sample.reward, "kind": sample.kind,
                "votes": [{"index": v.index, "score": v.score, "raw_text": v.raw_text, "error": v.error}
                          for v in votes if v.kind == "eval"]},
            "fate": fate_of(turn.state, turn.reason, sample, self._step_fates(store)),
        }

    def _token_topk(self, t: dict[str, torch.Tensor], i: int, h: int, token_id: int,
                    behaviour: float | None) -> dict[str, Any]:
        student_ids = t["student_ids_T_K"][i].tolist()
        teacher_ids = t["teacher_ids_C_T_K"][h, i].tolist()
        student_lp = t["student_logprobs_T_K"][i].tolist() if "student_logprobs_T_K" in t else [None] * len(student_ids)
        teacher_lp = t["teacher_logprobs_C_T_K"][h, i].tolist()
        teacher_at_student = t["teacher_at_student_C_T_K"][h, i].tolist() if "teacher_at_student_C_T_K" in t \
            else [None] * len(student_ids)
        if "teacher_token_logprobs_C_T" in t and "student_token_logprobs_T" in t:
            teacher_tok = float(t["teacher_token_logprobs_C_T"][h, i])
            old_tok = float(t["student_token_logprobs_T"][i])
        elif token_id in student_ids:
            j = student_ids.index(token_id)
            teacher_tok, old_tok = teacher_at_student[j], (student_lp[j] if student_lp[j] is not None else behaviour)
        else:
            teacher_tok, old_tok = None, behaviour
        diff = None
        if teacher_tok is not None and old_tok is not None:
            diff = teacher_tok - old_tok
            if self.adv_diff_clip > 0:
                diff = max(-self.adv_diff_clip, min(self.adv_diff_clip, diff))
        shared = set(student_ids) & set(teacher_ids)

        def entries(id_list: list[int], lps: list[float | None]) -> list[dict[str, Any]]:
            ranked = sorted(zip(id_list, lps), key=lambda p: -(p[1] if p[1] is not None else -1e9))
            return [{"id": tid, "text": self._text(tid), "logprob": _finite(lp), "shared": tid in shared}
                    for tid, lp in ranked[:TOPK_SHOWN]]

        return {"hint_index": h, "advantage": _finite(diff), "teacher_logprob": _finite(teacher_tok),
                "old_logprob": _finite(old_tok), "overlap": len(shared), "k": len(student_ids),
                "student_topk": entries(student_ids, student_lp), "teacher_topk": entries(teacher_ids, teacher_lp),
                "in_student_topk": token_id in student_ids}

    # ---- training ---------------------------------------------------------------------------------------
    def _training(self, store: Store) -> dict[str, Any]:
        steps = store.steps()
        series: dict[str, list[float | None]] = {}
        numeric = sorted({k for s in steps for k, v in s["metrics"].items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"})
        for key in numeric:
            series[key] = [_finite(s["metrics"].get(key)) if isinstance(s["metrics"].get(key), (int, float))
                           else None for s in steps]
        if not steps:  # a run whose store has no step rows yet may still have metrics.jsonl lines
            lines = read_jsonl(self.run_dir / "metrics.jsonl")
            steps = [{"step": int(r.get("step", i + 1)), "created_at": r.get("time"),
                      "policy_version": r.get("policy_version"), "metrics": r, "turn_ids": []}
                     for i, r in enumerate(lines)]
            numeric = sorted({k for r in lines for k, v in r.items() if isinstance(v, (int, float))
                              and not isinstance(v, bool) and k not in ("step", "time")})
            series = {k: [_finite(r.get(k)) if isinstance(r.get(k), (int, float)) else None for r in lines]
                      for k in numeric}
        return {
            "steps": [s["step"] for s in steps],
            "times": [s["created_at"] for s in steps],
            "policy_versions": [s["policy_version"] for s in steps],
            "samples_per_step": [len(s["turn_ids"]) for s in steps],
            "series": series,
            "requeued_steps": [{"step": r["step"], "requeued_at": r["requeued_at"],
                                "resumed_from_step": r["resumed_from_step"]} for r in store.requeued_steps()],
            "evaluations": self.evaluations(),
        }

    def evaluations(self) -> list[dict[str, Any]]:
        """The demo's held-out evaluations (``eval_*.json`` in the run folder), oldest first."""
        out = []
        for path in sorted(self.run_dir.glob("eval_*.json"), key=lambda p: p.stat().st_mtime):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                continue  # being written
            out.append({"name": path.stem[len("eval_"):], "time": path.stat().st_mtime,
                        "score": _finite(data.get("score")), "guard_pass_rate": _finite(data.get("guard_pass_rate")),
                        "satisfied_rate": _finite(data.get("satisfied_rate")), "n": data.get("n")})
        return out

    # ---- versions ---------------------------------------------------------------------------------------
    def _versions(self, store: Store) -> dict[str, Any]:
        versions = store.versions()
        steps = store.steps()
        events = store.events()
        fates = step_fates(steps, versions, events)
        out = []
        for v in versions:
            own = [s for s in steps if fates.get(s["step"], {}).get("version") == v["version"]]
            out.append({"version": v["version"], "step": v["step"], "created_at": v["created_at"],
                        "status": v["status"], "evidence": v["evidence"], "owner": v.get("owner", ""),
                        "steps": [s["step"] for s in own],
                        "samples": sum(len(s["turn_ids"]) for s in own),
                        "events": [self._event(e) for e in events if e["version"] == v["version"]]})
        outside = [{"step": s["step"], "samples": len(s["turn_ids"]), **trained_fate(s["step"], fates[s["step"]])}
                   for s in steps if fates.get(s["step"], {}).get("disposition") in ("rejected", "discarded",
                                                                                      "unchecked")]
        return {"versions": out,
                "forget_receipts": forget_receipts(self.run_dir),
                "steps_in_no_version": outside,
                "timeline": [self._event(e) for e in events],
                "steps": [{"step": s["step"], "created_at": s["created_at"], "policy_version": s["policy_version"],
                           "samples": len(s["turn_ids"]), "in": fates.get(s["step"], {"disposition": "requeued"})}
                          for s in steps]}


def forget_receipts(run_dir: Path) -> list[dict[str, Any]]:
    """The run's forget receipts (``RUN_DIR/receipts/forget-*.json``, written by ``clawloop forget`` and the admin
    route), oldest first; ids and counts only, as written. One that cannot be read is listed with its problem."""
    out = []
    for path in sorted((run_dir / RECEIPTS_DIR).glob("forget-*.json")):
        try:
            receipt = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            receipt = {"problem": f"{type(exc).__name__}: {exc}"}
        out.append({"file": path.name, **receipt})
    return out


def view_for_run_dir(run_dir: str | Path, **kwargs: Any) -> RunView:
    """A ``RunView`` of a finished or running run folder (raises FileNotFoundError when it holds no store)."""
    run_dir = Path(run_dir)
    return RunView(run_dir, store_path=find_store(run_dir), **kwargs)
