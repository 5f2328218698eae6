"""``clawloop.losses.shape_advantages``: how a batch's votes become GRPO advantages, and what that does to the
gradient of the GRPO branch (docs/collapse-fix.md).

The property that matters: a batch in which every vote is −1 must not push down what was sampled with nothing
to pull toward (``balanced``, ``baseline``, and ``hinted_opd`` for hinted turns), while a batch with positive
votes still trains, and ``raw`` keeps the original's A = r.
"""

from __future__ import annotations

import pytest
import torch

from clawloop import losses as L
from losses_support import compute_objective

torch.set_num_threads(1)
F64 = torch.float64


def t(values, dtype=F64):
    return torch.tensor(values, dtype=dtype)


def test_raw_is_the_vote_itself_and_a_copy():
    rewards = t([-1.0, 1.0, -1.0, 0.0])
    out = L.shape_advantages(rewards, mode="raw")
    assert out.tolist() == [-1.0, 1.0, -1.0, 0.0]
    out[0] = 5.0
    assert rewards[0] == -1.0  # never aliases the input


@pytest.mark.parametrize("mode", ["balanced", "baseline"])
def test_an_all_negative_batch_pushes_nothing_down(mode):
    out = L.shape_advantages(t([-1.0, -1.0, -1.0, -1.0]), mode=mode)
    assert out.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert not any(torch.signbit(out))  # 0.0, not -0.0


def test_hinted_opd_leaves_only_unhinted_negatives():
    rewards = t([-1.0, -1.0, 1.0, -1.0, 0.0])
    hinted = torch.tensor([True, False, True, True, True])
    out = L.shape_advantages(rewards, hinted, mode="hinted_opd")
    # A hinted −1 is left to the teacher; an unhinted −1 and every non-negative vote are kept.
    assert out.tolist() == [0.0, -1.0, 1.0, 0.0, 0.0]


def test_balanced_scales_negatives_down_to_the_positive_mass():
    out = L.shape_advantages(t([1.0, -1.0, -1.0, -1.0]), mode="balanced")
    assert out.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    assert float(out.sum()) == pytest.approx(0.0, abs=1e-12)


def test_balanced_keeps_a_batch_whose_positives_outweigh_its_negatives():
    for rewards in ([1.0, 1.0, 1.0, -1.0], [1.0, -1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0]):
        assert L.shape_advantages(t(rewards), mode="balanced").tolist() == rewards


def test_balanced_slack_bounds_the_push_down_of_an_all_negative_batch():
    out = L.shape_advantages(t([-1.0, -1.0, -1.0, -1.0]), mode="balanced", slack=0.5)
    assert out.tolist() == pytest.approx([-0.125] * 4)
    out = L.shape_advantages(t([1.0, -1.0, -1.0, -1.0]), mode="balanced", slack=0.5)
    assert float(out.clamp(max=0).sum()) == pytest.approx(-1.5)


def test_baseline_centres_a_mixed_batch_and_zeroes_an_all_positive_one():
    assert L.shape_advantages(t([1.0, -1.0, -1.0, -1.0]), mode="baseline").tolist() == [1.5, -0.5, -0.5, -0.5]
    assert L.shape_advantages(t([1.0, 1.0]), mode="baseline").tolist() == [0.0, 0.0]
    assert L.shape_advantages(t([-1.0]), mode="baseline").tolist() == [0.0]


@pytest.mark.parametrize("seed", range(20))
def test_invariants_on_random_batches(seed):
    gen = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 9, (1,), generator=gen))
    rewards = torch.randn(B, generator=gen, dtype=F64) * 2  # group-normalised votes are not just ±1
    rewards[torch.rand(B, generator=gen) < 0.3] = -1.0
    hinted = torch.rand(B, generator=gen) < 0.5
    slack = float(torch.rand(1, generator=gen))
    pos_mass = float(rewards.clamp(min=0).sum())

    bal = L.shape_advantages(rewards, mode="balanced", slack=slack)
    assert torch.equal(bal[rewards >= 0], rewards[rewards >= 0])  # positives untouched
    assert (torch.sign(bal[rewards < 0]) <= 0).all()  # a negative never turns positive
    assert ((bal.abs() <= rewards.abs() + 1e-12)).all()  # never amplified
    assert float(-bal.clamp(max=0).sum()) <= pos_mass + slack + 1e-9
    # The same factor for every negative: their proportions are kept.
    neg = rewards < 0
    if neg.sum() > 1 and pos_mass + slack > 0:
        ratios = bal[neg] / rewards[neg]
        assert torch.allclose(ratios, ratios[0].expand_as(ratios))

    base = L.shape_advantages(rewards, mode="baseline")
    assert float(base.sum()) == pytest.approx(0.0, abs=1e-9)
    assert torch.allclose(base, rewards - rewards.mean())

    hop = L.shape_advantages(rewards, hinted, mode="hinted_opd")
    assert torch.equal(hop[~(neg & hinted)], rewards[~(neg & hinted)])
    assert (hop[neg & hinted] == 0).all()


def test_dtype_and_shape_are_kept_and_integer_votes_are_accepted():
    out = L.shape_advantages(torch.tensor([1, -1, -1]), mode="balanced")
    assert out.is_floating_point() and out.shape == (3,)
    assert out.tolist() == pytest.approx([1.0, -0.5, -0.5])
    out32 = L.shape_advantages(torch.tensor([1.0, -1.0], dtype=torch.float32), mode="balanced")
    assert out32.dtype == torch.float32
    assert L.shape_advantages(torch.zeros(0), mode="balanced").shape == (0,)


def test_bad_input_is_refused_with_a_clear_error():
    with pytest.raises(ValueError, match="advantage mode"):
        L.shape_advantages(t([1.0]), mode="clipped")
    with pytest.raises(ValueError, match="1-D"):
        L.shape_advantages(t([[1.0, -1.0]]), mode="balanced")
    with pytest.raises(ValueError, match="hinted_B"):
        L.shape_advantages(t([1.0, -1.0]), mode="hinted_opd")
    with pytest.raises(ValueError, match="hinted_B"):
        L.shape_advantages(t([1.0, -1.0]), torch.tensor([True]), mode="hinted_opd")
    with pytest.raises(ValueError, match="slack"):
        L.shape_advantages(t([1.0, -1.0]), mode="balanced", slack=-1.0)
    with pytest.raises(ValueError, match="finite"):
        L.shape_advantages(t([float("nan"), -1.0]), mode="balanced")


def _grpo_batch_grad(advantages, logits_B_T_V, ids_B_T):
    """Gradient of the GRPO batch objective (rl method, no KL) w.r.t. the logits, for the given advantages."""
    logits = logits_B_T_V.clone().requires_grad_(True)
    samples = []
    for b, adv in enumerate(advantages.tolist()):
        old_T = torch.log_softmax(logits_B_T_V[b], -1).gather(1, ids_B_T[b].view(-1, 1)).squeeze(1)
        samples.append(L.ObjectiveSample(response_ids_T=ids_B_T[b], old_logprobs_T=old_T, reward=adv,
                                         logits_T_V=logits[b]))
    loss, metrics = compute_objective(samples, L.ObjectiveSettings(method="rl", track_entropy=False))
    loss.backward()
    return logits.grad, metrics


def test_all_negative_batch_raw_lowers_every_sampled_token_and_balanced_does_not_move():
    gen = torch.Generator().manual_seed(0)
    B, T, V = 4, 5, 11
    logits = torch.randn(B, T, V, generator=gen, dtype=F64)
    ids = torch.randint(0, V, (B, T), generator=gen)
    votes = t([-1.0] * B)

    grad_raw, metrics_raw = _grpo_batch_grad(L.shape_advantages(votes, mode="raw"), logits, ids)
    # Raw: a gradient-descent step raises the loss's negative direction, i.e. every sampled token's logit falls.
    picked = grad_raw.gather(2, ids.unsqueeze(-1)).squeeze(-1)
    assert (picked > 0).all()
    assert metrics_raw["grpo_loss"] == pytest.approx(1.0)  # the collapse signature: −ρ·A with ρ = 1, A = −1

    grad_bal, metrics_bal = _grpo_batch_grad(L.shape_advantages(votes, mode="balanced"), logits, ids)
    assert torch.count_nonzero(grad_bal) == 0
    assert metrics_bal["grpo_loss"] == 0.0


def test_mixed_batch_balanced_still_pulls_the_positive_up_and_pushes_negatives_down():
    gen = torch.Generator().manual_seed(1)
    B, T, V = 4, 3, 7
    logits = torch.randn(B, T, V, generator=gen, dtype=F64)
    ids = torch.randint(0, V, (B, T), generator=gen)
    votes = t([1.0, -1.0, -1.0, -1.0])
    grad, _ = _grpo_batch_grad(L.shape_advantages(votes, mode="balanced"), logits, ids)
    picked = grad.gather(2, ids.unsqueeze(-1)).squeeze(-1)
    assert (picked[0] < 0).all()  # descent raises the +1 answer's tokens
    assert (picked[1:] > 0).all()  # and still lowers the −1 answers', a third as hard as raw
    grad_raw, _ = _grpo_batch_grad(votes, logits, ids)
    assert torch.allclose(grad[1:], grad_raw[1:] / 3)
    assert torch.allclose(grad[0], grad_raw[0])
