"""The training objectives of clawloop (docs/method.md, section 4): pure functions on tensors, no I/O, no model.

Notation for one sample with T response tokens (shape suffixes: T tokens, V vocabulary, K top-k width,
C hint candidates, N gathered ids per token):

    ℓ_θ   current log-prob   log softmax(logits / τ)       (full vocabulary, gradient flows)
    ℓ_old old-policy log-prob (the trainer's forward before the step; detached input)
    ℓ_T   teacher log-prob under the hint-augmented prompt (detached input)
    ρ     exp(clamp(ℓ_θ − ℓ_old, −20, 20))
    L^PG(A) = max(−ρ·A, −clip(ρ, 1−ε_lo, 1+ε_hi)·A)                        (``ppo_token_loss``)

Objectives (each returns a per-token loss; aggregation is separate):

* GRPO:           A_t = r (the turn's vote, optionally group-normalised, then shaped across the batch by
                  ``shape_advantages``) for every response token.
* legacy combine: A_t = w_opd·(ℓ_T − ℓ_old) + w_rl·r, one PPO surrogate on the sampled token.
* top-k tail KL:  reverse KL(student ‖ teacher) over the teacher's top-k ids plus one tail bin
                  log(1 − Σ exp(top-k)); the tail's log-sum is clamped to ≤ −1e−7 so it never takes log(0).
* top-k select (default OPD branch): overlap O[h,t] = |S^q_t ∩ S^p_{t,h}|; hint h* by ``select_hints``
  (ties → lowest index = shortest hint); subset S_t (student / teacher / overlap); per v ∈ S_t
  w_v = softmax_{S_t}(ℓ_old) and A_v = clip(ℓ_T(v) − ℓ_old(v), −c, c)·w_v (both detached; c ≤ 0 = no clip);
  L^OPD_t = Σ_{v∈S_t} L^PG_v(A_v), 0 where S_t is empty.
* k3 KL to a reference: δ = ℓ_ref − ℓ_θ, e^δ − 1 − δ, clamped to [−10, 10] ("low_var_kl"); δ itself is
  clamped to ±20 first, which never changes the clamped value but keeps e^δ finite (no inf·0 = NaN in backward).
* entropy of softmax(logits / τ) over the full vocabulary.

Algorithmic choices:

* Memory. Every current log-prob comes from ONE log-softmax per position, computed block by block over positions
  inside a custom autograd Function (``logprobs_and_entropy`` / ``logprobs_at``): the forward gathers the N ids
  each objective needs and keeps nothing [T, V]-sized; the backward recomputes each block's softmax and writes the
  gradient straight into a single [T, V] buffer. Peak extra memory is one [T, V] gradient plus one block (about
  1.1x a float32 [T, V] tensor at V = 151,936; benchmarks/losses.py), never a copy of the logits per top-k column.
  The objectives themselves only ever see [T, N] tensors. Logits must be finite.
* Aggregation (``masked_token_mean`` then ``batch_mean``): each sample's token losses are averaged over its
  masked-in response tokens with denominator max(1, Σ m); the batch loss is the plain mean of those per-sample
  values over ALL samples of the batch. A fully masked sample therefore contributes 0 yet still counts in the
  batch denominator (as the original's "sum of sample means" did), so masking a sample never up-weights the others.
* Skipped branches. A branch whose weight is 0 is not computed at all, so ``w_opd = 0`` reproduces the GRPO loss
  bit for bit. A sample without an accepted hint gets no OPD term under ``opd_on_unhinted = "skip"``; under
  ``"anchor"`` the caller supplies targets computed on the un-hinted prompt and they are used as they are.
* Per-sample use. ``sample_objective`` handles one sample (one [T, V] logits tensor at a time, so memory is
  bounded by the longest response, not the batch). The batch objective is the mean of the per-sample losses:

      n = len(batch); acc = MetricsAccumulator()
      for sample in batch:                       # logits for this sample only
          out = sample_objective(sample, settings)
          (out.loss / n).backward()              # gradients accumulate; the graph is freed per sample
          acc.add(out.metrics)
      metrics = acc.result()

  ``compute_objective`` does the same in one call when all samples fit in memory.
* Metrics are Python floats (detached), each a per-sample masked token mean, then a mean over the samples that
  report it. Branch losses are reported by every sample (0.0 when skipped), so
  loss = w_rl·grpo_loss + w_opd·opd_loss + kl_coef·ref_kl − entropy_coef·entropy holds for the batch means.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

# The choices, the method presets and the bounds of the settings are clawloop.config's (one source of truth).
from clawloop.config import (ADVANTAGE_MODES, HINT_SELECTIONS, METHOD_WEIGHTS, METHODS, OPD_ON_UNHINTED,
                             SUBSET_MODES, check_objective, method_weights)

LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0
TAIL_LOGSUM_MAX = -1e-7
# Teacher log-probs below this are treated as this (a padded/-inf teacher entry would otherwise make the
# tail KL inf or NaN); e^-100 is far below any mass that matters.
TEACHER_LOGPROB_FLOOR = -100.0
# Elements of one [chunk, V] working block in the chunked log-softmax (16 MB in float32): small enough for the
# allocator to reuse the same memory block after block instead of mapping fresh pages each time.
CHUNK_ELEMENTS = 1 << 22


def _check_choice(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of: {', '.join(allowed)}")


# ------------------------------------------------------------------------------------------------------------
# PPO surrogate and the sampled-token objectives
# ------------------------------------------------------------------------------------------------------------


def ppo_token_loss(
    logprobs_T: Tensor,
    old_logprobs_T: Tensor,
    advantages_T: Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
) -> tuple[Tensor, Tensor]:
    """L^PG = max(−ρA, −clip(ρ, 1−ε, 1+ε_hi)·A) elementwise, for tensors of any (broadcastable) shape.

    Returns ``(loss, clipped)``; ``clipped`` is 1.0 where the clipped term is strictly the larger one (the token
    gets no gradient), i.e. ρ > 1+ε_hi with A > 0, or ρ < 1−ε with A < 0. ``old_logprobs`` and ``advantages``
    are treated as constants.
    """
    log_ratio = torch.clamp(logprobs_T - old_logprobs_T.detach(), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    advantages = advantages_T.detach()
    unclipped = -ratio * advantages
    clipped_term = -torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = torch.maximum(unclipped, clipped_term)
    clipped = (clipped_term > unclipped).to(loss.dtype)
    return loss, clipped


def grpo_token_loss(
    logprobs_T: Tensor,
    old_logprobs_T: Tensor,
    reward: float | Tensor,
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
) -> tuple[Tensor, Tensor]:
    """GRPO / binary RL: the sample's (possibly group-normalised) reward is every token's advantage."""
    advantages_T = torch.as_tensor(reward, dtype=logprobs_T.dtype, device=logprobs_T.device).expand_as(logprobs_T)
    return ppo_token_loss(logprobs_T, old_logprobs_T, advantages_T, eps_clip, eps_clip_high)


def group_normalized_rewards(rewards_G: Tensor, eps: float = 1e-6, scale_by_std: bool = True) -> Tensor:
    """(r − mean) / (std + eps) within one group of samples answering the same prompt.

    A group of one sample is returned unchanged: with nothing to compare against, the vote itself is the
    advantage (subtracting the mean would erase it). ``std`` is the population standard deviation.
    """
    rewards_G = rewards_G.to(torch.get_default_dtype()) if not rewards_G.is_floating_point() else rewards_G
    if rewards_G.numel() <= 1:
        return rewards_G.clone()
    centred = rewards_G - rewards_G.mean()
    if not scale_by_std:
        return centred
    return centred / (rewards_G.std(unbiased=False) + eps)


def shape_advantages(rewards_B: Tensor, hinted_B: Tensor | None = None, mode: str = "balanced",
                     slack: float = 0.0) -> Tensor:
    """The GRPO branch's advantage of each of a batch's B samples, from their rewards (see docs/collapse-fix.md).

    A reward of −1 only pushes down the sampled answer; where nothing in the batch is pushed up, the freed
    probability goes wherever the softmax sends it, mostly to tokens the policy already favours, and repeated
    steps of that drove the policy into loops ("a creature that is a creature that is …"). The modes:

    * ``raw``: A = r (the original's behaviour).
    * ``baseline``: A = r − mean_B(r). An all-negative (or all-positive) batch gives A = 0; a mixed batch keeps
      its contrast with Σ A = 0. A batch of one sample gets A = 0.
    * ``hinted_opd``: A = r, except A = 0 where r < 0 and the sample is hinted (``hinted_B``: it gets a
      distillation term toward the hint-conditioned teacher, which says what to write instead).
    * ``balanced``: positives unchanged; negatives scaled by one factor min(1, (P + slack) / N), with
      P = Σ max(r, 0) and N = Σ max(−r, 0), so the batch never pushes down more than it pushes up (plus
      ``slack``). An all-negative batch gets ≤ ``slack`` in all (0 by default); a batch whose positives
      outweigh its negatives is unchanged.

    Pure: returns a new float tensor of the same shape; ``rewards_B`` is not modified.
    """
    _check_choice("advantage mode", mode, ADVANTAGE_MODES)
    if rewards_B.dim() != 1:
        raise ValueError(f"rewards_B must be 1-D (one reward per sample), got shape {tuple(rewards_B.shape)}")
    if not slack >= 0.0:
        raise ValueError(f"slack={slack!r} must be >= 0")
    rewards_B = rewards_B if rewards_B.is_floating_point() else rewards_B.to(torch.get_default_dtype())
    if not bool(torch.isfinite(rewards_B).all()):
        raise ValueError("rewards_B must be finite")
    if mode == "raw" or rewards_B.numel() == 0:
        return rewards_B.clone()
    if mode == "baseline":
        return rewards_B - rewards_B.mean()
    negative_B = rewards_B < 0
    if mode == "hinted_opd":
        if hinted_B is None or hinted_B.shape != rewards_B.shape:
            raise ValueError("advantage mode 'hinted_opd' needs hinted_B with one flag per reward")
        return torch.where(negative_B & hinted_B.to(torch.bool), torch.zeros_like(rewards_B), rewards_B)
    positive_mass = rewards_B.clamp(min=0).sum()
    negative_mass = (-rewards_B).clamp(min=0).sum()
    if float(negative_mass) <= float(positive_mass) + slack:
        return rewards_B.clone()
    scale = (positive_mass + slack) / negative_mass
    return torch.where(negative_B, rewards_B * scale + 0.0, rewards_B)  # + 0.0: no -0.0 in an all -1 batch


def combine_token_loss(
    logprobs_T: Tensor,
    old_logprobs_T: Tensor,
    reward: float | Tensor,
    teacher_logprobs_T: Tensor | None,
    w_rl: float = 1.0,
    w_opd: float = 1.0,
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
) -> tuple[Tensor, Tensor]:
    """The original's legacy combine: A_t = w_opd·(ℓ_T − ℓ_old) + w_rl·r in one PPO surrogate.

    ``teacher_logprobs_T=None`` (no teacher for this sample) drops the teacher term instead of substituting the
    behaviour log-probs, which in the original injected the train/inference mismatch as noise.
    """
    advantages_T = torch.full_like(logprobs_T, float(reward) * w_rl).detach()
    if teacher_logprobs_T is not None and w_opd != 0.0:
        advantages_T = advantages_T + w_opd * (teacher_logprobs_T.detach() - old_logprobs_T.detach())
    return ppo_token_loss(logprobs_T, old_logprobs_T, advantages_T, eps_clip, eps_clip_high)


def k3_kl(logprobs_T: Tensor, ref_logprobs_T: Tensor) -> Tensor:
    """Per-token k3 ("low_var_kl") estimate of KL(π_θ ‖ π_ref): δ = ℓ_ref − ℓ_θ, e^δ − 1 − δ, clamped to ±10."""
    delta = torch.clamp(ref_logprobs_T.detach() - logprobs_T, -2 * K3_CLAMP, 2 * K3_CLAMP)
    return torch.clamp(torch.exp(delta) - 1.0 - delta, -K3_CLAMP, K3_CLAMP)


def truncated_importance_weights(old_logprobs_T: Tensor, behaviour_logprobs_T: Tensor, cap: float) -> Tensor:
    """min(π_old / π_behaviour, cap) per token (detached): corrects samples produced by an older policy."""
    log_ratio = torch.clamp(old_logprobs_T - behaviour_logprobs_T, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(log_ratio), max=cap).detach()


# ------------------------------------------------------------------------------------------------------------
# Aggregation
# ------------------------------------------------------------------------------------------------------------


def masked_token_mean(values_T: Tensor, mask_T: Tensor | None) -> Tensor:
    """Σ_t x_t·m_t / max(1, Σ_t m_t) over the last dimension (masked positions may hold anything, even NaN)."""
    if mask_T is None:
        mask_T = torch.ones_like(values_T)
    keep = mask_T > 0
    total = torch.where(keep, values_T, torch.zeros((), dtype=values_T.dtype, device=values_T.device)).sum(-1)
    return total / keep.sum(-1).clamp(min=1).to(values_T.dtype)


def batch_mean(per_sample: Sequence[Tensor] | Tensor) -> Tensor:
    """Mean of per-sample values over every sample of the batch (fully masked samples count, as 0)."""
    if isinstance(per_sample, Tensor):
        return per_sample.mean()
    if len(per_sample) == 0:
        raise ValueError("batch_mean of an empty batch")
    return torch.stack(list(per_sample)).mean()


# ------------------------------------------------------------------------------------------------------------
# Chunked log-softmax + gather (the only place that touches [T, V])
# ------------------------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_tokens(vocab: int, chunk_tokens: int | None) -> int:
    if chunk_tokens is not None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
        return chunk_tokens
    return max(1, CHUNK_ELEMENTS // max(1, vocab))


def _scaled_block(block: Tensor, inv_temperature: float, cdtype: torch.dtype) -> Tensor:
    """logits/τ for one [chunk, V] block in the compute dtype; the block itself (no copy) when nothing changes.

    Never modified in place by the callers, so returning the caller's own rows is safe.
    """
    if block.dtype != cdtype:
        block = block.to(cdtype)
        return block.mul_(inv_temperature) if inv_temperature != 1.0 else block
    return block * inv_temperature if inv_temperature != 1.0 else block


class _LogSoftmaxGather(torch.autograd.Function):
    """ℓ[t, n] = log softmax(logits[t] / τ)[ids[t, n]], and optionally the entropy H[t] of softmax(logits[t] / τ).

    Forward and backward walk over blocks of positions with the fused log_softmax / softmax kernels, so only a
    [chunk, V] block is ever materialised besides the [T, V] gradient the caller needs anyway. The backward
    recomputes the block's softmax instead of keeping anything [T, V] alive between forward and backward.
    """

    @staticmethod
    def forward(ctx, logits_T_V: Tensor, ids_T_N: Tensor, inv_temperature: float, chunk: int,
                with_entropy: bool) -> tuple[Tensor, Tensor]:
        T = logits_T_V.shape[0]
        cdtype = _compute_dtype(logits_T_V.dtype)
        picked_T_N = torch.empty(ids_T_N.shape, dtype=cdtype, device=logits_T_V.device)
        entropy_T = torch.zeros(T, dtype=cdtype, device=logits_T_V.device)
        for start in range(0, T, chunk):
            stop = min(T, start + chunk)
            logp = torch.log_softmax(_scaled_block(logits_T_V[start:stop], inv_temperature, cdtype), dim=-1)
            picked_T_N[start:stop] = logp.gather(1, ids_T_N[start:stop])
            if with_entropy:
                p_log_p = torch.exp(logp).mul_(logp)
                entropy_T[start:stop] = -p_log_p.sum(-1)
                del p_log_p
            del logp
        ctx.save_for_backward(logits_T_V, ids_T_N, entropy_T)
        ctx.inv_temperature = inv_temperature
        ctx.chunk = chunk
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy_T)
        return picked_T_N, entropy_T

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_picked_T_N: Tensor | None, grad_entropy_T: Tensor | None):
        logits_T_V, ids_T_N, entropy_T = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (grad_picked_T_N is None and grad_entropy_T is None):
            return None, None, None, None, None
        T = logits_T_V.shape[0]
        cdtype = entropy_T.dtype
        inv_t = ctx.inv_temperature
        if grad_picked_T_N is None:
            grad_picked_T_N = torch.zeros(ids_T_N.shape, dtype=cdtype, device=logits_T_V.device)
        # d/dlogits = (1/τ)·d/dx with x = logits/τ, folded into the per-row coefficients.
        scaled_picked_T_N = grad_picked_T_N.to(cdtype) * inv_t
        neg_total_T_1 = -scaled_picked_T_N.sum(-1, keepdim=True)
        use_entropy = ctx.with_entropy and grad_entropy_T is not None
        if use_entropy:
            scaled_entropy_T_1 = grad_entropy_T.to(cdtype).unsqueeze(-1) * inv_t
        grad_T_V = torch.empty(logits_T_V.shape, dtype=logits_T_V.dtype, device=logits_T_V.device)
        direct = grad_T_V.dtype == cdtype
        for start in range(0, T, ctx.chunk):
            stop = min(T, start + ctx.chunk)
            x = _scaled_block(logits_T_V[start:stop], inv_t, cdtype)
            out = grad_T_V[start:stop]
            # dℓ[n]/dx_v = 1[v = id_n] − p_v  ;  dH/dx_v = −p_v (log p_v + H)
            if use_entropy:
                logp = torch.log_softmax(x, dim=-1)
                p = torch.exp(logp)
                coef = logp.add_(entropy_T[start:stop, None]).mul_(scaled_entropy_T_1[start:stop])
                coef.sub_(neg_total_T_1[start:stop])
                g = p.mul_(coef).neg_()
                del logp, coef
            else:
                p = torch.softmax(x, dim=-1)
                if direct:
                    torch.mul(p, neg_total_T_1[start:stop], out=out)
                    g = out
                else:
                    g = p.mul_(neg_total_T_1[start:stop])
            g.scatter_add_(1, ids_T_N[start:stop], scaled_picked_T_N[start:stop].to(g.dtype))
            if g is not out:
                out.copy_(g)
            del x, p, g
        return grad_T_V, None, None, None, None


def logprobs_and_entropy(
    logits_T_V: Tensor,
    ids_T_N: Tensor,
    temperature: float = 1.0,
    *,
    with_entropy: bool = True,
    chunk_tokens: int | None = None,
) -> tuple[Tensor, Tensor]:
    """log softmax(logits/τ) at ``ids`` ([T] or [T, N] long) and the full-vocabulary entropy H[T].

    Computed in float32 (float64 for float64 logits) whatever the logits' dtype; memory-bounded as described in
    the module docstring. With ``with_entropy=False`` the entropy is all zeros and carries no gradient.
    """
    if logits_T_V.dim() != 2:
        raise ValueError(f"logits must be [T, V], got shape {tuple(logits_T_V.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    squeeze = ids_T_N.dim() == 1
    ids = ids_T_N[:, None] if squeeze else ids_T_N
    if ids.shape[0] != logits_T_V.shape[0]:
        raise ValueError(f"ids have {ids.shape[0]} positions but logits have {logits_T_V.shape[0]}")
    ids = ids.to(device=logits_T_V.device, dtype=torch.long)
    chunk = _chunk_tokens(logits_T_V.shape[1], chunk_tokens)
    picked, entropy_T = _LogSoftmaxGather.apply(logits_T_V, ids, 1.0 / temperature, chunk, with_entropy)
    return (picked[:, 0] if squeeze else picked), entropy_T


def logprobs_at(logits_T_V: Tensor, ids_T_N: Tensor, temperature: float = 1.0, *,
                chunk_tokens: int | None = None) -> Tensor:
    """log softmax(logits/τ) gathered at ``ids`` ([T] -> [T], [T, N] -> [T, N]), memory-bounded."""
    return logprobs_and_entropy(logits_T_V, ids_T_N, temperature, with_entropy=False, chunk_tokens=chunk_tokens)[0]


# ------------------------------------------------------------------------------------------------------------
# Top-k targets, overlap and hint selection
# ------------------------------------------------------------------------------------------------------------


@dataclass
class TopKTargets:
    """Everything the top-k objectives need about the old policy and the C hint candidates of one sample.

    Student side (the old policy's own top-k, K ids per position) and teacher side (each candidate's own top-k,
    K' ids per position; clawloop uses K' = K) are both stored with the log-probs of the *other* side at the same
    ids, so every subset mode is a pure gather. All log-probs are full-vocabulary, temperature-scaled.
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

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "TopKTargets":
        """A copy on ``device`` (ids stay long; log-probs cast to ``dtype`` when given)."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            float_dtype = dtype if (dtype is not None and value.is_floating_point()) else None
            moved[f.name] = value.to(device=device, dtype=float_dtype)
        return TopKTargets(**moved)


def build_topk_targets(old_logprobs_T_V: Tensor, teacher_logprobs_C_T_V: Tensor, k: int) -> TopKTargets:
    """TopKTargets from full log-prob tables (old policy [T, V], candidates [C, T, V]), e.g. on one machine."""
    C, T, V = teacher_logprobs_C_T_V.shape
    student_logprobs_T_K, student_ids_T_K = old_logprobs_T_V.topk(k, dim=-1)
    teacher_logprobs_C_T_K, teacher_ids_C_T_K = teacher_logprobs_C_T_V.topk(k, dim=-1)
    old_at_teacher_C_T_K = old_logprobs_T_V.unsqueeze(0).expand(C, T, V).gather(-1, teacher_ids_C_T_K)
    teacher_at_student_C_T_K = teacher_logprobs_C_T_V.gather(-1, student_ids_T_K.unsqueeze(0).expand(C, T, k))
    return TopKTargets(student_ids_T_K, student_logprobs_T_K, old_at_teacher_C_T_K, teacher_ids_C_T_K,
                       teacher_logprobs_C_T_K, teacher_at_student_C_T_K)


def topk_overlap(student_ids_T_K: Tensor, teacher_ids_C_T_K: Tensor) -> Tensor:
    """O[h, t] = |S^q_t ∩ S^p_{t,h}| as a long [C, T] tensor (ids within a position are distinct)."""
    same_C_T_Kt_K = teacher_ids_C_T_K.unsqueeze(-1) == student_ids_T_K.unsqueeze(0).unsqueeze(-2)
    return same_C_T_Kt_K.any(-1).sum(-1)


def select_hints(overlap_C_T: Tensor, mode: str) -> Tensor:
    """h*[t] (long [T]) from the overlap matrix; every tie goes to the lowest index (the shortest hint).

    ``shortest``: 0 everywhere; ``token_optimal``: argmax_h O[h, t] per token; ``sequence_optimal``: one
    argmax_h Σ_t O[h, t] for the whole response.
    """
    _check_choice("hint_selection", mode, HINT_SELECTIONS)
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
    _check_choice("subset_mode", subset_mode, SUBSET_MODES)
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


# ------------------------------------------------------------------------------------------------------------
# Top-k select OPD and top-k tail KL
# ------------------------------------------------------------------------------------------------------------


def _topk_select_from_logprobs(
    cur_logprobs_T_K: Tensor,
    subset: TopKSubset,
    *,
    adv_diff_clip: float,
    eps_clip: float,
    eps_clip_high: float,
    mask_T: Tensor | None,
) -> tuple[Tensor, dict[str, Tensor]]:
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


def topk_select_opd_loss_from_logprobs(
    cur_logprobs_T_K: Tensor,
    subset: TopKSubset,
    *,
    adv_diff_clip: float = 1.0,
    eps_clip: float = 0.2,
    eps_clip_high: float = 0.28,
    mask_T: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """``topk_select_opd_loss`` when ℓ_θ at ``subset.ids_T_K`` is already computed (any way the caller likes)."""
    loss_T, metrics = _topk_select_from_logprobs(cur_logprobs_T_K, subset, adv_diff_clip=adv_diff_clip,
                                                 eps_clip=eps_clip, eps_clip_high=eps_clip_high, mask_T=mask_T)
    return loss_T, _floats(metrics)


def _floats(metrics: dict[str, Tensor | float]) -> dict[str, float]:
    """Detached Python floats, with a single device sync for all tensor values."""
    keys = [k for k, v in metrics.items() if isinstance(v, Tensor)]
    out = {k: float(v) for k, v in metrics.items() if not isinstance(v, Tensor)}
    if keys:
        values = torch.stack([metrics[k].detach().reshape(()).to(torch.float64) for k in keys]).cpu().tolist()
        out.update(zip(keys, values))
    return out


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
    """Top-k select OPD per token: loss_T[t] = Σ_{v∈S_t} L^PG_v(A_v) (0 where S_t is empty).

    ``logits_T_V`` are the current policy's raw logits at the response positions; ℓ_θ(v) = logit(v)/τ −
    logsumexp(logits/τ) and the gradient flows through both terms. Metrics (floats, masked token means):
    loss, clipfrac (mean over S_t of clipped entries), abs_diff (Σ_v w_v |clipped diff_v|), subset_size,
    empty_subset_frac, overlap_at_h_star, h_star_mean, teacher_mass (Σ_{v∈S_t} exp ℓ_T(v)).
    """
    subset = topk_subset(targets, hint_selection=hint_selection, subset_mode=subset_mode, mask_T=mask_T)
    cur_logprobs_T_K = logprobs_at(logits_T_V, subset.ids_T_K, temperature, chunk_tokens=chunk_tokens)
    loss_T, metrics = _topk_select_from_logprobs(cur_logprobs_T_K, subset, adv_diff_clip=adv_diff_clip,
                                                 eps_clip=eps_clip, eps_clip_high=eps_clip_high, mask_T=mask_T)
    return loss_T, _floats(metrics)


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
    return kl_T, _floats(_tail_kl_metrics(kl_T, student_T_K, teacher_logprobs_T_K, mask_T))


def _tail_kl_metrics(kl_T: Tensor, student_T_K: Tensor, teacher_T_K: Tensor,
                     mask_T: Tensor | None) -> dict[str, Tensor]:
    with torch.no_grad():
        return {
            "loss": masked_token_mean(kl_T.detach(), mask_T),
            "teacher_mass": masked_token_mean(teacher_T_K.to(kl_T.dtype).exp().sum(-1), mask_T),
            "student_mass": masked_token_mean(student_T_K.detach().exp().sum(-1), mask_T),
        }


# ------------------------------------------------------------------------------------------------------------
# The per-sample objective and the batch combinator
# ------------------------------------------------------------------------------------------------------------


@dataclass
class ObjectiveSettings:
    """The objective's settings (named as in clawloop.config). ``w_rl`` / ``w_opd`` = None take the method's preset."""

    method: str = "hybrid"
    w_rl: float | None = None
    w_opd: float | None = None
    hint_selection: str = "sequence_optimal"
    subset_mode: str = "student"
    adv_diff_clip: float = 1.0
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    opd_on_unhinted: str = "skip"
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    temperature: float = 1.0
    """τ dividing the logits; 0 = each sample's own ``ObjectiveSample.temperature``."""
    track_entropy: bool = True
    """Compute the entropy metric even when entropy_coef = 0 (one extra multiply-add over [T, V])."""
    chunk_tokens: int | None = None

    @property
    def weights(self) -> tuple[float, float]:
        """(w_rl, w_opd) after the method preset."""
        return method_weights(self.method, self.w_rl, self.w_opd)

    def validate(self) -> "ObjectiveSettings":
        """``clawloop.config.check_objective`` (a ``ConfigError``, which is a ValueError), and τ >= 0 (the
        config's ``train_temperature``)."""
        check_objective(self)
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0")
        return self

    @classmethod
    def from_config(cls, config: object) -> "ObjectiveSettings":
        """From a ``clawloop.config.Config`` (or anything with the same attribute names)."""
        w_rl, w_opd = getattr(config, "weights", (None, None))
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
            temperature=float(getattr(config, "train_temperature", 1.0)),
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
    """0-dim: this sample's contribution before the batch mean (w_rl·GRPO + w_opd·OPD + c_kl·KL − c_H·H)."""
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
    columns = [response_ids_T.view(T, 1)]
    if use_targets:
        vocab = sample.logits_T_V.shape[1] if sample.logits_T_V is not None else None
        sample.targets.validate(vocab_size=vocab, num_tokens=T)
        if method == "topk_kl":
            # The tail KL distils toward the selected candidate's own top-k.
            pick = topk_subset(sample.targets, hint_selection=settings.hint_selection, subset_mode="teacher",
                               mask_T=mask_T)
            kl_ids_T_K, kl_teacher_T_K, subset = pick.ids_T_K, pick.teacher_logprobs_T_K, pick
            columns.append(kl_ids_T_K)
        else:
            subset = topk_subset(sample.targets, hint_selection=settings.hint_selection,
                                 subset_mode=settings.subset_mode, mask_T=mask_T)
            columns.append(subset.ids_T_K)
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
                    branch = _tail_kl_metrics(kl_T, extra_T_K, kl_teacher_T_K, mask_T)
                    branch["h_star_mean"] = masked_token_mean(subset.h_star_T.to(dtype), mask_T)
                    term = masked_token_mean(kl_T, mask_T)  # no ratio: nothing to importance-weight
                else:
                    opd_T, branch = _topk_select_from_logprobs(
                        extra_T_K, subset, adv_diff_clip=settings.adv_diff_clip, eps_clip=settings.eps_clip,
                        eps_clip_high=settings.eps_clip_high, mask_T=mask_T)
                    term = masked_token_mean(pg_weighted(opd_T), mask_T)
                loss = loss + w_opd * term
                branch["loss"] = term.detach()
                metrics.update({prefix + k: v for k, v in branch.items()})

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


def compute_objective(
    samples: Sequence[ObjectiveSample], settings: ObjectiveSettings
) -> tuple[Tensor, dict[str, float]]:
    """Batch objective: mean over samples of ``sample_objective(...).loss`` (graph attached) and batch metrics.

    Holds every sample's graph until backward; for long responses use the per-sample loop of the module
    docstring, which gives the same gradient with one sample's memory.
    """
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


__all__ = [
    "ADVANTAGE_MODES", "HINT_SELECTIONS", "METHODS", "METHOD_WEIGHTS", "OPD_ON_UNHINTED", "SUBSET_MODES",
    "MetricsAccumulator", "ObjectiveSample", "ObjectiveSettings", "SampleObjective", "TopKSubset", "TopKTargets",
    "batch_mean", "build_topk_targets", "combine_token_loss", "compute_objective", "group_normalized_rewards",
    "grpo_token_loss", "k3_kl", "logprobs_and_entropy", "logprobs_at", "masked_token_mean",
    "ppo_token_loss", "sample_objective", "select_hints", "shape_advantages",
    "topk_overlap", "topk_select_opd_loss", "topk_select_opd_loss_from_logprobs", "topk_subset", "topk_tail_kl",
    "topk_tail_kl_loss", "truncated_importance_weights",
]
