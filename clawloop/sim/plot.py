"""Pictures of learning: the demo's learning curve and the method comparison (matplotlib, no display needed).

``learning_curve(summary, path)`` — held-out preference score and guard pass rate against interactions, the
optimizer step of each evaluation written next to its point, plus the share of the sessions' first answers
(sampled, as the user saw them, with no correction yet in their context) that followed the preference, as a
rolling mean over sessions.

``comparison(cells, path, target)`` — one panel per persona, one line per method: the mean held-out score over
seeds at each evaluation point of any seed, with the min-max band over seeds. Runs are scored at different
interaction counts (on a schedule, and whenever a new version starts being served), so a seed without a point
there counts with its latest score before it (``score_at``): the version it was serving then.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

METHOD_COLOURS = {"hybrid": "tab:purple", "rl": "tab:orange", "opd": "tab:green", "combine": "tab:brown",
                  "topk_kl": "tab:cyan"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


def learning_curve(summary: dict[str, Any], path: str | Path) -> Path:
    plt = _pyplot()
    curve = summary.get("curve", [])
    fig, ax = plt.subplots(figsize=(8, 4.8))
    xs = [p["interactions"] for p in curve]
    ax.plot(xs, [p["score"] for p in curve], "o-", color="tab:blue", lw=2, label="held-out preference score")
    ax.plot(xs, [p["guard_pass_rate"] for p in curve], "s--", color="tab:gray", label="guard pass rate (held-out)")
    for p in curve:
        ax.annotate(f"step {p['step']}", (p["interactions"], p["score"]), textcoords="offset points",
                    xytext=(0, 8), ha="center", fontsize=8, color="tab:blue")
    sessions = [s for s in summary.get("sessions", []) if "first_followed" in s]
    if sessions:
        # The first answer of a session has no correction in its context, like a held-out question; later ones
        # do (the user has just asked), so only first answers say what the policy does unprompted.
        window = 5
        sx = [s["interactions"] for s in sessions]
        flags = [float(s["first_followed"]) for s in sessions]
        sy = [sum(flags[max(0, i - window + 1):i + 1]) / len(flags[max(0, i - window + 1):i + 1])
              for i in range(len(flags))]
        ax.plot(sx, sy, ":", color="tab:orange", lw=1.5,
                label=f"first answers of sessions that followed it (sampled, mean of last {window} sessions)")
    ax.set_xlabel("interactions (answers the simulated user reacted to)")
    ax.set_ylabel("share of answers")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(alpha=0.3)
    s = summary.get("settings", {})
    judge = summary.get("judge", {}).get("backend")
    ax.set_title(f"clawloop learning '{summary.get('persona')}' ({summary.get('preference', '')})\n"
                 f"method {s.get('method')}, {'LoRA' if s.get('lora') else 'full'}, lr {s.get('lr')}, "
                 f"kl {s.get('kl_coef')}, batch {s.get('rollout_batch_size')}, judge {judge}, "
                 f"seed {summary.get('seed')}", fontsize=9)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def score_at(curve: Sequence[dict[str, Any]], interactions: int) -> float | None:
    """The held-out score of the version a run was serving after ``interactions``: its latest evaluation at or
    before that count (None before the first)."""
    score = None
    for point in sorted(curve, key=lambda p: p["interactions"]):
        if point["interactions"] > interactions:
            break
        score = point["score"]
    return score


def comparison(cells: Sequence[dict[str, Any]], path: str | Path, target: float | None = None) -> Path:
    """``cells``: results of ``compare.run_cell`` (each with method, persona, seed and a curve)."""
    plt = _pyplot()
    personas = sorted({c["persona"] for c in cells})
    fig, axes = plt.subplots(1, max(1, len(personas)), figsize=(6 * max(1, len(personas)), 4.5), squeeze=False)
    for ax, persona in zip(axes[0], personas):
        by_method: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for c in cells:
            if c["persona"] == persona:
                by_method[c["method"]].append(c)
        for method, runs in sorted(by_method.items()):
            xs, means, lows, highs = [], [], [], []
            for x in sorted({p["interactions"] for r in runs for p in r["curve"]}):
                vals = [v for v in (score_at(r["curve"], x) for r in runs) if v is not None]
                if not vals:
                    continue
                xs.append(x)
                means.append(sum(vals) / len(vals))
                lows.append(min(vals))
                highs.append(max(vals))
            colour = METHOD_COLOURS.get(method)
            # A score holds until the next evaluation: steps, not slopes between points.
            ax.plot(xs, means, "o-", color=colour, drawstyle="steps-post", label=f"{method} (n={len(runs)})")
            ax.fill_between(xs, lows, highs, color=colour, alpha=0.15, step="post")
        if target is not None:
            ax.axhline(target, color="k", ls=":", lw=1, label=f"target {target:g}")
        ax.set_title(f"persona '{persona}'")
        ax.set_xlabel("interactions")
        ax.set_ylabel("held-out preference score")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
