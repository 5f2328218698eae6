"""The sampled-token objectives: the PPO surrogate, GRPO, the legacy combine, k3 KL, importance weights, and the
per-sample masked token mean.

    ρ     exp(clamp(ℓ_θ − ℓ_old, −20, 20))
    L^PG(A) = max(−ρ·A, −clip(ρ, 1−ε_lo, 1+ε_hi)·A)                        (``ppo_token_loss``)

* GRPO: A_t = r (the turn's vote, possibly shaped across the batch, ``clawloop.losses.advantages``) for every
  response token.
* legacy combine: A_t = w_opd·(ℓ_T − ℓ_old) + w_rl·r, one PPO surrogate on the sampled token.
* k3 KL to a reference: δ = ℓ_ref − ℓ_θ, e^δ − 1 − δ, clamped to [−10, 10] ("low_var_kl"); δ itself is
  clamped to ±20 first, which never changes the clamped value but keeps e^δ finite (no inf·0 = NaN in backward).
* Aggregation of one sample: its token losses averaged over its masked-in response tokens with denominator
  max(1, Σ m) (``masked_token_mean``).
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


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



def masked_token_mean(values_T: Tensor, mask_T: Tensor | None) -> Tensor:
    """Σ_t x_t·m_t / max(1, Σ_t m_t) over the last dimension (masked positions may hold anything, even NaN)."""
    if mask_T is None:
        mask_T = torch.ones_like(values_T)
    keep = mask_T > 0
    total = torch.where(keep, values_T, torch.zeros((), dtype=values_T.dtype, device=values_T.device)).sum(-1)
    return total / keep.sum(-1).clamp(min=1).to(values_T.dtype)

