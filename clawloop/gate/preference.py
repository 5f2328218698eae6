"""The preference check: does a candidate still answer the way the run's hint asks, as much as the accepted version?

The gate's other checks ask whether a candidate broke something the starting weights or the last accepted version
could do. None asks whether it unlearnt what the users taught: in the comparison, versions that had learnt part of
a preference were accepted after steps that took it away again (docs/publication-gate.md). The gate does not know
the preference, but the judge wrote it down as hints, and the starting weights read a hint well enough to judge an
answer by it. For an answer y to a probe x and the hint h,

    R(y) = log π_ref(y | x ⊕ h) − log π_ref(y | x)

summed over the answer's tokens as the gate decoded them, and its end token where it ended before the gate's cap
(where an answer stops is half of what a preference for length or for a closing asks): how much more likely the
hint makes that answer under the starting weights, the hint-conditioned teacher's implicit reward. The check needs
the starting weights as its reader (a LoRA run, or full fine-tuning that keeps a frozen copy, by default); a gate
that measures against the last accepted weights instead does not read, since rewards read by one version and
compared with the next one's would measure the readers. The check compares, over the
probes both answered (the shipped, corrected and recent prompts; not the knowledge probes, whose answers are
facts), the mean of R per answer token of the candidate's greedy answers with that of the last accepted
version's, and the candidate fails when its mean is lower by more than a margin
(``Config.gate_max_preference_drop``, nats per token).

Per token, because on most tokens a hint makes the reference a little less sure of the ordinary continuation, so
a sum favours the shorter answer whatever the preference: summed, a version that had cut its answers to a few
words kept out every later candidate that answered in full, on a preference for a closing sign-off that answers
cut at the cap can never show. h is the hint most often attached to the samples the trainer has trained since it
started (the judge's rule hints repeat the preference word for word); on a shared server that is the majority's
preference. How the margin was set: docs/publication-gate.md, "Keeping the preference".
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


def per_token(reward: float, tokens: int) -> float:
    """An answer's R per token it has (an empty answer, whose R is 0, counts as one token)."""
    return reward / max(int(tokens), 1)


@dataclass(frozen=True)
class PreferenceReading:
    """The preference check's measurement on one candidate: per answer token, and summed for the record."""

    hint: str
    probes: int
    """Probes both the candidate and the last accepted version answered (greedy), over which the means are taken."""
    accepted_mean: float
    """Mean over the probes of the last accepted version's R per answer token, nats/token (what the check
    compares)."""
    candidate_mean: float
    """Mean over the probes of the candidate's R per answer token, nats/token."""
    accepted_sum_mean: float | None = None
    """Mean summed R of the last accepted version's answers, nats (shown, not compared)."""
    candidate_sum_mean: float | None = None
    """Mean summed R of the candidate's answers, nats."""

    @classmethod
    def of(cls, hint: str, accepted: Sequence[float], candidate: Sequence[float],
           accepted_tokens: Sequence[int], candidate_tokens: Sequence[int]) -> PreferenceReading:
        """From each probe's summed R and answer length, the accepted version's and the candidate's."""
        if not accepted or not len(accepted) == len(candidate) == len(accepted_tokens) == len(candidate_tokens):
            raise ValueError(f"need the same non-zero number of rewards and lengths (got {len(accepted)}, "
                             f"{len(candidate)}, {len(accepted_tokens)} and {len(candidate_tokens)})")
        return cls(hint=hint, probes=len(accepted),
                   accepted_mean=statistics.fmean(per_token(r, n) for r, n in zip(accepted, accepted_tokens)),
                   candidate_mean=statistics.fmean(per_token(r, n) for r, n in zip(candidate, candidate_tokens)),
                   accepted_sum_mean=statistics.fmean(accepted), candidate_sum_mean=statistics.fmean(candidate))

    @property
    def drop(self) -> float:
        """How far the candidate's mean R per token is below the accepted version's (negative: above)."""
        return self.accepted_mean - self.candidate_mean

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "drop": self.drop}
