"""How far behind the trained weights a sample's answer was generated, and what that does to training.

A turn records the policy version that generated it. When the trainer takes it, the policy is at some later
version; the difference is the sample's *staleness*. Samples up to ``max_staleness`` versions old train as they
are (the old-policy forward re-computes ℓ_old, so the PPO ratio stays exact). Older ones are handled by
``staleness_mode``:

* ``tis`` (default) — keep the sample, but weight each token's loss by a truncated importance weight
  ``min(exp(ℓ_old − ℓ_behaviour), tis_cap)``: how much more likely the trained-from policy makes the token than
  the policy that actually sampled it, capped so one unlikely token cannot dominate
  (``clawloop.losses.truncated_importance_weights``, applied in the old-policy forward). Tokens sampled greedily
  (temperature 0) have no sampling distribution to correct against; they keep weight 1.
* ``drop`` — the sample is not trained on; the store records reason ``stale`` (never silently).
* ``ignore`` — train on it as if it were fresh.
"""

from __future__ import annotations

from dataclasses import dataclass

KEEP, DROP, TIS = "keep", "drop", "tis"


def staleness(turn_version: int, current_version: int) -> int:
    """Versions between the sample's generator and the weights being trained (never negative: an offline run
    may train samples from a later online version than its own counter)."""
    return max(0, int(current_version) - int(turn_version))


def decide(gap: int, max_staleness: int, mode: str) -> str:
    """``keep``, ``drop`` or ``tis`` for a sample ``gap`` versions old."""
    if gap <= max_staleness or mode == "ignore":
        return KEEP
    if mode == "drop":
        return DROP
    if mode == "tis":
        return TIS
    raise ValueError(f"staleness_mode {mode!r} is not one of tis, drop, ignore")


@dataclass
class StalenessStats:
    """Per-step summary for the metrics line."""

    gaps: list[int]
    dropped: int = 0
    corrected: int = 0

    def as_metrics(self) -> dict[str, float]:
        if not self.gaps:
            return {"staleness_mean": 0.0, "staleness_max": 0.0, "stale_dropped": float(self.dropped),
                    "stale_corrected": float(self.corrected)}
        return {
            "staleness_mean": sum(self.gaps) / len(self.gaps),
            "staleness_max": float(max(self.gaps)),
            "stale_dropped": float(self.dropped),
            "stale_corrected": float(self.corrected),
        }
