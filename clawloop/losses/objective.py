"""The per-sample objective: one sample's loss (graph attached) and metrics, and the batch's metrics.

``sample_objective`` handles one sample (one [T, V] logits tensor at a time, so memory is bounded by the longest
response, not the batch):

    loss = w_rl·grpo_loss + w_opd·(opd_loss + support_coef·opd_support_loss)
           + kl_coef·ref_kl − entropy_coef·entropy

The batch objective is the plain mean of the per-sample losses over ALL samples of the batch. A fully masked
sample therefore contributes 0 yet still counts in the batch denominator (as the original's "sum of sample means"
did), so masking a sample never up-weights the others. The caller accumulates it sample by sample:

    n = len(batch); acc = MetricsAccumulator()
    for sample in batch:                       # logits for this sample only
        out = sample_objective(sample, settings)
        (out.loss / n).backward()              # gradients accumulate; the graph is freed per sample
        acc.add(out.metrics)
    metrics = acc.result()

* One chunked log-softmax (``clawloop.losses.logsoftmax``) gives every current log-prob a sample needs.
* Skipped branches. A branch whose weight is 0 is not computed at all, so ``w_opd = 0`` reproduces the GRPO loss
  bit for bit, and so does ``support_coef = 0`` the loss without the teacher-support term (its ids are not even
  gathered). A sample without an accepted hint gets no OPD term under ``opd_on_unhinted = "skip"``; under
  ``"anchor"`` the caller supplies targets computed on the un-hinted prompt and they are used as they are.
* Metrics are Python floats (detached), each a per-sample masked token mean, then a mean over the samples that
  report it. Branch losses are reported by every sample (0.0 when skipped), so the loss identity above holds for
  the batch means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from clawloop.losses.logsoftmax import logprobs_and_entropy
from clawloop.losses.presets import check_objective, method_weights, support_active
from clawloop.losses.support import support_metrics, support_positions, support_targets, teacher_support_kl
from clawloop.losses.surrogates import combine_token_loss, grpo_token_loss, k3_kl, masked_token_mean
from clawloop.losses.topk import TopKTargets, tail_kl_metrics, topk_select_loss, topk_subset, topk_tail_kl


class ObjectiveConfig(Protocol):
    """What ``ObjectiveSettings.from_config`` reads: ``clawloop.config.Config`` or its ``objective`` section."""

    method: str
    hint_selection: str
    subset_mode: str
    adv_diff_clip: float
    eps_clip: float
    eps_clip_high: float
    opd_on_unhinted: str
    kl_coef: float
    entropy_coef: float
    support_coef: float
    support_k: int
    support_positions: str
    support_min_entropy: float
    train_temperature: float

    @property
    def weights(self) -> tuple[float, float]:
        """(w_rl, w_opd) after the method preset."""
        ...


@dataclass
class ObjectiveSettings:
    """The objective's settings (named as in clawloop.config). ``w_rl`` / ``w_opd`` = None take the method's preset."""

    method: str = "hybrid"
    """Objective preset: one of ``METHODS``."""
    w_rl: float | None = None
    """Weight of the GRPO (or combine's reward) term; None = the preset's."""
    w_opd: float | None = None
    """Weight of the distillation term; None = the preset's."""
    hint_selection: str = "sequence_optimal"
    """How h* is chosen among the hint candidates: one of ``HINT_SELECTIONS``."""
    subset_mode: str = "student"
    """The OPD subset S_t: one of ``SUBSET_MODES``."""
    adv_diff_clip: float = 1.0
    """c in A_v = clip(ℓ_T(v) − ℓ_old(v), −c, c)·w_v; <= 0 disables the clip."""
    eps_clip: float = 0.2
    """PPO lower clip ε_lo."""
    eps_clip_high: float = 0.28
    """PPO upper clip ε_hi."""
    opd_on_unhinted: str = "skip"
    """OPD term of a sample without a hint: skip, or anchor (its targets are computed on the un-hinted prompt)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the reference; non-zero needs ``ref_logprobs_T`` on every sample."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus; non-zero needs ``logits_T_V``."""
    support_coef: float = 0.0
    """Weight of the teacher-support KL inside the OPD branch (``clawloop.losses.support``). 0 here is the original
    system's objective, which the pinned loss tests compare against; clawloop's config turns the term on
    (``support_coef`` there). Only methods with a top-k select OPD branch use it (``support_active``)."""
    support_k: int = 4
    """Teacher ids per position the support term reads: the k most likely of the K' the targets carry (all of
    them when K' <= support_k)."""
    support_positions: str = "all"
    """Where the support term applies: one of ``SUPPORT_POSITIONS`` (all, outside, entropy)."""
    support_min_entropy: float = 0.5
    """support_positions=entropy: the teacher entropy over its top-K plus tail (nats) a position must exceed."""
    temperature: float = 1.0
    """τ dividing the logits; 0 = each sample's own ``ObjectiveSample.temperature``."""
    track_entropy: bool = True
    """Compute the entropy metric even when entropy_coef = 0 (one extra multiply-add over [T, V])."""
    chunk_tokens: int | None = None
    """Positions per block of the chunked log-softmax; None = about 4M logits per block."""

    @property
    def weights(self) -> tuple[float, float]:
        """(w_rl, w_opd) after the method preset."""
        return method_weights(self.method, self.w_rl, self.w_opd)

    def validate(self) -> "ObjectiveSettings":
        """``check_objective`` (ValueError naming the setting), and τ >= 0 (the config's ``train_temperature``)."""
        check_objective(self)
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0")
        return self

    @classmethod
    def from_config(cls, config: ObjectiveConfig) -> "ObjectiveSettings":
        """From a ``clawloop.config.Config`` or its ``objective`` section; the weights come resolved."""
        w_rl, w_opd = config.weights
        return cls(
            method=config.method,
            w_rl=w_rl,
            w_opd=w_opd,
            hint_selection=config.hint_selection,
            subset_mode=config.subset_mode,
            adv_diff_clip=config.adv_diff_clip,
            eps_clip=config.eps_clip,
            eps_clip_high=config.eps_clip_high,
            opd_on_unhinted=config.opd_on_unhinted,
            kl_coef=config.kl_coef,
            entropy_coef=config.entropy_coef,
            support_coef=config.support_coef,
            support_k=int(config.support_k),
            support_positions=config.support_positions,
            support_min_entropy=config.support_min_entropy,
            temperature=float(config.train_temperature),
        ).validate()


@dataclass
class ObjectiveSample:
    """One training sample (one scored turn) as the objective sees it."""

    response_ids_T: Tensor
    """[T] long: the exact generated ids."""
    old_logprobs_T: Tensor
    """[T]: ℓ_old at the response ids (old-policy forward, same τ)."""
    reward: float = 0.0
    """The turn's vote r (or its group-normalised value)."""
    logits_T_V: Tensor | None = None
    """[T, V]: current raw logits at the response positions (position t predicts response token t)."""
    logprobs_T: Tensor | None = None
    """[T]: precomputed current ℓ_θ at the response ids (with grad), used only when ``logits_T_V`` is None;
    enough for the rl and combine methods, not for top-k objectives or entropy."""
    mask_T: Tensor | None = None
    """[T]: 1 = trained token; None = all ones."""
    targets: TopKTargets | None = None
    """Top-k targets of the accepted hint candidates (or, for ``anchor``, of the un-hinted prompt)."""
    teacher_logprobs_T: Tensor | None = None
    """[T]: ℓ_T at the response ids under the chosen hint (legacy combine method only)."""
    ref_logprobs_T: Tensor | None = None
    """[T]: reference-model log-probs at the response ids (k3 KL term / metric)."""
    behaviour_logprobs_T: Tensor | None = None
    """[T]: log-probs the serving engine reported when sampling (train-vs-behaviour gap metric)."""
    hinted: bool | None = None
    """Whether the turn has an accepted hint; None = "targets (or teacher_logprobs_T) were given"."""
    pg_weights_T: Tensor | None = None
    """[T]: detached multipliers of the policy-gradient token losses (e.g. truncated importance weights)."""
    temperature: float | None = None
    """This sample's τ, used when ``ObjectiveSettings.temperature`` is 0."""


@dataclass
class SampleObjective:
    loss: Tensor
    """0-dim: this sample's contribution before the batch mean
    (w_rl·GRPO + w_opd·(OPD + support_coef·support KL) + c_kl·KL − c_H·H)."""
    metrics: dict[str, float]


def _teacher_source(sample: ObjectiveSample, settings: ObjectiveSettings, available: bool) -> bool:
    """Whether this sample's distillation target is used (skip/anchor rule for samples without a hint)."""
    hinted = sample.hinted if sample.hinted is not None else available
    if hinted:
        if not available:
            raise ValueError("sample is marked hinted but carries no teacher targets")
        return True
    if settings.opd_on_unhinted == "skip":
        return False
    if not available:
        raise ValueError("opd_on_unhinted='anchor' needs teacher targets computed on the un-hinted prompt "
                         "for every sample without a hint")
    return True


def sample_objective(sample: ObjectiveSample, settings: ObjectiveSettings) -> SampleObjective:
    """The objective of one sample: its loss (graph attached) and its metrics (floats).

    The batch objective is the mean of ``loss`` over the batch's samples (see the module docstring).
    """
    method = settings.method
    w_rl, w_opd = settings.weights
    temperature = settings.temperature if settings.temperature > 0 else (sample.temperature or 1.0)
    response_ids_T = sample.response_ids_T
    T = response_ids_T.shape[0]
    device = (sample.logits_T_V if sample.logits_T_V is not None else sample.old_logprobs_T).device
    mask_T = sample.mask_T if sample.mask_T is not None else torch.ones(T, device=device)
    eps = (settings.eps_clip, settings.eps_clip_high)

    topk_method = method in ("hybrid", "rl", "opd", "topk_kl")
    use_targets = topk_method and w_opd != 0.0 and _teacher_source(sample, settings, sample.targets is not None)
    use_teacher_T = (method == "combine" and w_opd != 0.0
                     and _teacher_source(sample, settings, sample.teacher_logprobs_T is not None))

    # One chunked log-softmax gives every current log-prob this sample needs.
    subset = None
    kl_ids_T_K = kl_teacher_T_K = None
    support_ids_T_S = support_teacher_T_S = support_cur_T_S = None
    use_support = support_active(settings)
    columns = [response_ids_T.view(T, 1)]
    if use_targets:
        vocab = sample.logits_T_V.shape[1] if sample.logits_T_V is not None else None
        sample.targets.validate(vocab_size=vocab, num_tokens=T)
        # The subsets and the hint choice read k teacher ids, however many the teacher was asked for.
        targets = sample.targets.teacher_top(sample.targets.student_ids_T_K.shape[1])
        if method == "topk_kl":
            # The tail KL distils toward the selected candidate's own top-k.
            pick = topk_subset(targets, hint_selection=settings.hint_selection, subset_mode="teacher",
                               mask_T=mask_T)
            kl_ids_T_K, kl_teacher_T_K, subset = pick.ids_T_K, pick.teacher_logprobs_T_K, pick
            columns.append(kl_ids_T_K)
        else:
            subset = topk_subset(targets, hint_selection=settings.hint_selection,
                                 subset_mode=settings.subset_mode, mask_T=mask_T)
            columns.append(subset.ids_T_K)
            if use_support:
                # Same h* as the surrogate; the ids ride along in the one log-softmax below.
                support_ids_T_S, support_teacher_T_S = support_targets(sample.targets, subset.h_star_T,
                                                                       settings.support_k)
                columns.append(support_ids_T_S)
    entropy_T = None
    if sample.logits_T_V is not None:
        with_entropy = settings.track_entropy or settings.entropy_coef != 0.0
        gathered_T_N, entropy_T = logprobs_and_entropy(
            sample.logits_T_V, torch.cat(columns, dim=1), temperature, with_entropy=with_entropy,
            chunk_tokens=settings.chunk_tokens)
        if not with_entropy:
            entropy_T = None
        logprobs_T = gathered_T_N[:, 0]
        extra_T_K = gathered_T_N[:, 1:]
        if support_ids_T_S is not None:
            subset_width = subset.ids_T_K.shape[1]
            extra_T_K = gathered_T_N[:, 1:1 + subset_width]
            support_cur_T_S = gathered_T_N[:, 1 + subset_width:]
    else:
        if sample.logprobs_T is None:
            raise ValueError("a sample needs logits_T_V or precomputed logprobs_T")
        if use_targets:
            raise ValueError(f"method={method!r} with teacher targets needs logits_T_V (per-vocabulary terms)")
        if settings.entropy_coef != 0.0:
            raise ValueError("entropy_coef != 0 needs logits_T_V")
        logprobs_T = sample.logprobs_T
        extra_T_K = None
    dtype = logprobs_T.dtype
    mask_T = mask_T.to(device=logprobs_T.device)
    old_T = sample.old_logprobs_T.detach().to(dtype)

    def pg_weighted(loss_T: Tensor) -> Tensor:
        return loss_T if sample.pg_weights_T is None else loss_T * sample.pg_weights_T.detach().to(dtype)

    zero = torch.zeros((), dtype=dtype, device=logprobs_T.device)
    loss = zero
    metrics: dict[str, Tensor | float] = {}
    with torch.no_grad():
        metrics["num_tokens"] = (mask_T > 0).sum().to(dtype)
        metrics["ppo_kl"] = masked_token_mean(old_T - logprobs_T.detach(), mask_T)
        if sample.behaviour_logprobs_T is not None:
            gap_T = (logprobs_T.detach() - sample.behaviour_logprobs_T.to(dtype)).abs()
            metrics["train_behaviour_logprob_gap"] = masked_token_mean(gap_T, mask_T)

    if method == "combine":
        teacher_T = sample.teacher_logprobs_T.to(dtype) if use_teacher_T else None
        loss_T, clipped_T = combine_token_loss(logprobs_T, old_T, sample.reward, teacher_T, w_rl, w_opd, *eps)
        term = masked_token_mean(pg_weighted(loss_T), mask_T)
        loss = loss + term
        metrics["combine_loss"] = term.detach()
        metrics["combine_clipfrac"] = masked_token_mean(clipped_T, mask_T)
        metrics["combine_teacher_applied"] = 1.0 if use_teacher_T else 0.0
        if use_teacher_T:
            metrics["combine_abs_diff"] = masked_token_mean((teacher_T - old_T).abs(), mask_T)
    else:
        if w_rl != 0.0:
            loss_T, clipped_T = grpo_token_loss(logprobs_T, old_T, sample.reward, *eps)
            term = masked_token_mean(pg_weighted(loss_T), mask_T)
            loss = loss + w_rl * term
            metrics["grpo_loss"] = term.detach()
            metrics["grpo_clipfrac"] = masked_token_mean(clipped_T, mask_T)
        if w_opd != 0.0:
            prefix = "topk_kl_" if method == "topk_kl" else "opd_"
            metrics[prefix + "applied"] = 1.0 if use_targets else 0.0
            metrics[prefix + "loss"] = zero
            if use_targets:
                if method == "topk_kl":
                    kl_T = topk_tail_kl(extra_T_K, kl_teacher_T_K)
                    branch = tail_kl_metrics(kl_T, extra_T_K, kl_teacher_T_K, mask_T)
                    branch["h_star_mean"] = masked_token_mean(subset.h_star_T.to(dtype), mask_T)
                    term = masked_token_mean(kl_T, mask_T)  # no ratio: nothing to importance-weight
                else:
                    opd_T, branch = topk_select_loss(
                        extra_T_K, subset, adv_diff_clip=settings.adv_diff_clip, eps_clip=settings.eps_clip,
                        eps_clip_high=settings.eps_clip_high, mask_T=mask_T)
                    term = masked_token_mean(pg_weighted(opd_T), mask_T)
                loss = loss + w_opd * term
                branch["loss"] = term.detach()
                metrics.update({prefix + k: v for k, v in branch.items()})
            if use_support:
                metrics["opd_support_applied"] = 1.0 if use_targets else 0.0
                metrics["opd_support_loss"] = zero
            if use_support and use_targets:
                # A KL, not a policy gradient: no ratio and no importance weights (as the tail KL).
                positions_T = support_positions(settings.support_positions, support_ids_T_S, support_teacher_T_S,
                                                sample.targets.student_ids_T_K,
                                                min_entropy=settings.support_min_entropy)
                support_T = teacher_support_kl(support_cur_T_S, support_teacher_T_S, positions_T=positions_T)
                term = masked_token_mean(support_T, mask_T)
                loss = loss + (w_opd * settings.support_coef) * term
                support = support_metrics(support_T, support_cur_T_S, support_teacher_T_S, positions_T, mask_T)
                metrics.update({"opd_support_" + k: v for k, v in support.items()})

    if sample.ref_logprobs_T is not None:
        kl_T = k3_kl(logprobs_T, sample.ref_logprobs_T.to(dtype))
        term = masked_token_mean(kl_T, mask_T)
        metrics["ref_kl"] = term.detach()
        if settings.kl_coef != 0.0:
            loss = loss + settings.kl_coef * term
    elif settings.kl_coef != 0.0:
        raise ValueError("kl_coef != 0 needs ref_logprobs_T for every sample")

    if entropy_T is not None:
        term = masked_token_mean(entropy_T if settings.entropy_coef != 0.0 else entropy_T.detach(), mask_T)
        metrics["entropy"] = term.detach()
        if settings.entropy_coef != 0.0:
            loss = loss - settings.entropy_coef * term

    metrics["loss"] = loss.detach()
    return SampleObjective(loss=loss, metrics=_floats(metrics))


class MetricsAccumulator:
    """Batch metrics: each key's mean over the samples that report it, plus ``num_samples``."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._samples = 0

    def add(self, metrics: dict[str, float]) -> None:
        self._samples += 1
        for key, value in metrics.items():
            self._sums[key] = self._sums.get(key, 0.0) + float(value)
            self._counts[key] = self._counts.get(key, 0) + 1

    def parts(self) -> tuple[dict[str, float], dict[str, int], int]:
        """(sums, counts, samples), copied: what another process needs to ``merge`` these metrics into its own."""
        return dict(self._sums), dict(self._counts), self._samples

    def merge(self, sums: dict[str, float], counts: dict[str, int], samples: int) -> None:
        """Add another accumulator's ``parts()``."""
        for key, value in sums.items():
            self._sums[key] = self._sums.get(key, 0.0) + value
            self._counts[key] = self._counts.get(key, 0) + counts[key]
        self._samples += samples

    def result(self) -> dict[str, float]:
        out = {key: self._sums[key] / self._counts[key] for key in self._sums}
        out["num_samples"] = float(self._samples)
        return out


def _floats(metrics: dict[str, Tensor | float]) -> dict[str, float]:
    """Detached Python floats, with a single device sync for all tensor values."""
    keys = [k for k, v in metrics.items() if isinstance(v, Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, Tensor)}
    if keys:
        values = torch.stack([metrics[k].detach().reshape(()).to(torch.float64) for k in keys]).cpu().tolist()
        out.update(zip(keys, values))
    return out
