"""The teacher-support term: a forward KL from the selected hint's teacher top-K (plus a tail bin) to the student.

Why it exists: the top-k select surrogate (``clawloop.losses.topk``) works on the student's own top-k ids, and its
pull on a token u is proportional to the student's p_u. A token the student gives p = 0.001 but the hinted teacher
gives 0.4 (say the first word of an answer the hint prescribes) is therefore never learnt. This term is added to
the surrogate on the same samples, with the same h*, and weighted by ``support_coef``.

Per position t, with T_t the teacher's top-K ids under h* (K = ``support_k``), q_v = exp ℓ_T(v) and
p_v = exp ℓ_θ(v) (full-vocabulary log-softmax, gradient attached):

    q_tail = 1 − Σ_{v∈T_t} q_v          p_tail = 1 − Σ_{v∈T_t} p_v
    L_t    = Σ_{v∈T_t} q_v (log q_v − log p_v) + q_tail (log q_tail − log p_tail)

that is KL(q ‖ p) over K + 1 bins (T_t's ids and everything else), a proper KL (≥ 0, 0 iff the student matches
the teacher on every bin). Its gradient with respect to the student's logit z_u (τ = 1; τ divides it) is

    ∂L_t/∂z_u = p_u − q_u                    for u ∈ T_t
    ∂L_t/∂z_u = p_u (1 − q_tail / p_tail)    for u ∉ T_t

so a token the teacher wants is pulled up by q_u − p_u whatever the student's p_u, and the tail bin moves the
rest of the vocabulary as one block, keeping its shape.

Numerical care (every path finite, in values and gradients):

* 0 · log 0 := 0. A teacher log-prob of −inf (padding) or an underflowing q_v contributes exactly 0; its log is
  replaced by 0 before the product, so no −inf × 0 is ever formed.
* Tails are log(1 − Σ exp ℓ) = log1mexp(logsumexp ℓ): log(−expm1 x) near 0, log1p(−exp x) far from it.
* A teacher whose top-K holds all its mass (Σ q ≥ 1, e.g. K = V, or rounding) has q_tail = 0 exactly and its tail
  bin contributes 0.
* The student's logsumexp is clamped to ≤ −1e−7 before the tail's log, so a student tail that rounds to 0 gives
  log p_tail ≈ −16 (and no gradient through the clamp) instead of log 0.

Positions (``support_positions``): ``all`` every position; ``outside`` only where some teacher id with q > 0
is outside the old policy's top-k S^q_t (where the surrogate cannot reach it); ``entropy`` only where the
teacher's entropy over its K + 1 bins exceeds ``support_min_entropy`` nats (where the teacher is unsure, i.e.
the hint spreads mass the student may lack). Unused positions contribute 0 and still count in the token mean.

Input is ℓ_θ already gathered at the teacher ids ([T, K], from ``clawloop.losses.logsoftmax``): nothing here is
[T, V]-sized.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from clawloop.losses.presets import SUPPORT_POSITIONS, check_choice
from clawloop.losses.surrogates import masked_token_mean
from clawloop.losses.topk import TAIL_LOGSUM_MAX, TopKTargets

_LOG_HALF = -math.log(2.0)


def log1mexp(x: Tensor) -> Tensor:
    """log(1 − exp x) for x <= 0, accurate at both ends; x is clamped to <= −1e−7 so the result is finite."""
    x = x.clamp(max=TAIL_LOGSUM_MAX)
    # Both branches are finite for every x <= −1e−7 (also −inf), so torch.where's gradient has no NaN to mask.
    return torch.where(x > _LOG_HALF, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def teacher_bins(teacher_logprobs_T_K: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The teacher's K + 1 bins: (q_T_K, log_q_T_K, q_tail_T, log_q_tail_T), detached, with every log of a zero
    mass set to 0 so that q · log q is 0 there."""
    teacher_T_K = teacher_logprobs_T_K.detach()
    q_T_K = teacher_T_K.exp()
    log_q_T_K = torch.where(q_T_K > 0, teacher_T_K, torch.zeros_like(teacher_T_K))
    inside_T = torch.logsumexp(teacher_T_K, dim=-1)
    q_tail_T = (-torch.expm1(inside_T)).clamp(min=0.0)
    log_q_tail_T = torch.where(q_tail_T > 0, log1mexp(inside_T), torch.zeros_like(inside_T))
    return q_T_K, log_q_T_K, q_tail_T, log_q_tail_T


def teacher_entropy(teacher_logprobs_T_K: Tensor) -> Tensor:
    """H[t] of the teacher over its top-K ids plus the tail bin, in nats (detached)."""
    q_T_K, log_q_T_K, q_tail_T, log_q_tail_T = teacher_bins(teacher_logprobs_T_K)
    return -(q_T_K * log_q_T_K).sum(-1) - q_tail_T * log_q_tail_T


def support_positions(
    mode: str,
    teacher_ids_T_K: Tensor,
    teacher_logprobs_T_K: Tensor,
    student_ids_T_K: Tensor,
    *,
    min_entropy: float = 0.0,
) -> Tensor | None:
    """The positions the term applies to (bool [T]; None = all), per the module docstring's ``support_positions``.

    ``student_ids_T_K`` is the old policy's top-k S^q_t (its width may differ from the teacher's).
    """
    check_choice("support_positions", mode, SUPPORT_POSITIONS)
    if mode == "all":
        return None
    if mode == "outside":
        in_student_T_K = (teacher_ids_T_K.unsqueeze(-1) == student_ids_T_K.unsqueeze(-2)).any(-1)
        wanted_T_K = teacher_logprobs_T_K.detach() > -math.inf  # padding (q = 0) is not a teacher wish
        return (wanted_T_K & ~in_student_T_K).any(-1)
    return teacher_entropy(teacher_logprobs_T_K) > min_entropy


def teacher_support_kl(
    cur_at_teacher_T_K: Tensor,
    teacher_logprobs_T_K: Tensor,
    *,
    positions_T: Tensor | None = None,
) -> Tensor:
    """KL(teacher ‖ student) over the teacher's top-K ids plus one tail bin, per position ([T]; 0 where
    ``positions_T`` is False). See the module docstring for the formula, its gradient and the numerical care.

    ``cur_at_teacher_T_K`` is ℓ_θ at the teacher's ids (full-vocabulary log-softmax, gradient attached);
    ``teacher_logprobs_T_K`` is ℓ_T(h*) at the same ids (detached; −inf allowed).
    """
    if cur_at_teacher_T_K.shape != teacher_logprobs_T_K.shape:
        raise ValueError(f"current log-probs {tuple(cur_at_teacher_T_K.shape)} and teacher log-probs "
                         f"{tuple(teacher_logprobs_T_K.shape)} must have the same [T, K] shape")
    dtype = cur_at_teacher_T_K.dtype
    q_T_K, log_q_T_K, q_tail_T, log_q_tail_T = teacher_bins(teacher_logprobs_T_K.to(dtype))
    log_p_tail_T = log1mexp(torch.logsumexp(cur_at_teacher_T_K, dim=-1))
    inside_T = (q_T_K * (log_q_T_K - cur_at_teacher_T_K)).sum(-1)
    loss_T = inside_T + q_tail_T * (log_q_tail_T - log_p_tail_T)
    if positions_T is not None:
        loss_T = torch.where(positions_T.to(loss_T.device), loss_T, torch.zeros_like(loss_T))
    return loss_T


def support_metrics(
    loss_T: Tensor,
    cur_at_teacher_T_K: Tensor,
    teacher_logprobs_T_K: Tensor,
    positions_T: Tensor | None,
    mask_T: Tensor | None,
) -> dict[str, Tensor]:
    """The term's metrics (detached 0-dim tensors, masked token means): loss, positions (share of positions the
    term applies to), teacher_mass and student_mass (Σ over the teacher's top-K of q and of p), teacher_entropy
    (over its K + 1 bins)."""
    with torch.no_grad():
        dtype = loss_T.dtype
        teacher_T_K = teacher_logprobs_T_K.detach().to(dtype)
        used_T = torch.ones_like(loss_T) if positions_T is None else positions_T.to(dtype)
        return {
            "loss": masked_token_mean(loss_T.detach(), mask_T),
            "positions": masked_token_mean(used_T, mask_T),
            "teacher_mass": masked_token_mean(teacher_T_K.exp().sum(-1), mask_T),
            "student_mass": masked_token_mean(cur_at_teacher_T_K.detach().exp().sum(-1), mask_T),
            "teacher_entropy": masked_token_mean(teacher_entropy(teacher_T_K), mask_T),
        }


def support_targets(targets: TopKTargets, h_star_T: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The term's teacher side: under each position's h*, the teacher's ``k`` most likely ids among the K' it
    gave (all K' when k >= K'), as (ids_T_k long, teacher log-probs T_k)."""
    C, T, K_teacher = targets.teacher_ids_C_T_K.shape
    index_1_T_K = h_star_T.view(1, T, 1).expand(1, T, K_teacher)
    ids_T_K = targets.teacher_ids_C_T_K.gather(0, index_1_T_K).squeeze(0)
    teacher_T_K = targets.teacher_logprobs_C_T_K.gather(0, index_1_T_K).squeeze(0)
    if k < K_teacher:
        teacher_T_K, keep_T_k = teacher_T_K.topk(k, dim=-1)
        ids_T_K = ids_T_K.gather(-1, keep_T_k)
    return ids_T_K, teacher_T_K.detach()
