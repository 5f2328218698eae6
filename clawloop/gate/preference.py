"""The preference check: does a candidate still answer the way the run's hint asks, as much as the accepted version?

The gate's other checks ask whether a candidate broke something the starting weights or the last accepted version
could do. None asks whether it unlearnt what the users taught: in the comparison, versions that had learnt part of
a preference were accepted after steps that took it away again (docs/publication-gate.md). The gate does not know
the preference, but the judge wrote it down as hints, and the starting weights read a hint well enough to judge an
answer by it. For an answer y to a probe x and the hint h,

    R(y) = log π_ref(y | x ⊕ h) − log π_ref(y | x)

summed over the answer's tokens as the gate decoded them (its end token is not among them): how much more likely
the hint makes that answer under the starting weights, the hint-conditioned teacher's implicit reward. The check
needs the starting weights as its reader (a LoRA run, or full fine-tuning that keeps a frozen copy for
``kl_coef > 0`` or the retain term); a gate that measures against the last accepted weights instead does not
read, since rewards read by one version and compared with the next one's would measure the readers. The check
compares the mean R of the candidate's greedy answers with that of the last accepted version's answers to the same
probes (the shipped, corrected and recent prompts both answered; not the knowledge probes, whose answers are
facts), and the candidate fails when its mean is lower by more than a margin (``Config.gate_max_preference_drop``).

h is the hint most often attached to the samples the trainer has trained since it started (the judge's rule hints
repeat the preference word for word); on a shared server that is the majority's preference. Replayed offline on
the kept versions of the comparison (``scripts/preference_replay.py``, which also scores the end token), the mean R
fell with every version whose held-out score fell and rose with every one whose score rose, but it also moved by up
to 0.6 nats between versions that kept their score, hence a margin of 1 nat: it stops the large drops (6 and 9
nats there; 3 and 5 online, where the end token is not scored) and lets the small ones (0.15; 0.10 online) through.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from clawloop.gate.scoring import PromptStates, answer_logprob_sums


def implicit_rewards(model: torch.nn.Module, plain_prompts: Sequence[list[int]], hinted_prompts: Sequence[list[int]],
                     answers: Sequence[list[int]], *, states: PromptStates | None = None) -> list[float]:
    """R(y) for each answer: its summed log-probability after the hinted prompt minus after the plain one
    (``states``: the prompts' kept states under ``model``, ``clawloop.gate.scoring``)."""
    hinted = answer_logprob_sums(model, list(hinted_prompts), list(answers), states=states)
    plain = answer_logprob_sums(model, list(plain_prompts), list(answers), states=states)
    return [h - u for h, u in zip(hinted, plain)]


@dataclass(frozen=True)
class PreferenceReading:
    """The preference check's measurement on one candidate."""

    hint: str
    probes: int
    """Probes both the candidate and the last accepted version answered (greedy), over which the means are taken."""
    accepted_mean: float
    """Mean R of the last accepted version's answers, nats."""
    candidate_mean: float
    """Mean R of the candidate's answers, nats."""

    @classmethod
    def of(cls, hint: str, accepted: Sequence[float], candidate: Sequence[float]) -> PreferenceReading:
        if not accepted or len(accepted) != len(candidate):
            raise ValueError(f"need the same non-zero number of rewards (got {len(accepted)} and {len(candidate)})")
        return cls(hint=hint, probes=len(accepted), accepted_mean=statistics.fmean(accepted),
                   candidate_mean=statistics.fmean(candidate))

    @property
    def drop(self) -> float:
        """How far the candidate's mean R is below the accepted version's (negative: above)."""
        return self.accepted_mean - self.candidate_mean

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "drop": self.drop}
