"""The top-k objectives: targets, overlap, hint selection, the OPD subset, top-k select OPD and the tail KL.

* top-k select (default OPD branch): overlap O[h,t] = |S^q_t ∩ S^p_{t,h}|; hint h* by ``select_hints``
  (ties → lowest index = shortest hint); subset S_t (student / teacher / overlap); per v ∈ S_t
  w_v = softmax_{S_t}(ℓ_old) and A_v = clip(ℓ_T(v) − ℓ_old(v), −c, c)·w_v (both detached; c ≤ 0 = no clip);
  L^OPD_t = Σ_{v∈S_t} L^PG_v(A_v), 0 where S_t is empty (``topk_select_loss``).
* top-k tail KL: reverse KL(student ‖ teacher) over the teacher's top-k ids plus one tail bin
  log(1 − Σ exp(top-k)); the tail's log-sum is clamped to ≤ −1e−7 so it never takes log(0) (``topk_tail_kl``).

Both take the current log-probs at the subset's ids already gathered ([T, K], from
``clawloop.losses.logsoftmax``), so nothing here is [T, V]-sized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from clawloop.losses.presets import HINT_SELECTIONS, SUBSET_MODES, check_choice
from clawloop.losses.surrogates import masked_token_mean, ppo_token_loss

TAIL_LOGSUM_MAX = -1e-7
# Teacher log-probs below this are treated as this (a padded/-inf teacher entry would otherwise make the
# tail KL inf or NaN); e^-100 is far below any mass that matters.
TEACHER_LOGPROB_FLOOR = -100.0


@dataclass
class TopKTargets:
    """Everything the top-k objectives need about the old policy and the C hint candidates of one sample.

    Student side (the old policy's own top-k, K ids per position) and teacher side (each candidate's own top-k,
    K' ids per position; K' = K unless the teacher-support term asks for more, see ``teacher_top``) are both
    stored with the log-probs of the *other* side at the same ids, so every subset mode is a pure gather. All
    log-probs are full-vocabulary, temperature-scaled.
    """

    student_ids_T_K: Tensor
    """[T, K] long: the old policy's top-k ids S^q_t."""
    student_logprobs_T_K: Tensor
    """[T, K] float: ℓ_old at ``student_ids_T_K``."""
    old_at_teacher_C_T_K: Tensor
    """[C, T, K'] float: ℓ_old at each candidate teacher's top-k ids."""
    teacher_ids_C_T_K: Tensor
    """[C, T, K'] long: each candidate teacher's own top-k ids S^p_{t,h}."""
    teacher_logprobs_C_T_K: Tensor
    """[C, T, K'] float: ℓ_T(h) at ``teacher_ids_C_T_K``."""
    teacher_at_student_C_T_K: Tensor
    """[C, T, K] float: ℓ_T(h) at ``student_ids_T_K``."""

    @property
    def num_tokens(self) -> int:
        return self.student_ids_T_K.shape[0]

    @property
    def num_candidates(self) -> int:
        return self.teacher_ids_C_T_K.shape[0]

    def validate(self, vocab_size: int | None = None, num_tokens: int | None = None) -> "TopKTargets":
        """Check shapes, dtypes, devices and id ranges; raise ValueError naming the field. Returns self."""
        def fail(msg: str) -> None:
            raise ValueError(f"TopKTargets: {msg}")

        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, Tensor):
                fail(f"{f.name} must be a torch.Tensor, got {type(value).__name__}")
            want = 2 if f.name.endswith("_T_K") and not f.name.endswith("_C_T_K") else 3
            if value.dim() != want:
                fail(f"{f.name} must have {want} dimensions, got shape {tuple(value.shape)}")
            if "_ids_" in f.name:
                if value.dtype != torch.long:
                    fail(f"{f.name} must be int64 (long), got {value.dtype}")
            elif not value.is_floating_point():
                fail(f"{f.name} must be a floating-point tensor, got {value.dtype}")
            if value.device != self.student_ids_T_K.device:
                fail(f"{f.name} is on {value.device}, student_ids_T_K on {self.student_ids_T_K.device}")
        T, K = self.student_ids_T_K.shape
        C, T_t, K_t = self.teacher_ids_C_T_K.shape
        if num_tokens is not None and T != num_tokens:
            fail(f"student_ids_T_K has {T} positions, expected {num_tokens}")
        if K < 1 or K_t < 1 or C < 1:
            fail(f"need K >= 1 and at least one candidate (K={K}, K'={K_t}, C={C})")
        expected = {
            "student_logprobs_T_K": (T, K),
            "old_at_teacher_C_T_K": (C, T, K_t),
            "teacher_ids_C_T_K": (C, T, K_t),
            "teacher_logprobs_C_T_K": (C, T, K_t),
            "teacher_at_student_C_T_K": (C, T, K),
        }
        for name, shape in expected.items():
            if tuple(getattr(self, name).shape) != shape:
                fail(f"{name} has shape {tuple(getattr(self, name).shape)}, expected {shape} "
                     f"(T={T}, K={K}, C={C}, K'={K_t})")
        for name in ("student_ids_T_K", "teacher_ids_C_T_K"):
            ids = getattr(self, name)
            if ids.numel():
                if int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size):
                    fail(f"{name} has ids outside [0, {vocab_size if vocab_size is not None else 'V'})")
                ordered = ids.sort(-1).values
                if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
                    fail(f"{name} repeats an id within a position (top-k sets must be distinct ids)")
        return self

    def teacher_top(self, k: int) -> "TopKTargets":
        """These targets with each candidate teacher's side cut to its ``k`` most likely ids (self when K' <= k).

        The teacher is asked for K' = max(topk, support_k) ids when the teacher-support term wants more than the
        subset's k; the top-k select branch and the hint selection keep reading exactly k of them.
        """
        if self.teacher_ids_C_T_K.shape[-1] <= k:
            return self
        keep_C_T_k = self.teacher_logprobs_C_T_K.topk(k, dim=-1).indices
        return replace(self, old_at_teacher_C_T_K=self.old_at_teacher_C_T_K.gather(-1, keep_C_T_k),
                       teacher_ids_C_T_K=self.teacher_ids_C_T_K.gather(-1, keep_C_T_k),
                       teacher_logprobs_C_T_K=self.teacher_logprobs_C_T_K.gather(-1, keep_C_T_k))

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "TopKTargets":
        """A copy on ``device`` (ids stay long; log-probs cast to ``dtype`` when given)."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            float_dtype = dtype if (dtype is not None and value.is_floating_point()) else None
            moved[f.name] = value.to(device=device, dtype=float_dtype)
        return TopKTargets(**moved)



def topk_overlap(student_ids_T_K: Tensor, teacher_ids_C_T_K: Tensor) -> Tensor:
    """O[h, t] = |S^q_t ∩ S^p_{t,h}| as a long [C, T] tensor (ids within a position are distinct)."""
    same_C_T_Kt_K = teacher_ids_C_T_K.unsqueeze(-1) == student_ids_T_K.unsqueeze(0).unsqueeze(-2)
    return same_C_T_Kt_K.any(-1).sum(-1)


def select_hints(overlap_C_T: Tensor, mode: str) -> Tensor:
    """h*[t] (long [T]) from the overlap matrix; every tie goes to the lowest index (the shortest hint).

    ``shortest``: 0 everywhere; ``token_optimal``: argmax_h O[h, t] per token; ``sequence_optimal``: one
    argmax_h Σ_t O[h, t] for the whole response.
    """
    check_choice("hint_selection", mode, HINT_SELECTIONS)
    C, T = overlap_C_T.shape
    if mode == "shortest" or C == 1:
        return torch.zeros(T, dtype=torch.long, device=overlap_C_T.device)
    index_C_1 = torch.arange(C, device=overlap_C_T.device).unsqueeze(-1)
    if mode == "token_optimal":
        best_T = overlap_C_T.amax(0)
        # Lowest index among the maxima, explicitly (not relying on argmax tie order).
        return torch.where(overlap_C_T == best_T, index_C_1, C).amin(0)
    totals_C = overlap_C_T.sum(-1)
    h = torch.where(totals_C == totals_C.amax(), index_C_1.squeeze(-1), C).amin()
    return h.expand(T).clone()


@dataclass
class TopKSubset:
    """The OPD vocabulary subset S_t after hint selection, as fixed-width [T, K] rows plus a validity mask."""

    ids_T_K: Tensor
    valid_T_K: Tensor
    """bool: v is in S_t (always True except in ``overlap`` mode)."""
    old_logprobs_T_K: Tensor
    teacher_logprobs_T_K: Tensor
    h_star_T: Tensor
    overlap_at_h_star_T: Tensor


def topk_subset(
    targets: TopKTargets,
    *,
    hint_selection: str = "sequence_optimal",
    subset_mode: str = "student",
    mask_T: Tensor | None = None,
) -> TopKSubset:
    """Select h* and build S_t with its ℓ_old and ℓ_T(h*) values (no current-policy quantities involved).

    ``mask_T`` keeps masked-out positions out of the ``sequence_optimal`` sum. In ``overlap`` mode ℓ_T comes
    from the teacher gathered at the student ids (equal by definition to the native values at shared ids).
    """
    check_choice("subset_mode", subset_mode, SUBSET_MODES)
    overlap_C_T = topk_overlap(targets.student_ids_T_K, targets.teacher_ids_C_T_K)
    selection_overlap_C_T = overlap_C_T
    if mask_T is not None and hint_selection == "sequence_optimal":
        selection_overlap_C_T = overlap_C_T * (mask_T > 0)
    h_star_T = select_hints(selection_overlap_C_T, hint_selection)
    T = h_star_T.shape[0]

    def at_h_star(x_C_T_K: Tensor) -> Tensor:
        return x_C_T_K.gather(0, h_star_T.view(1, T, 1).expand(1, T, x_C_T_K.shape[-1])).squeeze(0)

    overlap_at_h_star_T = overlap_C_T.gather(0, h_star_T.view(1, T)).squeeze(0)
    if subset_mode == "teacher":
        ids_T_K = at_h_star(targets.teacher_ids_C_T_K)
        old_T_K = at_h_star(targets.old_at_teacher_C_T_K)
        teacher_T_K = at_h_star(targets.teacher_logprobs_C_T_K)
        valid_T_K = torch.ones_like(ids_T_K, dtype=torch.bool)
    else:
        ids_T_K = targets.student_ids_T_K
        old_T_K = targets.student_logprobs_T_K
        teacher_T_K = at_h_star(targets.teacher_at_student_C_T_K)
        if subset_mode == "overlap":
            teacher_ids_T_Kt = at_h_star(targets.teacher_ids_C_T_K)
            valid_T_K = (ids_T_K.unsqueeze(-1) == teacher_ids_T_Kt.unsqueeze(-2)).any(-1)
        else:
            valid_T_K = torch.ones_like(ids_T_K, dtype=torch.bool)
    return TopKSubset(ids_T_K, valid_T_K, old_T_K.detach(), teacher_T_K.detach(), h_star_T, overlap_at_h_star_T)



def topk_select_loss(
    cur_logprobs_T_K: Tensor,
    subset: TopKSubset,
    *,
    adv_diff_clip: float = 1.0,
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
    mask_T: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Top-k select OPD per token: loss_T[t] = Σ_{v∈S_t} L^PG_v(A_v) (0 where S_t is empty).

    ``cur_logprobs_T_K`` is ℓ_θ at ``subset.ids_T_K`` (full-vocabulary log-softmax, gradient attached). Metrics
    (detached 0-dim tensors, masked token means): loss, clipfrac (mean over S_t of clipped entries), abs_diff
    (Σ_v w_v |clipped diff_v|), subset_size, empty_subset_frac, overlap_at_h_star, h_star_mean, teacher_mass
    (Σ_{v∈S_t} exp ℓ_T(v)).
    """
    dtype = cur_logprobs_T_K.dtype
    valid_T_K = subset.valid_T_K
    old_T_K = subset.old_logprobs_T_K.to(dtype)
    teacher_T_K = subset.teacher_logprobs_T_K.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=cur_logprobs_T_K.device)

    # w_v = softmax over S_t of ℓ_old (detached); an empty row gets all-zero weights instead of NaN.
    has_any_T_1 = valid_T_K.any(-1, keepdim=True)
    scores_T_K = torch.where(valid_T_K, old_T_K, torch.full_like(old_T_K, -math.inf))
    scores_T_K = torch.where(has_any_T_1, scores_T_K, torch.zeros_like(old_T_K))
    weights_T_K = torch.where(valid_T_K, torch.softmax(scores_T_K, dim=-1), zero)

    diff_T_K = teacher_T_K - old_T_K
    if adv_diff_clip > 0:
        diff_T_K = torch.clamp(diff_T_K, -adv_diff_clip, adv_diff_clip)
    diff_T_K = torch.where(valid_T_K, diff_T_K, zero)
    advantages_T_K = diff_T_K * weights_T_K

    token_loss_T_K, clipped_T_K = ppo_token_loss(cur_logprobs_T_K, old_T_K, advantages_T_K, eps_clip,
                                                 eps_clip_high)
    loss_T = torch.where(valid_T_K, token_loss_T_K, zero).sum(-1)

    with torch.no_grad():
        size_T = valid_T_K.sum(-1).to(dtype)
        clipfrac_T = torch.where(valid_T_K, clipped_T_K, zero).sum(-1) / size_T.clamp(min=1)
        abs_diff_T = (weights_T_K * diff_T_K.abs()).sum(-1)
        teacher_mass_T = torch.where(valid_T_K, teacher_T_K.exp(), zero).sum(-1)
        metrics = {
            "loss": masked_token_mean(loss_T.detach(), mask_T),
            "clipfrac": masked_token_mean(clipfrac_T, mask_T),
            "abs_diff": masked_token_mean(abs_diff_T, mask_T),
            "subset_size": masked_token_mean(size_T, mask_T),
            "empty_subset_frac": masked_token_mean((size_T == 0).to(dtype), mask_T),
            "overlap_at_h_star": masked_token_mean(subset.overlap_at_h_star_T.to(dtype), mask_T),
            "h_star_mean": masked_token_mean(subset.h_star_T.to(dtype), mask_T),
            "teacher_mass": masked_token_mean(teacher_mass_T, mask_T),
        }
    return loss_T, metrics



def topk_tail_kl(student_logprobs_T_K: Tensor, teacher_logprobs_T_K: Tensor) -> Tensor:
    """Reverse KL(student ‖ teacher) per position over K teacher top-k bins plus one tail bin.

    The tail bin holds log(1 − Σ_k exp ℓ_k); its log-sum is clamped to ≤ −1e−7 so rounding that pushes the
    top-k mass to 1 gives a tiny tail instead of log(0). Teacher log-probs are floored at −100 (padding).
    """
    teacher_T_K = teacher_logprobs_T_K.detach().to(student_logprobs_T_K.dtype).clamp(min=TEACHER_LOGPROB_FLOOR)

    def with_tail(logprobs_T_K: Tensor) -> Tensor:
        inside_T_1 = torch.logsumexp(logprobs_T_K, dim=-1, keepdim=True).clamp(max=TAIL_LOGSUM_MAX)
        return torch.cat([logprobs_T_K, torch.log(-torch.expm1(inside_T_1))], dim=-1)

    student_bins = with_tail(student_logprobs_T_K)
    teacher_bins = with_tail(teacher_T_K)
    return (student_bins.exp() * (student_bins - teacher_bins)).sum(-1)



def tail_kl_metrics(kl_T: Tensor, student_T_K: Tensor, teacher_T_K: Tensor,
                    mask_T: Tensor | None) -> dict[str, Tensor]:
    """The tail KL's metrics (detached 0-dim tensors, masked token means): loss, teacher_mass and student_mass
    (the top-k's probability mass under each side)."""
    with torch.no_grad():
        return {
            "loss": masked_token_mean(kl_T.detach(), mask_T),
            "teacher_mass": masked_token_mean(teacher_T_K.to(kl_T.dtype).exp().sum(-1), mask_T),
            "student_mass": masked_token_mean(student_T_K.detach().exp().sum(-1), mask_T),
        }


