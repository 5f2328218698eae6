"""One training step over a batch of samples: old-policy side, objective, gradient, AdamW update.

This is the only step: the embedded and offline trainers run it with a ``LocalRunner``, each rank of the
``torchrun`` trainer with an ``FSDPRunner`` (``trainer.runner`` is the seam; docs/trainer.md).

Choices:

* The objective is ``clawloop.losses.sample_objective`` for every method and for both full fine-tuning and
  LoRA; the trainer only feeds it tensors. Batch loss = mean over the step's samples of each sample's loss:
  every sample's loss is divided by the whole batch's size, on every rank.
* Rewards (GRPO advantages, with group normalisation and ``advantage_mode``) are computed over the whole
  batch before it is split between ranks, so a group's normalisation sees every member.
* Memory (``LocalRunner``): a micro-batch runs the decoder once over prompt + response; its final hidden
  states are cut from the graph, and each sample then gets its output-layer logits ``[T_i, V]`` at its
  response positions only, its objective, and its own backward. Gradients accumulate over micro-batches, then
  one optimizer update. Micro-batches are bounded by ``micro_batch_tokens`` as well as ``micro_batch_size``,
  and a long one recomputes its decoder activations in the backward (``gradient_checkpointing``,
  ``clawloop.trainer.recompute``), so memory grows linearly with the tokens (docs/training-memory.md).
* Old-policy side: with one update per batch (``steps_per_batch = 1``, the default) the old policy *is* the
  current policy before the update, so ℓ_old and the student top-k are read (detached) from the very logits
  the loss uses — one forward instead of two, and ρ = 1 exactly. When a teacher is to be asked, the top-k ids
  of a step of one micro-batch (the usual CPU step) come from that forward too, and the teacher is asked before
  its loss (``old_policy.ask_from_forward``); with several micro-batches a no-gradient forward first takes the
  top-k ids alone, so each micro-batch's teacher call runs while the next one's forward goes on
  (``old_policy.topk_pass``).
  With several PPO epochs a separate no-grad forward (``old_policy.old_policy_pass``) runs first, asking the
  teacher on the way, and every epoch reuses it. Advantages are computed once the teacher's answers are in.
* AdamW with the configured lr, betas and weight decay; the global gradient norm is clipped at ``grad_clip``.
* Non-finite numbers stay with the sample that made them: a sample whose loss, or whose gradient on its own
  logits, is not finite is left out of the update (``finite_share``) and reported with its reason
  (``excluded_samples``); the rest of the batch trains. An update whose global gradient is still not finite is
  skipped (``updates_applied`` < epochs in the metrics), and the trainer then neither commits nor publishes it.
* An epoch that raises after an update was applied (a later PPO epoch's out-of-memory) ends the step with the
  updates made (``epochs_cut_short`` in the metrics): raising would give back a batch already in the weights, to
  be trained twice. One that raises before any update raises, and the batch goes back untrained.
* The model runs in eval mode (no dropout) throughout.
* A sample whose teacher scores could not be had trains its RL term only (counted: ``teacher_missing``, and
  ``anchor_missing`` for an un-hinted sample under ``opd_on_unhinted = anchor``), rather than failing the
  step for the whole batch; one with no RL term (vote 0, or a method without the GRPO branch) is left out and
  dropped with reason ``teacher_error``.
* The retain term (``retain``, ``clawloop.trainer.retain``), when given, adds its gradient to each epoch's before
  the clip, so one update carries both; an epoch no sample reached makes no update, the retain term included.
* Metrics: each epoch's per-sample metrics are gathered from every rank and merged, then averaged over epochs,
  so every runner reports the whole batch under the same keys.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter, defaultdict
from typing import Any

import torch

from clawloop.config import Config
from clawloop.memory import training_allocations
from clawloop.losses import MetricsAccumulator, ObjectiveSample, ObjectiveSettings, group_normalized_rewards, \
    sample_objective, shape_advantages
from clawloop.trainer.batch import TrainItem, micro_batches
from clawloop.trainer.model import TrainModels
from clawloop.trainer.old_policy import TEACHER_ERROR, TEACHER_MISSING, ask_from_forward, fill_reference, \
    mark_unscored, old_policy_pass, old_side_from_logits, opd_expected, reset_teacher_state, teacher_metrics, \
    topk_pass
from clawloop.trainer.retain import RetainTerm
from clawloop.trainer.rollouts import is_rollout
from clawloop.trainer.runner import LocalRunner, Runner, scalar
from clawloop.trainer.teacher_client import TeacherClient

log = logging.getLogger(__name__)


def make_optimizer(models: TrainModels, config: Config) -> torch.optim.Optimizer:
    params = models.trainable_parameters()
    if not params:
        raise RuntimeError("the model has no trainable parameters")
    beta1, beta2 = config.adam_betas
    return torch.optim.AdamW(params, lr=config.learning_rate, betas=(beta1, beta2), eps=config.adam_eps,
                             weight_decay=config.weight_decay)


def zero_momentum(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's first moment set to zero, its second moment and step counts kept. Element by element, so every rank
    of a sharded optimizer does the same to its shard."""
    for state in optimizer.state.values():
        if "exp_avg" in state:
            state["exp_avg"].zero_()


def rewards_for(items: list[TrainItem], config: Config) -> list[float]:
    """Each sample's GRPO advantage: its reward (with ``group_norm``, normalised within groups of samples sharing a
    prompt), then shaped across the batch by ``advantage_mode`` (docs/collapse-fix.md). A student rollout has no
    vote, so its advantage is 0 whatever the mode, and it is not counted in the batch's shaping either."""
    voted = [i for i, it in enumerate(items) if not is_rollout(it)]
    out = [0.0] * len(items)
    if not voted:
        return out
    stored = [items[i] for i in voted]
    rewards = group_rewards(stored, config)
    _, w_opd = config.weights
    hinted_B = torch.tensor([w_opd != 0.0 and bool(it.sample.hints) and opd_expected(config, it)
                             for it in stored], dtype=torch.bool)
    shaped = shape_advantages(torch.tensor(rewards, dtype=torch.float64), hinted_B, config.advantage_mode).tolist()
    for i, value in zip(voted, shaped):
        out[i] = value
    return out


def group_rewards(items: list[TrainItem], config: Config) -> list[float]:
    """Each sample's reward; with ``group_norm``, normalised within groups of samples sharing a prompt."""
    rewards = [float(it.sample.reward) for it in items]
    if not config.group_norm:
        return rewards
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for i, it in enumerate(items):
        groups[tuple(it.turn.prompt_ids)].append(i)
    out = list(rewards)
    for members in groups.values():
        if len(members) > 1:
            normed = group_normalized_rewards(torch.tensor([rewards[i] for i in members], dtype=torch.float32))
            for i, value in zip(members, normed.tolist()):
                out[i] = value
    return out


def objective_sample(item: TrainItem, logits_T_V: torch.Tensor, reward: float) -> ObjectiveSample:
    hinted = bool(item.sample.hints) and item.targets is not None
    return ObjectiveSample(
        response_ids_T=item.response_ids_T.to(logits_T_V.device),
        old_logprobs_T=item.old_logprobs_T,
        reward=reward,
        logits_T_V=logits_T_V,
        targets=item.targets,
        teacher_logprobs_T=item.teacher_logprobs_T,
        ref_logprobs_T=item.ref_logprobs_T,
        behaviour_logprobs_T=item.behaviour_logprobs_T.to(logits_T_V.device),
        hinted=hinted,
        pg_weights_T=item.token_weights_T,
        temperature=item.temperature,
    )


def settings_for(item: TrainItem, settings: ObjectiveSettings) -> ObjectiveSettings:
    """``anchor`` needs targets on the un-hinted prompt; a sample without them (its teacher call failed) trains its
    RL term only instead of failing the whole step."""
    if settings.opd_on_unhinted == "anchor" and item.targets is None:
        if not item.sample.hints:
            item.info["anchor_missing"] = 1.0
        return dataclasses.replace(settings, opd_on_unhinted="skip")
    return settings


EXCLUDED = "excluded_nonfinite"
"""``TrainItem.info`` key of a sample left out of the update, with the reason (``NONFINITE_LOSS``,
``NONFINITE_GRADIENT``, or ``old_policy.TEACHER_ERROR`` for a sample whose only branch needed teacher scores that
could not be had); the trainer drops such a sample with that reason instead of committing it."""
NONFINITE_LOSS = "nonfinite_loss"
NONFINITE_GRADIENT = "nonfinite_gradient"
UPDATE_SKIPPED = "update_skipped_nonfinite"
"""Drop reason of a sample that was in two updates skipped as non-finite (no single sample was to blame)."""


def finite_share(loss: torch.Tensor, logits_T_V: torch.Tensor) -> tuple[torch.Tensor | None, str | None]:
    """One sample's part of the update, or why it has none: (surrogate, None) or (None, reason).

    A sample whose loss, or whose gradient on its own logits, is not finite would turn the whole batch's summed
    gradient into NaN (and the update into a skip). Its logits gradient is taken here, checked, and handed on as
    the surrogate ``sum(logits * g)``, whose gradient on the logits is exactly ``g``: the parameters get the very
    gradient ``loss.backward()`` would give them, and one sample's bad numbers stay its own. A loss with no graph
    (no active term) has no share: (None, None)."""
    if not bool(torch.isfinite(loss.detach()).all()):
        return None, NONFINITE_LOSS
    if not loss.requires_grad:
        return None, None
    (grad_T_V,) = torch.autograd.grad(loss, logits_T_V)
    if not bool(torch.isfinite(grad_T_V).all()):
        return None, NONFINITE_GRADIENT
    return (logits_T_V * grad_T_V).sum(), None


def update_applied(metrics: dict[str, Any]) -> bool:
    """Whether a ``train_step`` changed the weights at all. One that did not (every update skipped or empty) is
    never committed as a step, gated or published: the weights are the ones already served."""
    return float(metrics.get("updates_applied", 0.0)) > 0


class VoidedUpdates:
    """Which samples were in an update skipped as non-finite. Such a batch goes back to ready once; a sample in
    a second one is dropped (``UPDATE_SKIPPED``), so no sample can stall training forever. In memory: a restart
    gives every sample its second chance again."""

    def __init__(self) -> None:
        self.times: Counter[int] = Counter()

    def second_time(self, items: list[TrainItem]) -> list[int]:
        """Count ``items`` as voided once more; the turn ids now voided twice (to drop, the rest to release)."""
        self.times.update(it.turn_id for it in items)
        return [it.turn_id for it in items if self.times[it.turn_id] >= 2]


def excluded_samples(items: list[TrainItem]) -> list[tuple[int, str]]:
    """(turn id, reason) of every sample ``train_step`` left out of the update."""
    return [(it.turn_id, str(it.info[EXCLUDED])) for it in items if EXCLUDED in it.info]


def nothing_left(item: TrainItem, config: Config) -> bool:
    """A sample whose OPD branch lost its teacher scores and that has no RL branch (a vote of 0, or a method
    without one: ``opd``, ``topk_kl``, ``w_rl = 0``) is left out of the update and dropped with reason
    ``TEACHER_ERROR`` (marked on the item); True when so. Committed as trained, it would be used up untrained."""
    if EXCLUDED in item.info and item.info[EXCLUDED] == TEACHER_ERROR:
        return True
    no_rl_branch = config.weights[0] == 0.0 or float(item.sample.reward) == 0.0
    if item.info.get(TEACHER_MISSING) and no_rl_branch:
        item.info[EXCLUDED] = TEACHER_ERROR
        return True
    return False


def share_teacher_outcomes(items: list[TrainItem], mine: list[TrainItem], runner: Runner) -> None:
    """Every rank learns which samples lost their OPD branch (the advantages of the whole batch depend on it)."""
    missing = {it.turn_id: str(it.info.get("teacher_missing_reason", ""))
               for it in mine if it.info.get(TEACHER_MISSING)}
    for part in runner.gather(missing):
        for it in items:
            if it.turn_id in part:
                it.info[TEACHER_MISSING] = 1.0
                it.info["teacher_missing_reason"] = part[it.turn_id]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(models: TrainModels, optimizer: torch.optim.Optimizer, items: list[TrainItem], config: Config,
               *, teacher: TeacherClient | None = None, fuse_old: bool | None = None,
               ask_in_loss_forward: bool | None = None, runner: Runner | None = None,
               retain: RetainTerm | None = None) -> dict[str, Any]:
    """Train on ``items`` (``steps_per_batch`` updates) and return the step's metrics (floats). Under an
    ``FSDPRunner`` every rank calls this with the whole batch; each trains its share and all return the
    whole batch's metrics. ``teacher`` scores the samples' OPD branches at the old policy's top-k ids
    (``trainer.old_policy``); without one only scores recorded at those very ids are used. ``retain`` adds the
    retain term to every update (one process only). ``ask_in_loss_forward`` (None: whenever it can) takes the
    top-k ids from the loss's own forward instead of a no-gradient forward before it; it can with one update,
    one process and one micro-batch."""
    with training_allocations():  # long steps keep no freed activations resident (clawloop.memory)
        return _train_step(models, optimizer, items, config, teacher=teacher, fuse_old=fuse_old,
                           ask_in_loss_forward=ask_in_loss_forward, runner=runner, retain=retain)


def _train_step(models: TrainModels, optimizer: torch.optim.Optimizer, items: list[TrainItem], config: Config,
                *, teacher: TeacherClient | None, fuse_old: bool | None, ask_in_loss_forward: bool | None,
                runner: Runner | None, retain: RetainTerm | None) -> dict[str, Any]:
    if not items:
        raise ValueError("train_step needs at least one sample")
    t_start = time.perf_counter()
    runner = runner or LocalRunner(models.device)
    if retain is not None and runner.world > 1:
        raise ValueError("the retain term runs in one process only (retain_coef > 0 with several ranks)")
    settings = ObjectiveSettings.from_config(config)
    epochs = int(config.steps_per_batch)
    fuse = (epochs == 1) if fuse_old is None else (fuse_old and epochs == 1)
    device = runner.device
    n = len(items)
    mine = runner.shard(n)
    index_of = {id(it): i for i, it in enumerate(items)}
    groups = micro_batches([items[i] for i in mine], config.micro_batch_size, config.micro_batch_tokens)
    rounds = runner.rounds(len(groups))
    timings: dict[str, float] = defaultdict(float)
    params = models.trainable_parameters()

    reset_teacher_state(items)
    for it in items:
        if it.info.get(EXCLUDED) == TEACHER_ERROR:
            del it.info[EXCLUDED]
    # With one micro-batch the no-gradient forward before the loss's own would only read the top-k ids the loss's
    # forward reads too: its teacher call has no later forward to overlap. That forward is skipped; the teacher is
    # asked between the loss's forward and its loss (on a CPU step of OpenClaw-sized prompts, one decoder forward
    # of about five).
    can_ask_late = fuse and teacher is not None and runner.world == 1 and len(groups) == 1
    ask_late = can_ask_late if ask_in_loss_forward is None else (ask_in_loss_forward and can_ask_late)
    if (not fuse or teacher is not None) and not ask_late:
        t0 = time.perf_counter()
        if fuse:
            assert teacher is not None
            timings["time_teacher_wait_s"] += topk_pass(models, groups, config, runner, teacher, rounds=rounds)
        else:
            timings["time_teacher_wait_s"] += old_policy_pass(models, groups, config, runner, teacher=teacher,
                                                              rounds=rounds)
        _sync(device)
        timings["time_old_forward_s"] += time.perf_counter() - t0
        share_teacher_outcomes(items, [items[i] for i in mine], runner)
    # Over the whole batch on every rank (group norms see every sample), once the teacher's answers are in.
    rewards = None if ask_late else rewards_for(items, config)

    epoch_parts: list[tuple[dict[str, float], dict[str, int], int]] = []
    excluded: set[int] = set()  # id() of the samples left out: loss or gradient not finite, or teacher_error
    for i in mine:
        if nothing_left(items[i], config):
            excluded.add(id(items[i]))
    grad_norms: list[float] = []
    retain_kls: list[float] = []
    retain_skipped = retain.skipped if retain is not None else 0
    retain_behind = retain.taken_behind_hint if retain is not None else 0
    skipped = 0
    empty = 0
    checkpointed = 0
    stepped = 0  # optimizer updates applied
    for epoch in range(epochs):
        try:
            optimizer.zero_grad(set_to_none=True)
            acc = MetricsAccumulator()
            # Stored samples of this rank whose share reached the gradient this epoch. A student rollout's share
            # counts only beside one of them: rollouts alone (every stored sample left out) make no update.
            contributed = 0
            for g in range(rounds):
                group = groups[g] if g < len(groups) else []  # [] keeps FSDP's collectives in step
                if fuse and models.use_reference:
                    t0 = time.perf_counter()
                    fill_reference(models, group, runner)
                    timings["time_old_forward_s"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                forward = runner.forward(models.causal_lm, group, checkpointing=config.gradient_checkpointing)
                checkpointed += int(forward.recomputed)
                _sync(device)
                timings["time_forward_s"] += time.perf_counter() - t0
                if rewards is None:  # ask_late: the teacher's answers come in now
                    assert teacher is not None
                    t0 = time.perf_counter()
                    timings["time_teacher_wait_s"] += ask_from_forward(forward, group, config, teacher)
                    timings["time_old_forward_s"] += time.perf_counter() - t0
                    rewards = rewards_for(items, config)
                assert rewards is not None
                t0 = time.perf_counter()
                for item, logits_T_V in forward.samples():
                    if id(item) in excluded:
                        continue  # left out in an earlier epoch: it adds nothing to this update either
                    if fuse:
                        old_side_from_logits(item, logits_T_V, config)
                        mark_unscored(item, config)
                        if nothing_left(item, config):
                            excluded.add(id(item))
                            continue
                    result = sample_objective(objective_sample(item, logits_T_V, rewards[index_of[id(item)]]),
                                              settings_for(item, settings))
                    # The whole batch's n: the sum over ranks is the batch mean.
                    share, reason = finite_share(result.loss / n, logits_T_V)
                    if reason is not None:
                        excluded.add(id(item))
                        item.info[EXCLUDED] = reason
                        continue
                    if share is not None:
                        forward.add_loss(share)
                        contributed += int(not is_rollout(item))
                    acc.add(result.metrics)
                    del logits_T_V, result, share
                _sync(device)
                timings["time_loss_s"] += time.perf_counter() - t0
                t0 = time.perf_counter()
                forward.backward()
                del forward
                _sync(device)
                timings["time_backward_s"] += time.perf_counter() - t0
            reached = sum(runner.gather(contributed))
            if retain is not None and reached:
                t0 = time.perf_counter()
                retain_kls.append(retain.backward(models.causal_lm, device))
                _sync(device)
                timings["time_retain_s"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            max_norm = config.grad_clip if config.grad_clip > 0 else float("inf")
            grad_norm = scalar(torch.nn.utils.clip_grad_norm_(params, max_norm))  # the same on every rank
            if not math.isfinite(grad_norm):
                skipped += 1
            elif reached == 0:
                empty += 1  # no sample reached the gradient: no update (weight decay alone would still move weights)
            else:
                optimizer.step()
                stepped += 1
            optimizer.zero_grad(set_to_none=True)
            _sync(device)
            timings["time_optimizer_s"] += time.perf_counter() - t0
            grad_norms.append(grad_norm)
            epoch_parts.append(acc.parts())
        except Exception:
            # An epoch after an applied update failed (a later epoch's OOM, say). The batch is in the weights now:
            # raising would give its samples back to be trained again. In one process the step ends with the
            # updates it made; across ranks a failure is the job's, and its restart requeues after the checkpoint.
            if stepped == 0 or runner.world > 1:
                raise
            log.exception("train_step: epoch %d of %d failed after %d update(s); the step ends with those",
                          epoch + 1, epochs, stepped)
            optimizer.zero_grad(set_to_none=True)
            break
    epochs_run = len(epoch_parts)

    # Every rank's per-sample metrics (per epoch) and item info, so each reports the whole batch.
    parts = runner.gather((epoch_parts, {items[i].turn_id: items[i].info for i in mine}))
    for _, infos in parts:
        for it in items:
            if it.turn_id in infos and infos[it.turn_id] is not it.info:
                it.info.update(infos[it.turn_id])
    metrics: dict[str, Any] = mean_dicts([_merged([p[0][e] for p in parts]) for e in range(epochs_run)])
    metrics.update(timings)
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
    finite_kls = [v for v in retain_kls if math.isfinite(v)]
    if finite_kls:
        metrics["retain_kl"] = sum(finite_kls) / len(finite_kls)
    if retain is not None:
        metrics["retain_applied"] = 1.0 if finite_kls else 0.0
        metrics["retain_skipped_nonfinite"] = float(retain.skipped - retain_skipped)
        metrics["retain_behind_hint"] = float(retain.taken_behind_hint - retain_behind)
    metrics["updates_skipped_nonfinite"] = float(skipped)
    metrics["updates_applied"] = float(stepped)
    metrics["epochs_cut_short"] = float(epochs - epochs_run)
    stored = [it for it in items if not is_rollout(it)]  # what the store holds; rollouts are not in it
    metrics["samples_excluded_nonfinite"] = float(sum(1 for it in stored if it.info.get(EXCLUDED) in
                                                      (NONFINITE_LOSS, NONFINITE_GRADIENT)))
    metrics["samples_dropped_teacher_error"] = float(sum(1 for it in stored if it.info.get(EXCLUDED) == TEACHER_ERROR))
    metrics["lr"] = float(optimizer.param_groups[0]["lr"])
    metrics["samples"] = float(len(stored))
    metrics["world_size"] = float(runner.world)
    metrics["checkpointed_micro_batches"] = float(checkpointed) / max(1, epochs_run)
    metrics["max_sample_tokens"] = float(max(int(it.input_ids_L.numel()) for it in items))
    metrics["tokens"] = float(sum(it.response_len for it in items))
    metrics["step_time_s"] = time.perf_counter() - t_start
    metrics.update(item_metrics(items))
    voted = [a for a, it in zip(rewards, items) if not is_rollout(it)]  # rollouts have no vote
    metrics["advantage_mean"] = sum(voted) / max(1, len(voted))
    metrics["advantage_negative_mean"] = sum(min(a, 0.0) for a in voted) / max(1, len(voted))
    return metrics


def _merged(parts: list[tuple[dict[str, float], dict[str, int], int]]) -> dict[str, float]:
    acc = MetricsAccumulator()
    for sums, counts, samples in parts:
        acc.merge(sums, counts, samples)
    return acc.result()


def mean_dicts(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for d in dicts for k in d}
    return {k: sum(d[k] for d in dicts if k in d) / sum(1 for d in dicts if k in d) for k in keys}


def item_metrics(items: list[TrainItem]) -> dict[str, float]:
    """Behaviour-vs-old gap, sample policy versions, how the teacher scores were had, importance weights."""
    versions = [it.turn.policy_version for it in items]
    voted = [float(it.sample.reward) for it in items if not is_rollout(it)]  # rollouts have no vote
    out = {
        "old_behaviour_logprob_gap": sum(it.info.get("behaviour_gap", 0.0) for it in items) / len(items),
        "sample_version_min": float(min(versions)),
        "sample_version_max": float(max(versions)),
        "sample_version_mean": sum(versions) / len(versions),
        "hinted_samples": float(sum(1 for it in items if it.sample.hints and not is_rollout(it))),
        "context_samples": float(sum(1 for it in items if it.sample.kind == "context")),
        "rollout_samples": float(sum(1 for it in items if is_rollout(it))),
        "reward_mean": sum(voted) / max(1, len(voted)),
    }
    out.update(teacher_metrics(items))
    tis = [it.info["tis_weight_mean"] for it in items if "tis_weight_mean" in it.info]
    if tis:
        out["tis_weight_mean"] = sum(tis) / len(tis)
    out["anchor_missing"] = float(sum(it.info.get("anchor_missing", 0.0) for it in items))
    combine = [it.info["combine_teacher"] for it in items if "combine_teacher" in it.info]
    if combine:
        out["combine_teacher_found_frac"] = sum(combine) / len(combine)
    return out
