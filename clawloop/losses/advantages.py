"""Advantages from votes: group normalisation, and the shaping of a batch's GRPO advantages (docs/collapse-fix.md)."""

from __future__ import annotations

import torch
from torch import Tensor

from clawloop.losses.presets import ADVANTAGE_MODES, check_choice


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
    check_choice("advantage mode", mode, ADVANTAGE_MODES)
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

