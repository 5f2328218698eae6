"""Loss helpers only the tests use, built on ``clawloop.losses``'s public functions.

* ``build_topk_targets`` — TopKTargets from full log-prob tables ([T, V] and [C, T, V]), which the trainer never
  has (it gathers the top-k directly), but small tests do.
* ``topk_select_opd_loss`` / ``topk_tail_kl_loss`` — the two top-k objectives straight from raw logits, so a test
  can check one objective against its reference without going through ``sample_objective``.
* ``batch_mean`` / ``compute_objective`` — the whole batch in one graph (the trainer accumulates sample by sample,
  which gives the same gradient with one sample's memory).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from clawloop.losses import (MetricsAccumulator, ObjectiveSample, ObjectiveSettings, TopKTargets, logprobs_at,
                             sample_objective, tail_kl_metrics, topk_select_loss, topk_subset, topk_tail_kl)


def floats(metrics: dict[str, Tensor]) -> dict[str, float]:
    return {key: float(value) for key, value in metrics.items()}


def batch_mean(per_sample: Sequence[Tensor] | Tensor) -> Tensor:
    """Mean of per-sample values over every sample of the batch (fully masked samples count, as 0)."""
    if isinstance(per_sample, Tensor):
        return per_sample.mean()
    if len(per_sample) == 0:
        raise ValueError("batch_mean of an empty batch")
    return torch.stack(list(per_sample)).mean()


def build_topk_targets(old_logprobs_T_V: Tensor, teacher_logprobs_C_T_V: Tensor, k: int) -> TopKTargets:
    """TopKTargets from full log-prob tables (old policy [T, V], candidates [C, T, V])."""
    C, T, V = teacher_logprobs_C_T_V.shape
    student_logprobs_T_K, student_ids_T_K = old_logprobs_T_V.topk(k, dim=-1)
    teacher_logprobs_C_T_K, teacher_ids_C_T_K = teacher_logprobs_C_T_V.topk(k, dim=-1)
    old_at_teacher_C_T_K = old_logprobs_T_V.unsqueeze(0).expand(C, T, V).gather(-1, teacher_ids_C_T_K)
    teacher_at_student_C_T_K = teacher_logprobs_C_T_V.gather(-1, student_ids_T_K.unsqueeze(0).expand(C, T, k))
    return TopKTargets(student_ids_T_K, student_logprobs_T_K, old_at_teacher_C_T_K, teacher_ids_C_T_K,
                       teacher_logprobs_C_T_K, teacher_at_student_C_T_K)


def topk_select_opd_loss(
    logits_T_V: Tensor,
    targets: TopKTargets,
    *,
    hint_selection: str = "sequence_optimal",
    subset_mode: str = "student",
    adv_diff_clip: float = 1.0,
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
    temperature: float = 1.0,
    mask_T: Tensor | None = None,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Top-k select OPD per token from raw logits: (loss_T, metrics as floats)."""
    subset = topk_subset(targets, hint_selection=hint_selection, subset_mode=subset_mode, mask_T=mask_T)
    cur_logprobs_T_K = logprobs_at(logits_T_V, subset.ids_T_K, temperature, chunk_tokens=chunk_tokens)
    loss_T, metrics = topk_select_loss(cur_logprobs_T_K, subset, adv_diff_clip=adv_diff_clip, eps_clip=eps_clip,
                                       eps_clip_high=eps_clip_high, mask_T=mask_T)
    return loss_T, floats(metrics)


def topk_tail_kl_loss(
    logits_T_V: Tensor,
    teacher_ids_T_K: Tensor,
    teacher_logprobs_T_K: Tensor,
    temperature: float = 1.0,
    *,
    mask_T: Tensor | None = None,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Top-k tail KL from raw logits: (kl_T, metrics{loss, teacher_mass, student_mass})."""
    student_T_K = logprobs_at(logits_T_V, teacher_ids_T_K, temperature, chunk_tokens=chunk_tokens)
    kl_T = topk_tail_kl(student_T_K, teacher_logprobs_T_K)
    return kl_T, floats(tail_kl_metrics(kl_T, student_T_K, teacher_logprobs_T_K, mask_T))


def compute_objective(
    samples: Sequence[ObjectiveSample], settings: ObjectiveSettings
) -> tuple[Tensor, dict[str, float]]:
    """Batch objective: mean over samples of ``sample_objective(...).loss`` (graph attached) and batch metrics."""
    if len(samples) == 0:
        raise ValueError("compute_objective needs at least one sample")
    settings.validate()
    accumulator = MetricsAccumulator()
    losses = []
    for sample in samples:
        out = sample_objective(sample, settings)
        losses.append(out.loss)
        accumulator.add(out.metrics)
    return batch_mean(losses), accumulator.result()
