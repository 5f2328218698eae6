"""The training objectives of clawloop (docs/method.md, section 4): pure functions on tensors, no I/O, no model,
and nothing imported from the rest of clawloop.

Notation for one sample with T response tokens (shape suffixes: T tokens, V vocabulary, K top-k width,
C hint candidates, N gathered ids per token):

    ℓ_θ   current log-prob   log softmax(logits / τ)       (full vocabulary, gradient flows)
    ℓ_old old-policy log-prob (the trainer's forward before the step; detached input)
    ℓ_T   teacher log-prob under the hint-augmented prompt (detached input)
    ρ     exp(clamp(ℓ_θ − ℓ_old, −20, 20))
    L^PG(A) = max(−ρ·A, −clip(ρ, 1−ε_lo, 1+ε_hi)·A)

One job per module:

* ``presets``     the choices, the method presets (branch weights) and the checks of the objective's settings;
                  ``clawloop.config`` takes them from here. No torch.
* ``logsoftmax``  the memory-bounded log-softmax + gather, the only code that touches [T, V].
* ``surrogates``  PPO surrogate, GRPO, the legacy combine, k3 KL, truncated importance weights, masked token mean.
* ``advantages``  group normalisation and the batch shaping of GRPO advantages.
* ``topk``        top-k targets, overlap, hint selection, the OPD subset, top-k select OPD, the tail KL.
* ``support``     the teacher-support term: forward KL from the teacher's top-K plus a tail bin to the student.
* ``target_mix``  which teacher row (hinted or plain) the distillation target follows at each position.
* ``objective``   ``sample_objective``: one sample's loss and metrics for every method; ``MetricsAccumulator``.

Everything the trainer, the dashboard and the tests use is importable from ``clawloop.losses`` itself.
"""

from __future__ import annotations

from clawloop.losses.advantages import group_normalized_rewards, shape_advantages
from clawloop.losses.logsoftmax import logprobs_and_entropy, logprobs_at
from clawloop.losses.objective import (MetricsAccumulator, ObjectiveConfig, ObjectiveSample, ObjectiveSettings,
                                       SampleObjective, sample_objective)
from clawloop.losses.presets import (ADVANTAGE_MODES, HINT_SELECTIONS, METHOD_WEIGHTS, METHODS, OPD_ON_UNHINTED,
                                     OPD_TARGETS, SUBSET_MODES, SUPPORT_METHODS, SUPPORT_POSITIONS,
                                     ObjectiveChoices, check_objective, method_weights, support_active)
from clawloop.losses.support import (support_metrics, support_positions, support_targets, teacher_entropy,
                                     teacher_support_kl)
from clawloop.losses.target_mix import hinted_positions, mix_rows, mixes
from clawloop.losses.surrogates import (combine_token_loss, grpo_token_loss, k3_kl, masked_token_mean,
                                        ppo_token_loss, truncated_importance_weights)
from clawloop.losses.topk import (TopKSubset, TopKTargets, select_hints, tail_kl_metrics, topk_overlap,
                                  topk_select_loss, topk_subset, topk_tail_kl)

__all__ = [
    "ADVANTAGE_MODES", "HINT_SELECTIONS", "METHODS", "METHOD_WEIGHTS", "OPD_ON_UNHINTED", "OPD_TARGETS",
    "SUBSET_MODES",
    "SUPPORT_METHODS", "SUPPORT_POSITIONS", "support_active",
    "MetricsAccumulator", "ObjectiveChoices", "ObjectiveConfig", "ObjectiveSample", "ObjectiveSettings",
    "SampleObjective", "TopKSubset", "TopKTargets", "check_objective", "combine_token_loss",
    "group_normalized_rewards", "grpo_token_loss", "hinted_positions", "k3_kl", "logprobs_and_entropy",
    "logprobs_at",
    "masked_token_mean", "method_weights", "mix_rows", "mixes", "ppo_token_loss", "sample_objective", "select_hints",
    "shape_advantages", "support_metrics", "support_positions", "support_targets", "tail_kl_metrics",
    "teacher_entropy", "teacher_support_kl", "topk_overlap", "topk_select_loss", "topk_subset", "topk_tail_kl",
    "truncated_importance_weights",
]
