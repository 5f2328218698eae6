"""Which loss terms actually trained, read from the step metrics the server records.

A branch of the objective reports ``<branch>_applied`` (the share of the step's samples it had targets for) and/or
``<branch>_loss``. A branch counts as active in a step when its ``_applied`` metric is above 0, or, for a branch
without one (GRPO), when its loss is present. Samples of a kind trained in their own way count when the step had
any (``context_samples``: the teacher's own answers under a hint, context distillation; ``rollout_samples``: the
student's own answers, sampled by the trainer; ``retain_behind_hint``: retain examples built behind the hint's
opening; ``opening_preference``: a step that trained the preference as one about how answers open). New branches
show up under their metric name without a change here.

GRPO needs a non-zero advantage to move the weights: a step whose advantages were all 0 (every reward alike, e.g.
all corrections) reports a GRPO loss of 0 and is not counted for it. A branch present in the metrics but active in
no step is listed with 0, so a method's idle term shows as idle rather than missing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

TERM_LABELS: dict[str, str] = {
    "grpo": "GRPO",
    "opd": "OPD top-k select",
    "topk_kl": "top-k tail KL",
    "combine": "combined GRPO + OPD",
    "combine_teacher": "combined, teacher term",
    "opd_support": "OPD support",
    "context": "context samples",
    "rollout": "student rollouts",
    "retain": "retain (general prompts)",
    "retain_behind_hint": "retain behind the hint's opening",
    "opening": "trained as an opening preference",
}
"""Readable names of the branches known today; any other branch is shown by its metric name."""

# Metric names that end like a branch's but are bookkeeping of the whole step.
_NOT_BRANCHES = {"updates_applied"}
# Per-step sample counts that name a kind of training (others, e.g. ``hinted_samples``, only describe the batch).
_SAMPLE_KINDS = {"context_samples": "context", "rollout_samples": "rollout",
                 "retain_behind_hint": "retain_behind_hint", "opening_preference": "opening"}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _advantage_free(metrics: Mapping[str, Any]) -> bool:
    """Every advantage of the step was 0 (mean 0 and no negative part), when the step reports them."""
    mean, negative = _number(metrics.get("advantage_mean")), _number(metrics.get("advantage_negative_mean"))
    return mean is not None and negative is not None and mean == 0.0 and negative == 0.0


def present_branches(metrics: Mapping[str, Any]) -> set[str]:
    """The loss branches one step reports, active or not."""
    return {k.rsplit("_", 1)[0] for k in metrics
            if k.endswith(("_applied", "_loss")) and k not in _NOT_BRANCHES and _number(metrics[k]) is not None}


def active_branches(metrics: Mapping[str, Any]) -> set[str]:
    """The branches active in one step."""
    applied: dict[str, float] = {}
    losses: set[str] = set()
    counted: set[str] = set()
    for key, value in metrics.items():
        number = _number(value)
        if key in _NOT_BRANCHES or number is None:
            continue
        if key.endswith("_applied"):
            applied[key[: -len("_applied")]] = number
        elif key.endswith("_loss"):
            losses.add(key[: -len("_loss")])
        elif key in _SAMPLE_KINDS and number > 0:
            counted.add(_SAMPLE_KINDS[key])
    # A branch that reports whether it applied is judged by that alone: its loss is written as 0 when it did not.
    active = {b for b, share in applied.items() if share > 0} | (losses - set(applied)) | counted
    if _advantage_free(metrics):
        active.discard("grpo")
    return active


def steps_per_term(step_metrics: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """For each branch any step reports, the number of steps it was active in (known ones first)."""
    counts: dict[str, int] = {}
    for metrics in step_metrics:
        for branch in present_branches(metrics):
            counts.setdefault(branch, 0)
        for branch in active_branches(metrics):
            counts[branch] = counts.get(branch, 0) + 1
    order = list(TERM_LABELS)
    return dict(sorted(counts.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0])))


def term_label(branch: str) -> str:
    return TERM_LABELS.get(branch, branch)


def branch_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics of one step that say which branches trained (kept in a run's summary for later reading)."""
    return {k: v for k, v in metrics.items()
            if (k.endswith(("_applied", "_loss")) or k in _SAMPLE_KINDS or k.startswith("advantage_"))
            and k not in _NOT_BRANCHES}
