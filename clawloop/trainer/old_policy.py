"""The old-policy forward: what the weights *before* a step say about each sample (no gradient), and the one
teacher call per sample.

Per sample, all at the train-side temperature of its turn, from one log-softmax per response position:

* ``ℓ_old`` at the sampled ids — the PPO ratio's denominator, and (beside the behaviour log-probs the serving
  engine reported) the train-vs-behaviour gap metric and the truncated importance weights of stale samples;
* for a sample with an OPD branch (a hint, or ``opd_on_unhinted = anchor``): the old policy's own top-k ids
  S^q_t and their log-probs, the teacher's scores at exactly those ids (``clawloop.wire.TeacherScores``), and
  ``ℓ_old`` at every candidate teacher's top-k ids. The teacher returns K' = ``teacher_width(config)`` ids of its
  own per position: ``topk``, or max(topk, support_k) when the teacher-support term is on;
* ``ℓ_ref`` at the sampled ids when the KL-to-reference term is on;
* for the legacy ``combine`` method, the teacher's log-prob at each sampled id under the chosen hint.

The teacher is asked here, once per sample, for exactly what the objective needs (``TeacherClient.submit``,
one call per micro-batch covering every candidate of its samples). The call of micro-batch g runs while
micro-batch g + 1's forward runs; g's answer is collected after that forward, so the pass waits only for the
last call. With one update per batch (the fused step, ``trainer.step``) ℓ_old comes from the loss's own forward.
With one micro-batch the top-k ids do too, and the teacher is asked between that forward and the loss
(``ask_from_forward``: no later forward could overlap the call); with several, ``topk_pass`` runs a no-gradient
forward first, for the top-k ids alone, when a teacher is to be asked.
The next batch cannot be asked for in advance: its ids depend on the weights after this step.

Scores recorded with a sample at the very same ids (a step that was trained but not kept, an older store) are
used as they are (re-ordered to match) and the teacher is not asked, provided they carry at least K' teacher ids.
When the teacher fails, times out or is absent, the sample's OPD branch is left out (``TEACHER_MISSING``): its RL
branch still trains when it has a ±1 vote, and a sample with nothing left is dropped with reason ``teacher_error``
(``TEACHER_ERROR``). Every case is counted in the step metrics; a stale set is never used.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from clawloop.config import Config
from clawloop.temperature import effective_temperature
from clawloop.losses import (TopKTargets, logprobs_at, mixes, select_hints, support_active, topk_overlap,
                             truncated_importance_weights)
from clawloop.trainer.batch import TrainItem, micro_batches
from clawloop.trainer.model import TrainModels
from clawloop.trainer.runner import LocalRunner, ResponseLogits, Runner
from clawloop.trainer.teacher_client import TeacherClient
from clawloop.wire import TeacherRequest, TeacherScores

log = logging.getLogger(__name__)

TEACHER_MISSING = "teacher_missing"
"""``TrainItem.info`` key: the sample's OPD branch is left out this step (the teacher failed or is absent)."""
TEACHER_ERROR = "teacher_error"
"""Drop reason of a sample with an OPD branch and no RL branch whose teacher scores could not be had."""


def wants_opd(config: Config, item: TrainItem) -> bool:
    """Whether this sample has an OPD branch the objective would use (so the teacher must score it)."""
    _, w_opd = config.weights
    if w_opd == 0.0:
        return False
    return bool(item.sample.hints) or config.opd_on_unhinted == "anchor"


def teacher_width(config: Config) -> int:
    """K': how many of its own top ids per position the teacher is asked for. The top-k subset reads ``topk`` of
    them; the teacher-support term (``support_active``: a weight and a top-k select OPD branch) reads ``support_k``."""
    if support_active(config):
        return max(int(config.topk), int(config.support_k))
    return int(config.topk)


def mixed_target(config: Config, item: TrainItem) -> bool:
    """Whether the teacher mixes this sample's hinted rows with its un-hinted one (``opd_target``)."""
    return mixes(config.opd_target, bool(item.sample.hints))


def opd_expected(config: Config, item: TrainItem) -> bool:
    """Whether the sample trains an OPD term this step, as far as known before its loss: it wants one, and its
    teacher scores were had (or may be recorded with it)."""
    if not wants_opd(config, item) or item.info.get(TEACHER_MISSING):
        return False
    return item.scores is not None or item.recorded_scores is not None


def reset_teacher_state(items: list[TrainItem]) -> None:
    """Forget what an earlier step over the same items learnt about their top-k ids and teacher scores."""
    for item in items:
        item.student_ids_T_K, item.scores, item.targets = None, None, None
        for key in (TEACHER_MISSING, "teacher_missing_reason", "teacher_asked", "teacher_reused"):
            item.info.pop(key, None)


def mark_unscored(item: TrainItem, config: Config) -> None:
    """After a fused loss forward with no teacher to ask: a sample whose OPD branch got no scores leaves it out."""
    if wants_opd(config, item) and item.scores is None and not item.info.get(TEACHER_MISSING):
        item.info[TEACHER_MISSING] = 1.0
        item.info["teacher_missing_reason"] = "no teacher is at hand and no scores at these ids were recorded"


def match_rows(new_ids_T_K: torch.Tensor, stored_ids_T_K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each new id, its column in the stored row: (perm_T_K, row_matches_T). A row matches when both are
    the same set of ids (order may differ)."""
    same_T_K_K = new_ids_T_K.unsqueeze(-1) == stored_ids_T_K.unsqueeze(-2)
    found_T_K = same_T_K_K.any(-1)
    perm_T_K = same_T_K_K.to(torch.int8).argmax(-1)
    return perm_T_K, found_T_K.all(-1)


def recorded_at(item: TrainItem, ids_T_K: torch.Tensor, teacher_k: int = 1, *,
                mixed: bool = False) -> TeacherScores | None:
    """The sample's recorded scores re-ordered to ``ids_T_K``, when they were taken at the very same ids, carry
    at least ``teacher_k`` teacher ids per position, and are mixed (``hinted_C_T`` recorded) exactly when
    ``mixed`` asks for a mixed target."""
    recorded = item.recorded_scores
    if recorded is None or recorded.teacher_ids_C_T_K.shape[-1] < teacher_k \
            or (recorded.hinted_C_T is not None) != mixed:
        return None
    stored_ids_T_K = recorded.student_ids_T_K.to(device=ids_T_K.device, dtype=torch.long)
    if stored_ids_T_K.shape != ids_T_K.shape:
        return None
    perm_T_K, matches_T = match_rows(ids_T_K, stored_ids_T_K)
    if not bool(matches_T.all()):
        return None
    at_student_C_T_K = recorded.teacher_at_student_C_T_K.to(ids_T_K.device)
    C, T, K = at_student_C_T_K.shape
    return replace(recorded, student_ids_T_K=ids_T_K,
                   teacher_at_student_C_T_K=at_student_C_T_K.gather(2, perm_T_K.unsqueeze(0).expand(C, T, K)))


def student_topk(item: TrainItem, logits_T_V: torch.Tensor, config: Config) -> None:
    """Record the old policy's top-k ids of a sample with an OPD branch, and the recorded scores when they are at
    these very ids."""
    if not wants_opd(config, item):
        return
    ids_T_K = logits_T_V.detach().topk(int(config.topk), dim=-1).indices  # same order as the tempered log-softmax
    item.student_ids_T_K = ids_T_K
    item.scores = recorded_at(item, ids_T_K, teacher_width(config), mixed=mixed_target(config, item))
    if item.scores is not None:
        item.info["teacher_reused"] = 1.0


@torch.no_grad()
def old_side_from_logits(item: TrainItem, logits_T_V: torch.Tensor, config: Config) -> None:
    """Fill ``item`` from the old policy's raw logits at its response positions: old log-probs, importance
    weights, and — when its teacher scores are at hand — the top-k targets and the combine teacher values.
    The student top-k ids are taken here unless ``topk_pass`` took them already."""
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
    if item.student_ids_T_K is None:
        student_topk(item, logits_T_V, config)
    if item.scores is not None:
        targets_from_logits(item, logits_T_V, config)


@torch.no_grad()
def targets_from_logits(item: TrainItem, logits_T_V: torch.Tensor, config: Config) -> None:
    """The top-k targets from the old logits and the teacher's scores at the old policy's top-k ids."""
    scores = item.scores
    assert scores is not None and item.student_ids_T_K is not None
    temperature = item.temperature
    logits_T_V = logits_T_V.detach()
    device = logits_T_V.device
    student_ids_T_K = item.student_ids_T_K.to(device=device, dtype=torch.long)
    teacher_ids_C_T_K = scores.teacher_ids_C_T_K.to(device=device, dtype=torch.long)
    teacher_logprobs_C_T_K = scores.teacher_logprobs_C_T_K.to(device=device, dtype=torch.float32)
    teacher_at_student_C_T_K = scores.teacher_at_student_C_T_K.to(device=device, dtype=torch.float32)
    C, T, K_teacher = teacher_ids_C_T_K.shape
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
    if item.info.get("teacher_asked"):
        # Record-only: the student side as the teacher was asked, for the sample's record (the dashboard).
        scores.student_logprobs_T_K = student_logprobs_T_K.cpu()
        if item.old_logprobs_T is not None:
            scores.student_token_logprobs_T = item.old_logprobs_T.float().cpu()
    if config.method == "combine":
        item.info["combine_teacher"] = _combine_teacher(item, scores, config)


def _combine_teacher(item: TrainItem, scores: TeacherScores, config: Config) -> float:
    """ℓ_T at the sampled ids under the chosen hint, for the legacy combine method (stored on the item).

    Sources, best first: the teacher's log-probs at the sampled ids (``teacher_token_logprobs_C_T``, which every
    teacher answer carries); looking the id up in the top-k tables. A token found nowhere gets ℓ_T := ℓ_old (no
    distillation push on it). Returns the fraction of tokens with a real teacher value.
    """
    targets = item.targets
    old_T = item.old_logprobs_T
    assert targets is not None and old_T is not None
    device = old_T.device
    C, T, _ = targets.teacher_ids_C_T_K.shape
    ids_T = item.response_ids_T.to(device)
    found_C_T = torch.ones(C, T, dtype=torch.bool, device=device)
    if scores.teacher_token_logprobs_C_T is not None:
        at_response_C_T = scores.teacher_token_logprobs_C_T.to(device=device, dtype=torch.float32)
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
    narrowed = targets.teacher_top(targets.student_ids_T_K.shape[1])  # h* as the objective picks it
    h_star_T = select_hints(topk_overlap(narrowed.student_ids_T_K, narrowed.teacher_ids_C_T_K),
                            config.hint_selection)
    item.teacher_logprobs_T = at_response_C_T.gather(0, h_star_T.view(1, T)).squeeze(0)
    return float(found_C_T.gather(0, h_star_T.view(1, T)).float().mean())


# ---- asking the teacher --------------------------------------------------------------------------------
@dataclass
class Asked:
    """One micro-batch's teacher call in flight: the samples it covers and the answer to come."""

    items: list[TrainItem]
    future: Future[list[TeacherScores]] | None
    timeout_s: float
    started: float

    def collect(self) -> float:
        """Wait for the answer and give each sample its scores, or mark its OPD branch left out. Returns the
        seconds waited."""
        if not self.items:
            return 0.0
        t0 = time.perf_counter()
        error = "no teacher is at hand"
        answer: list[TeacherScores] | None = None
        if self.future is not None:
            try:
                answer = self.future.result(timeout=self.timeout_s)
                error = ""
            except Exception as exc:  # noqa: BLE001 - any teacher failure has the same outcome
                error = f"{type(exc).__name__}: {exc}"
        waited = time.perf_counter() - t0
        for i, item in enumerate(self.items):
            scores = answer[i] if answer is not None and i < len(answer) else None
            reason = error or _misfit(item, scores)
            if reason:
                log.warning("trainer: no teacher scores for turn %d (%s); its OPD branch is left out this step",
                            item.turn_id, reason)
                item.info[TEACHER_MISSING] = 1.0
                item.info["teacher_missing_reason"] = reason[:200]
                item.scores = None
                continue
            item.scores = scores
            item.info["teacher_asked"] = 1.0
        return waited


def _misfit(item: TrainItem, scores: TeacherScores | None) -> str:
    if scores is None:
        return "the teacher answered too few scores"
    assert item.student_ids_T_K is not None
    T, K = item.student_ids_T_K.shape
    C = max(1, len(item.sample.hints))
    if tuple(scores.teacher_at_student_C_T_K.shape) != (C, T, K) or scores.teacher_ids_C_T_K.dim() != 3 or \
            tuple(scores.teacher_ids_C_T_K.shape[:2]) != (C, T) or \
            scores.teacher_logprobs_C_T_K.shape != scores.teacher_ids_C_T_K.shape:
        return f"the teacher's scores have shape {tuple(scores.teacher_at_student_C_T_K.shape)}, expected {(C, T, K)}"
    return ""


def ask(teacher: TeacherClient | None, group: list[TrainItem], config: Config) -> Asked:
    """Submit one teacher call for the samples of ``group`` whose OPD branch has no scores yet (no blocking)."""
    items = [it for it in group if wants_opd(config, it) and it.scores is None and it.student_ids_T_K is not None
             and not it.info.get(TEACHER_MISSING)]
    future = None
    if items and teacher is not None:
        requests = [TeacherRequest(turn=it.turn, hints=list(it.sample.hints),
                                   student_ids_T_K=it.student_ids_T_K.cpu(), temperature=it.temperature,
                                   teacher_k=teacher_width(config), target=config.opd_target)
                    for it in items]
        try:
            future = teacher.submit(requests)
        except Exception as exc:  # noqa: BLE001 - a teacher that cannot even be asked is a failed call
            failed: Future[list[TeacherScores]] = Future()
            failed.set_exception(exc)
            future = failed
    return Asked(items, future, teacher.timeout_s if teacher is not None else 0.0, time.perf_counter())


# ---- the passes ------------------------------------------------------------------------------------------
@torch.no_grad()
def topk_pass(models: TrainModels, groups: list[list[TrainItem]], config: Config, runner: Runner,
              teacher: TeacherClient, *, rounds: int | None = None) -> float:
    """For the fused step: a no-gradient forward of each micro-batch for its samples' top-k ids, each
    micro-batch's teacher call submitted at once and collected after the next forward. Returns the seconds
    spent waiting for the teacher."""
    rounds = runner.rounds(len(groups)) if rounds is None else rounds
    local = any(wants_opd(config, it) and it.scores is None for group in groups for it in group)
    if not any(runner.gather(local)):  # every rank runs the same forwards, or none
        return 0.0
    waited = 0.0
    pending: Asked | None = None
    for g in range(rounds):
        group = groups[g] if g < len(groups) else []
        if runner.world == 1 and not any(wants_opd(config, it) for it in group):
            continue
        forward = runner.forward(models.causal_lm, group)
        for item, logits_T_V in forward.samples():
            student_topk(item, logits_T_V, config)
        del forward
        asked = ask(teacher, group, config)
        if pending is not None:
            waited += pending.collect()
        pending = asked
    if pending is not None:
        waited += pending.collect()
    return waited


@torch.no_grad()
def ask_from_forward(forward: ResponseLogits, group: list[TrainItem], config: Config,
                     teacher: TeacherClient) -> float:
    """For the fused step of one micro-batch: its samples' top-k ids from the loss's own forward (each sample's
    output layer runs once more, without a gradient), then the teacher's call for them, waited for. Returns the
    seconds waited."""
    if not any(wants_opd(config, it) and it.scores is None for it in group):
        return 0.0
    for item, logits_T_V in forward.samples():
        student_topk(item, logits_T_V, config)
    return ask(teacher, group, config).collect()


@torch.no_grad()
def old_policy_pass(models: TrainModels, groups: list[list[TrainItem]], config: Config, runner: Runner, *,
                    teacher: TeacherClient | None = None, rounds: int | None = None) -> float:
    """The separate old-policy (and reference) forward over this process's micro-batches ``groups``, filling
    each item and asking the teacher (see the module docstring); ``rounds`` (``runner.rounds``) keeps every
    rank's forwards in step. No gradient is kept, so memory is one layer's activations at a time, plus the
    previous micro-batch's forward until its teacher answer is in. Returns the seconds spent waiting for the
    teacher."""
    rounds = runner.rounds(len(groups)) if rounds is None else rounds
    reset_teacher_state([it for group in groups for it in group])
    waited = 0.0
    pending: tuple[ResponseLogits, Asked] | None = None
    for g in range(rounds):
        group = groups[g] if g < len(groups) else []
        forward = runner.forward(models.causal_lm, group)
        for item, logits_T_V in forward.samples():
            old_side_from_logits(item, logits_T_V, config)
        asked = ask(teacher, group, config)
        if pending is not None:
            waited += _finish(*pending, config)
        pending = (forward, asked)
        del forward
        if models.use_reference:
            fill_reference(models, group, runner)
    if pending is not None:
        waited += _finish(*pending, config)
    return waited


def _finish(forward: ResponseLogits, asked: Asked, config: Config) -> float:
    """Collect a micro-batch's teacher answer and build the targets of the samples it scored from that
    micro-batch's old logits (the output layer runs again for them)."""
    waited = asked.collect()
    scored = {id(it) for it in asked.items if it.scores is not None}
    if scored:
        for item, logits_T_V in forward.samples():
            if id(item) in scored:
                targets_from_logits(item, logits_T_V, config)
    return waited


def fill_old_side(models: TrainModels, items: list[TrainItem], config: Config, *,
                  micro_batch_size: int | None = None, teacher: TeacherClient | None = None,
                  micro_batch_tokens: int | None = None) -> None:
    """``old_policy_pass`` over ``items`` in this process's micro-batches."""
    groups = micro_batches(items, micro_batch_size or config.micro_batch_size,
                           micro_batch_tokens or config.micro_batch_tokens)
    old_policy_pass(models, groups, config, LocalRunner(models.device), teacher=teacher)


@torch.no_grad()
def fill_reference(models: TrainModels, group: list[TrainItem], runner: Runner) -> None:
    """ℓ_ref at the sampled ids of a micro-batch, under the reference weights."""
    with models.reference_model() as ref:
        forward = runner.forward(ref, group)
        for item, logits_T_V in forward.samples():
            item.ref_logprobs_T = logprobs_at(logits_T_V, item.response_ids_T.to(logits_T_V.device),
                                              item.temperature).float()
        del forward


def teacher_metrics(items: list[TrainItem]) -> dict[str, float]:
    """How each sample's OPD branch got its teacher scores this step."""
    mixed = [it.scores.hinted_C_T.float().mean() for it in items
             if it.scores is not None and it.scores.hinted_C_T is not None and it.scores.hinted_C_T.numel()]
    out = {
        "teacher_asked": float(sum(1 for it in items if it.info.get("teacher_asked"))),
        "teacher_reused": float(sum(1 for it in items if it.info.get("teacher_reused"))),
        "teacher_missing": float(sum(1 for it in items if it.info.get(TEACHER_MISSING))),
    }
    if mixed:  # the share of positions whose target is the hinted row, over the samples with a mixed target
        out["teacher_hinted_share"] = float(torch.stack(mixed).mean())
    return out
