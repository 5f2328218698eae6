"""The old-policy forward: what the weights *before* a step say about each sample (no gradient).

Per sample, all at the train-side temperature of its turn, from one log-softmax per response position:

* ``ℓ_old`` at the sampled ids — the PPO ratio's denominator, and (beside the behaviour log-probs the serving
  engine reported) the train-vs-behaviour gap metric and the truncated importance weights of stale samples;
* the student side of the top-k targets — the old policy's own top-k ids and their log-probs (S^q_t), and
  ``ℓ_old`` at every candidate teacher's top-k ids;
* ``ℓ_ref`` at the sampled ids when the KL-to-reference term is on;
* for the legacy ``combine`` method, the teacher's log-prob at each sampled id under the chosen hint.

The stored sample carries a *provisional* student top-k (computed at judging time, possibly by an older
policy) with the teacher's log-probs at those ids. Where today's old-policy top-k is the same set, the stored
teacher values are reused (re-ordered to match). Where it differs, the teacher is asked again at the new ids
through ``refresh`` (``Teacher.teacher_at_ids``); with no teacher at hand (offline training), or when the
teacher fails, the provisional ids stay the student set, scored exactly under the old policy — still a valid
subset, only not today's top-k. Every case is counted in the step metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from clawloop.config import Config
from clawloop.temperature import effective_temperature
from clawloop.losses import TopKTargets, logprobs_at, select_hints, topk_overlap, truncated_importance_weights
from clawloop.store import TurnRecord
from clawloop.trainer.batch import TrainItem, micro_batches
from clawloop.trainer.model import TrainModels
from clawloop.trainer.runner import LocalRunner, Runner

log = logging.getLogger(__name__)

RefreshFn = Callable[[TurnRecord, list[str], torch.Tensor, float], torch.Tensor]
"""(turn, hints, at_ids_T_K, temperature) -> [C, T, K] teacher log-probs at those ids (candidates in hint order;
no hints = the un-hinted anchor candidate)."""


def needs_targets(config: Config, item: TrainItem) -> bool:
    """Whether this sample's OPD-side tensors will be used by the objective at all."""
    _, w_opd = config.weights
    if w_opd == 0.0 or item.teacher_tensors is None:
        return False
    return bool(item.sample.hints) or config.opd_on_unhinted == "anchor"


def match_rows(new_ids_T_K: torch.Tensor, stored_ids_T_K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each new id, its column in the stored row: (perm_T_K, row_matches_T). A row matches when both are
    the same set of ids (order may differ)."""
    same_T_K_K = new_ids_T_K.unsqueeze(-1) == stored_ids_T_K.unsqueeze(-2)
    found_T_K = same_T_K_K.any(-1)
    perm_T_K = same_T_K_K.to(torch.int8).argmax(-1)
    return perm_T_K, found_T_K.all(-1)


@torch.no_grad()
def old_side_from_logits(item: TrainItem, logits_T_V: torch.Tensor, config: Config,
                         refresh: RefreshFn | None = None) -> None:
    """Fill ``item`` (old log-probs, importance weights, top-k targets, combine teacher values) from the old
    policy's raw logits at its response positions."""
    temperature = item.temperature
    logits_T_V = logits_T_V.detach()
    response_ids_T = item.response_ids_T.to(logits_T_V.device)
    old_T = logprobs_at(logits_T_V, response_ids_T, temperature).float()
    item.old_logprobs_T = old_T
    behaviour_T = item.behaviour_logprobs_T.to(old_T.device)
    item.info["behaviour_gap"] = float((old_T - behaviour_T).abs().mean())
    item.token_weights_T = None
    if item.importance_correct and effective_temperature(item.turn.temperature) > 0:
        # Greedy turns have no sampling distribution to correct against: weight 1.
        item.token_weights_T = truncated_importance_weights(old_T, behaviour_T, config.tis_cap)
        item.info["tis_weight_mean"] = float(item.token_weights_T.mean())

    item.targets = None
    if not needs_targets(config, item):
        return
    t = item.teacher_tensors
    assert t is not None
    device = logits_T_V.device
    teacher_ids_C_T_K = t["teacher_ids_C_T_K"].to(device=device, dtype=torch.long)
    teacher_logprobs_C_T_K = t["teacher_logprobs_C_T_K"].to(device=device, dtype=torch.float32)
    teacher_at_student_C_T_K = t["teacher_at_student_C_T_K"].to(device=device, dtype=torch.float32)
    C, T, K_teacher = teacher_ids_C_T_K.shape
    stored_ids_T_K = t["student_ids_T_K"].to(device=device, dtype=torch.long)
    K = int(stored_ids_T_K.shape[1])
    new_ids_T_K = logits_T_V.topk(K, dim=-1).indices  # same order as the tempered log-softmax

    hints = list(item.sample.hints)
    perm_T_K, matches_T = match_rows(new_ids_T_K, stored_ids_T_K)
    item.info["student_topk_changed_frac"] = float((~matches_T).float().mean())
    fresh = None
    if not bool(matches_T.all()) and refresh is not None:
        fresh = _ask_teacher(refresh, item, hints, new_ids_T_K, temperature, (C, T, K))
    if bool(matches_T.all()):
        student_ids_T_K = new_ids_T_K
        teacher_at_student_C_T_K = teacher_at_student_C_T_K.gather(
            2, perm_T_K.unsqueeze(0).expand(C, T, K))
    elif fresh is not None:
        student_ids_T_K = new_ids_T_K
        teacher_at_student_C_T_K = fresh.to(device=device, dtype=torch.float32)
        item.info["student_topk_refreshed"] = 1.0
    else:
        # No teacher to ask (or it failed): keep the provisional set, exactly scored under the old policy below.
        student_ids_T_K = stored_ids_T_K
        item.info["student_topk_kept_provisional"] = 1.0
    student_logprobs_T_K = logprobs_at(logits_T_V, student_ids_T_K, temperature).float()
    flat_T_N = teacher_ids_C_T_K.permute(1, 0, 2).reshape(T, C * K_teacher)
    old_at_teacher_C_T_K = logprobs_at(logits_T_V, flat_T_N, temperature).float() \
        .reshape(T, C, K_teacher).permute(1, 0, 2).contiguous()
    item.targets = TopKTargets(
        student_ids_T_K=student_ids_T_K.contiguous(),
        student_logprobs_T_K=student_logprobs_T_K,
        old_at_teacher_C_T_K=old_at_teacher_C_T_K,
        teacher_ids_C_T_K=teacher_ids_C_T_K,
        teacher_logprobs_C_T_K=teacher_logprobs_C_T_K,
        teacher_at_student_C_T_K=teacher_at_student_C_T_K.contiguous(),
    )
    if config.method == "combine":
        item.info["combine_teacher"] = _combine_teacher(item, t, old_T, config, refresh)


def _ask_teacher(refresh: RefreshFn, item: TrainItem, hints: list[str], ids_T_K: torch.Tensor,
                 temperature: float, shape: tuple[int, int, int]) -> torch.Tensor | None:
    """The teacher's log-probs at ``ids_T_K``, or None when it cannot answer (down, timed out, wrong shape):
    a teacher outage degrades the subset to the provisional one instead of stopping training."""
    try:
        fresh = refresh(item.turn, hints, ids_T_K.cpu(), temperature)
    except Exception as exc:  # noqa: BLE001 - any teacher failure has the same fallback
        log.warning("trainer: teacher refresh for turn %d failed (%s: %s); keeping the stored student set",
                    item.turn_id, type(exc).__name__, exc)
        item.info["teacher_refresh_failed"] = 1.0
        return None
    if tuple(fresh.shape) != shape:
        log.warning("trainer: teacher refresh for turn %d returned shape %s, expected %s; keeping the stored "
                    "student set", item.turn_id, tuple(fresh.shape), shape)
        item.info["teacher_refresh_failed"] = 1.0
        return None
    return fresh


def _combine_teacher(item: TrainItem, t: dict[str, torch.Tensor], old_T: torch.Tensor, config: Config,
                     refresh: RefreshFn | None) -> float:
    """ℓ_T at the sampled ids under the chosen hint, for the legacy combine method (stored on the item).

    Sources, best first: stored ``teacher_at_response_C_T``; asking the teacher; looking the id up in the stored
    top-k tables. A token found nowhere gets ℓ_T := ℓ_old (no distillation push on it). Returns the fraction of
    tokens with a real teacher value.
    """
    targets = item.targets
    device = old_T.device
    C, T, _ = targets.teacher_ids_C_T_K.shape
    ids_T = item.response_ids_T.to(device)
    found_C_T = torch.ones(C, T, dtype=torch.bool, device=device)
    if "teacher_at_response_C_T" in t:
        at_response_C_T = t["teacher_at_response_C_T"].to(device=device, dtype=torch.float32)
    elif refresh is not None and (asked := _ask_teacher(refresh, item, list(item.sample.hints), ids_T.view(T, 1),
                                                        item.temperature, (C, T, 1))) is not None:
        at_response_C_T = asked[..., 0].to(device=device, dtype=torch.float32)
    else:
        at_response_C_T = old_T.expand(C, T).clone()
        found_C_T = torch.zeros(C, T, dtype=torch.bool, device=device)
        for table_ids, table_lp in ((targets.student_ids_T_K.expand(C, -1, -1), targets.teacher_at_student_C_T_K),
                                    (targets.teacher_ids_C_T_K, targets.teacher_logprobs_C_T_K)):
            hit_C_T_K = table_ids == ids_T.view(1, T, 1)
            hit_C_T = hit_C_T_K.any(-1)
            value_C_T = (table_lp * hit_C_T_K).sum(-1)
            at_response_C_T = torch.where(hit_C_T, value_C_T, at_response_C_T)
            found_C_T |= hit_C_T
    h_star_T = select_hints(topk_overlap(targets.student_ids_T_K, targets.teacher_ids_C_T_K), config.hint_selection)
    item.teacher_logprobs_T = at_response_C_T.gather(0, h_star_T.view(1, T)).squeeze(0)
    return float(found_C_T.gather(0, h_star_T.view(1, T)).float().mean())


@torch.no_grad()
def old_policy_pass(models: TrainModels, groups: list[list[TrainItem]], config: Config, runner: Runner, *,
                    refresh: RefreshFn | None = None, rounds: int | None = None) -> None:
    """The separate old-policy (and reference) forward over this process's micro-batches ``groups``, filling
    each item; ``rounds`` (``runner.rounds``) keeps every rank's forwards in step. No gradient is kept, so
    memory is one layer's activations at a time; the token budget still bounds the padded batch."""
    rounds = runner.rounds(len(groups)) if rounds is None else rounds
    for g in range(rounds):
        group = groups[g] if g < len(groups) else []
        forward = runner.forward(models.causal_lm, group)
        for item, logits_T_V in forward.samples():
            old_side_from_logits(item, logits_T_V, config, refresh)
        del forward
        if models.use_reference:
            fill_reference(models, group, runner)


def fill_old_side(models: TrainModels, items: list[TrainItem], config: Config, *,
                  micro_batch_size: int | None = None, refresh: RefreshFn | None = None,
                  micro_batch_tokens: int | None = None) -> None:
    """``old_policy_pass`` over ``items`` in this process's micro-batches."""
    groups = micro_batches(items, micro_batch_size or config.micro_batch_size,
                           micro_batch_tokens or config.micro_batch_tokens)
    old_policy_pass(models, groups, config, LocalRunner(models.device), refresh=refresh)


@torch.no_grad()
def fill_reference(models: TrainModels, group: list[TrainItem], runner: Runner) -> None:
    """ℓ_ref at the sampled ids of a micro-batch, under the reference weights."""
    with models.reference_model() as ref:
        forward = runner.forward(ref, group)
        for item, logits_T_V in forward.samples():
            item.ref_logprobs_T = logprobs_at(logits_T_V, item.response_ids_T.to(logits_T_V.device),
                                              item.temperature).float()
        del forward
