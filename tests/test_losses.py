"""clawloop.losses against straightforward float64 re-derivations, finite differences and the properties
docs/method.md states.

The references below loop over tokens and vocabulary ids with Python floats and sets; they share no code with
the module under test (they read full log-prob tables directly instead of the six TopKTargets fields).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from clawloop import losses as L
from losses_support import batch_mean, build_topk_targets, compute_objective, topk_select_opd_loss, topk_tail_kl_loss

torch.set_num_threads(1)

EPS, EPS_HI = 0.2, 0.28
F64 = torch.float64


# ---------------------------------------------------------------------------------------------------------------
# Independent references (Python floats, loops)
# ---------------------------------------------------------------------------------------------------------------


def ref_log_softmax(row: list[float], tau: float) -> list[float]:
    scaled = [x / tau for x in row]
    top = max(scaled)
    lse = top + math.log(sum(math.exp(x - top) for x in scaled))
    return [x - lse for x in scaled]


def ref_ppo(cur: float, old: float, adv: float, eps: float = EPS, eps_hi: float = EPS_HI) -> tuple[float, bool]:
    ratio = math.exp(min(20.0, max(-20.0, cur - old)))
    a = -ratio * adv
    b = -min(1 + eps_hi, max(1 - eps, ratio)) * adv
    return max(a, b), b > a


def ref_topk_ids(row: list[float], k: int) -> list[int]:
    return sorted(range(len(row)), key=lambda v: -row[v])[:k]


def ref_topk_select(logits, old_full, teacher_full, k, hint_selection, subset_mode, clip, tau=1.0, mask=None):
    """Per-token loss and metrics of the top-k select objective, from full tables, by loops."""
    T, V = logits.shape
    C = teacher_full.shape[0]
    logits, old_full, teacher_full = logits.tolist(), old_full.tolist(), teacher_full.tolist()
    mask = [1.0] * T if mask is None else mask.tolist()
    cur = [ref_log_softmax(logits[t], tau) for t in range(T)]
    s_q = [set(ref_topk_ids(old_full[t], k)) for t in range(T)]
    s_p = [[set(ref_topk_ids(teacher_full[h][t], k)) for t in range(T)] for h in range(C)]
    overlap = [[len(s_q[t] & s_p[h][t]) for t in range(T)] for h in range(C)]

    def first_argmax(values):
        best = 0
        for i in range(1, len(values)):
            if values[i] > values[best]:
                best = i
        return best

    if hint_selection == "shortest":
        h_star = [0] * T
    elif hint_selection == "token_optimal":
        h_star = [first_argmax([overlap[h][t] for h in range(C)]) for t in range(T)]
    else:
        totals = [sum(overlap[h][t] for t in range(T) if mask[t] > 0) for h in range(C)]
        h_star = [first_argmax(totals)] * T

    loss, clipfrac, abs_diff, size, teacher_mass = [], [], [], [], []
    for t in range(T):
        h = h_star[t]
        subset = {"student": s_q[t], "teacher": s_p[h][t], "overlap": s_q[t] & s_p[h][t]}[subset_mode]
        subset = sorted(subset)
        if not subset:
            loss.append(0.0), clipfrac.append(0.0), abs_diff.append(0.0), size.append(0), teacher_mass.append(0.0)
            continue
        top = max(old_full[t][v] for v in subset)
        z = sum(math.exp(old_full[t][v] - top) for v in subset)
        total, n_clipped, weighted_abs = 0.0, 0, 0.0
        for v in subset:
            w = math.exp(old_full[t][v] - top) / z
            diff = teacher_full[h][t][v] - old_full[t][v]
            if clip > 0:
                diff = min(clip, max(-clip, diff))
            term, was_clipped = ref_ppo(cur[t][v], old_full[t][v], diff * w)
            total += term
            n_clipped += was_clipped
            weighted_abs += w * abs(diff)
        loss.append(total)
        clipfrac.append(n_clipped / len(subset))
        abs_diff.append(weighted_abs)
        size.append(len(subset))
        teacher_mass.append(sum(math.exp(teacher_full[h][t][v]) for v in subset))

    def mmean(xs):
        return sum(x * m for x, m in zip(xs, mask)) / max(1.0, sum(mask))

    metrics = {
        "loss": mmean(loss), "clipfrac": mmean(clipfrac), "abs_diff": mmean(abs_diff),
        "subset_size": mmean(size), "h_star_mean": mmean(h_star),
        "overlap_at_h_star": mmean([overlap[h_star[t]][t] for t in range(T)]),
        "teacher_mass": mmean(teacher_mass),
    }
    return loss, metrics


def make_case(seed: int, T: int = 7, V: int = 13, C: int = 3, K: int = 4, dtype=F64, teacher_noise: float = 1.0):
    """Random current logits, old-policy and candidate-teacher tables (teachers correlated with the old policy
    so overlaps vary between 0 and K)."""
    g = torch.Generator().manual_seed(seed)
    old_logits = torch.randn(T, V, generator=g, dtype=F64) * 2
    old_full = torch.log_softmax(old_logits, -1)
    teacher_full = torch.log_softmax(old_logits + teacher_noise * torch.randn(C, T, V, generator=g, dtype=F64) * 2,
                                     -1)
    logits = (old_logits + 0.5 * torch.randn(T, V, generator=g, dtype=F64)).to(dtype)
    return logits, old_full, teacher_full, build_topk_targets(old_full, teacher_full, K)


# ---------------------------------------------------------------------------------------------------------------
# PPO surrogate
# ---------------------------------------------------------------------------------------------------------------


def test_ppo_token_loss_matches_reference_for_any_shape():
    g = torch.Generator().manual_seed(1)
    cur = torch.randn(2, 3, 5, generator=g, dtype=F64)
    old = torch.randn(2, 3, 5, generator=g, dtype=F64)
    adv = torch.randn(2, 3, 5, generator=g, dtype=F64)
    loss, clipped = L.ppo_token_loss(cur, old, adv, EPS, EPS_HI)
    assert loss.shape == clipped.shape == (2, 3, 5)
    for idx in itertools.product(range(2), range(3), range(5)):
        want, was_clipped = ref_ppo(cur[idx].item(), old[idx].item(), adv[idx].item())
        assert loss[idx].item() == pytest.approx(want, abs=1e-12)
        assert clipped[idx].item() == float(was_clipped)


def test_ppo_clipping_engages_exactly_outside_the_trust_region():
    d = 1e-4
    ratios = torch.tensor([1 - EPS - d, 1 - EPS + d, 1.0, 1 + EPS_HI - d, 1 + EPS_HI + d], dtype=F64)
    for sign in (1.0, -1.0):
        cur = torch.log(ratios).requires_grad_(True)
        loss, clipped = L.ppo_token_loss(cur, torch.zeros(5, dtype=F64), torch.full((5,), sign, dtype=F64))
        loss.sum().backward()
        expect = (ratios > 1 + EPS_HI) if sign > 0 else (ratios < 1 - EPS)
        assert clipped.bool().tolist() == expect.tolist()
        # A clipped token gets exactly no gradient; every other token does.
        assert ((cur.grad == 0) == expect).all()


def test_ppo_log_ratio_is_clamped_at_20():
    loss, _ = L.ppo_token_loss(torch.tensor([60.0, -60.0], dtype=F64), torch.zeros(2, dtype=F64),
                               torch.tensor([-1.0, 1.0], dtype=F64))
    # A < 0 with a huge ratio: the unclipped term −ρA dominates, capped at e^20; no inf.
    assert loss[0].item() == pytest.approx(math.exp(20.0))
    assert torch.isfinite(loss).all()


# ---------------------------------------------------------------------------------------------------------------
# Overlap and hint selection
# ---------------------------------------------------------------------------------------------------------------


def test_topk_overlap_counts_set_intersections():
    student = torch.tensor([[1, 2, 3], [4, 5, 6]])
    teacher = torch.tensor([[[3, 2, 9], [7, 8, 0]], [[1, 2, 3], [6, 4, 5]]])
    assert L.topk_overlap(student, teacher).tolist() == [[2, 0], [3, 3]]


def test_select_hints_modes_and_ties_go_to_the_lowest_index():
    overlap = torch.tensor([[2, 1, 0], [2, 3, 0], [1, 3, 0]])
    assert L.select_hints(overlap, "shortest").tolist() == [0, 0, 0]
    assert L.select_hints(overlap, "token_optimal").tolist() == [0, 1, 0]
    assert L.select_hints(overlap, "sequence_optimal").tolist() == [1, 1, 1]  # sums 3, 5, 4
    tied = torch.tensor([[2, 2], [3, 1], [1, 3]])  # every row sums to 4
    assert L.select_hints(tied, "sequence_optimal").tolist() == [0, 0]
    assert L.select_hints(torch.zeros(3, 0, dtype=torch.long), "sequence_optimal").shape == (0,)
    with pytest.raises(ValueError, match="hint_selection"):
        L.select_hints(overlap, "longest")


# ---------------------------------------------------------------------------------------------------------------
# Top-k select OPD: every hint selection × subset mode against the reference
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("subset_mode", L.SUBSET_MODES)
@pytest.mark.parametrize("hint_selection", L.HINT_SELECTIONS)
def test_topk_select_matches_reference(hint_selection, subset_mode):
    for seed, clip, tau in ((0, 1.0, 1.0), (1, 0.0, 0.7), (2, 0.3, 1.3)):
        logits, old_full, teacher_full, targets = make_case(seed)
        mask = torch.tensor([1, 1, 0, 1, 1, 1, 0], dtype=F64)
        loss_T, metrics = topk_select_opd_loss(
            logits, targets, hint_selection=hint_selection, subset_mode=subset_mode, adv_diff_clip=clip,
            temperature=tau, mask_T=mask)
        want_T, want_metrics = ref_topk_select(logits, old_full, teacher_full, 4, hint_selection, subset_mode,
                                               clip, tau, mask)
        assert loss_T.tolist() == pytest.approx(want_T, abs=1e-10)
        for key, value in want_metrics.items():
            assert metrics[key] == pytest.approx(value, abs=1e-10), key


@pytest.mark.parametrize("subset_mode", L.SUBSET_MODES)
@pytest.mark.parametrize("hint_selection", ["sequence_optimal", "token_optimal"])
def test_topk_select_gradient_matches_finite_differences(hint_selection, subset_mode):
    logits, _, _, targets = make_case(3, T=4, V=7, C=2, K=3)
    x = logits.clone().requires_grad_(True)

    def f(z):
        return topk_select_opd_loss(z, targets, hint_selection=hint_selection, subset_mode=subset_mode,
                                      temperature=0.8, chunk_tokens=3)[0]

    assert torch.autograd.gradcheck(f, (x,))


def test_logprobs_and_entropy_match_log_softmax_and_finite_differences():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(5, 9, generator=g, dtype=F64)
    ids = torch.randint(0, 9, (5, 3), generator=g)
    ids[0, 1] = ids[0, 0]  # a repeated id must get both gradient contributions
    lp, entropy = L.logprobs_and_entropy(logits, ids, 0.6, chunk_tokens=2)
    full = torch.log_softmax(logits / 0.6, -1)
    assert torch.allclose(lp, full.gather(1, ids), atol=1e-12)
    assert torch.allclose(entropy, -(full.exp() * full).sum(-1), atol=1e-12)
    x = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: L.logprobs_and_entropy(z, ids, 0.6, chunk_tokens=2), (x,))
    # Only one output used: the other's gradient is simply absent.
    assert torch.autograd.gradcheck(lambda z: L.logprobs_and_entropy(z, ids, 0.6)[1], (x,))


def test_chunked_log_softmax_handles_low_precision_logits_and_any_chunk():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 50, generator=g).to(torch.bfloat16).requires_grad_(True)
    ids = torch.randint(0, 50, (9, 2), generator=g)
    lp = L.logprobs_at(logits, ids, 1.0, chunk_tokens=4)
    assert lp.dtype == torch.float32
    assert torch.allclose(lp, torch.log_softmax(logits.float(), -1).gather(1, ids), atol=1e-5)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()
    one_d = L.logprobs_at(logits.detach().float(), ids[:, 0])
    assert one_d.shape == (9,)


def test_temperature_scaling_is_consistent():
    logits, _, _, targets = make_case(6)
    tau = 0.6
    a = logits.clone().requires_grad_(True)
    b = (logits / tau).clone().requires_grad_(True)
    loss_a, _ = topk_select_opd_loss(a, targets, temperature=tau)
    loss_b, _ = topk_select_opd_loss(b, targets, temperature=1.0)
    assert torch.allclose(loss_a, loss_b, atol=1e-12)
    loss_a.sum().backward()
    loss_b.sum().backward()
    assert torch.allclose(a.grad, b.grad / tau, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# Top-k select properties
# ---------------------------------------------------------------------------------------------------------------


def test_overlap_subset_is_inside_the_student_and_the_selected_teacher_subsets():
    for seed in range(5):
        _, _, _, targets = make_case(seed, teacher_noise=2.0)
        for selection in L.HINT_SELECTIONS:
            sub = L.topk_subset(targets, hint_selection=selection, subset_mode="overlap")
            for t in range(targets.num_tokens):
                chosen = set(sub.ids_T_K[t][sub.valid_T_K[t]].tolist())
                assert chosen <= set(targets.student_ids_T_K[t].tolist())
                assert chosen <= set(targets.teacher_ids_C_T_K[sub.h_star_T[t], t].tolist())
                assert len(chosen) == sub.overlap_at_h_star_T[t].item()


@pytest.mark.parametrize("subset_mode", L.SUBSET_MODES)
def test_a_candidate_identical_to_the_student_gives_zero_advantage(subset_mode):
    logits, old_full, teacher_full, _ = make_case(7)
    teacher_full = teacher_full.clone()
    teacher_full[1] = old_full  # candidate 1 is the student itself; candidate 0 differs
    targets = build_topk_targets(old_full, teacher_full, 4)
    x = logits.clone().requires_grad_(True)
    loss_T, metrics = topk_select_opd_loss(x, targets, hint_selection="sequence_optimal",
                                             subset_mode=subset_mode)
    # Full overlap makes sequence_optimal choose it, and its advantage is zero everywhere.
    assert metrics["h_star_mean"] == 1.0 and metrics["overlap_at_h_star"] == 4.0
    assert metrics["abs_diff"] == 0.0
    assert torch.count_nonzero(loss_T) == 0
    loss_T.sum().backward()
    assert torch.count_nonzero(x.grad) == 0


def test_empty_overlap_subsets_give_finite_zeros():
    T, V = 3, 10
    logits = torch.randn(T, V, dtype=F64, requires_grad=True)
    student_ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    teacher_ids = torch.tensor([[[6, 7], [8, 9], [6, 7]]])  # disjoint from the student everywhere
    lp = torch.log_softmax(torch.randn(T, V, dtype=F64), -1)
    targets = L.TopKTargets(student_ids, lp.gather(1, student_ids), lp.gather(1, teacher_ids[0])[None],
                            teacher_ids, lp.gather(1, teacher_ids[0])[None] + 0.3, lp.gather(1, student_ids)[None])
    loss_T, metrics = topk_select_opd_loss(logits, targets, subset_mode="overlap")
    assert loss_T.tolist() == [0.0, 0.0, 0.0]
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["subset_size"] == 0.0 and metrics["empty_subset_frac"] == 1.0
    loss_T.sum().backward()
    assert torch.isfinite(logits.grad).all() and torch.count_nonzero(logits.grad) == 0


def test_adv_diff_clip_bounds_the_advantage_and_zero_disables_it():
    logits, old_full, teacher_full, targets = make_case(8, teacher_noise=3.0)
    _, clipped = topk_select_opd_loss(logits, targets, adv_diff_clip=0.1)
    _, unclipped = topk_select_opd_loss(logits, targets, adv_diff_clip=0.0)
    assert clipped["abs_diff"] <= 0.1 + 1e-12
    assert unclipped["abs_diff"] > 0.1


# ---------------------------------------------------------------------------------------------------------------
# The other objectives
# ---------------------------------------------------------------------------------------------------------------


def test_grpo_opd_token_and_combine_match_reference():
    g = torch.Generator().manual_seed(9)
    cur, old, teacher = (torch.randn(6, generator=g, dtype=F64) * 0.3 - 2 for _ in range(3))
    r = -1.0
    grpo, _ = L.grpo_token_loss(cur, old, r)
    opd, _ = L.ppo_token_loss(cur, old, teacher - old)  # token-level OPD: A_t = ℓ_T − ℓ_old
    comb, _ = L.combine_token_loss(cur, old, r, teacher, w_rl=0.5, w_opd=2.0)
    for t in range(6):
        c, o, te = cur[t].item(), old[t].item(), teacher[t].item()
        assert grpo[t].item() == pytest.approx(ref_ppo(c, o, r)[0], abs=1e-12)
        assert opd[t].item() == pytest.approx(ref_ppo(c, o, te - o)[0], abs=1e-12)
        assert comb[t].item() == pytest.approx(ref_ppo(c, o, 2.0 * (te - o) + 0.5 * r)[0], abs=1e-12)
    # The combine degenerates to each branch alone; no teacher means no teacher term.
    assert torch.equal(L.combine_token_loss(cur, old, r, teacher, w_rl=0.0, w_opd=1.0)[0], opd)
    assert torch.equal(L.combine_token_loss(cur, old, r, None, w_rl=1.0, w_opd=1.0)[0], grpo)


def test_group_normalized_rewards():
    rewards = torch.tensor([1.0, -1.0, 1.0, 1.0])
    mean = 0.5
    std = math.sqrt(sum((x - mean) ** 2 for x in rewards.tolist()) / 4)
    want = [(x - mean) / (std + 1e-6) for x in rewards.tolist()]
    assert L.group_normalized_rewards(rewards).tolist() == pytest.approx(want)
    assert L.group_normalized_rewards(torch.tensor([-1.0])).tolist() == [-1.0]  # a lone vote stays the advantage
    assert L.group_normalized_rewards(torch.tensor([1.0, 1.0])).tolist() == [0.0, 0.0]


def test_topk_tail_kl_matches_reference():
    logits, _, teacher_full, _ = make_case(10, T=5, V=11)
    tau = 0.9
    q_ids = teacher_full[0].topk(3, -1).indices
    q = teacher_full[0].gather(1, q_ids)
    kl_T, metrics = topk_tail_kl_loss(logits, q_ids, q, tau)
    for t in range(5):
        cur = ref_log_softmax(logits[t].tolist(), tau)
        p = [cur[v] for v in q_ids[t].tolist()]
        qs = q[t].tolist()
        p.append(math.log(1 - sum(math.exp(x) for x in p)))
        qs.append(math.log(1 - sum(math.exp(x) for x in qs)))
        want = sum(math.exp(a) * (a - b) for a, b in zip(p, qs))
        assert kl_T[t].item() == pytest.approx(want, abs=1e-10)
    assert metrics["teacher_mass"] == pytest.approx(q.exp().sum(-1).mean().item())


def test_topk_tail_kl_is_finite_when_the_top_k_hold_all_the_mass():
    # K = V: the tail is empty for both sides; the clamp keeps log(1 − 1) finite, and -inf teacher entries too.
    logits = torch.randn(3, 4, dtype=F64, requires_grad=True)
    ids = torch.arange(4).expand(3, 4)
    teacher = torch.log_softmax(torch.randn(3, 4, dtype=F64), -1)
    teacher[0, 3] = -math.inf
    kl_T, _ = topk_tail_kl_loss(logits, ids, teacher)
    assert torch.isfinite(kl_T).all()
    kl_T.sum().backward()
    assert torch.isfinite(logits.grad).all()
    # Away from the -inf entry it is the ordinary KL over the full vocabulary.
    p = torch.log_softmax(logits.detach()[1:], -1)
    assert torch.allclose(kl_T[1:].detach(), (p.exp() * (p - teacher[1:])).sum(-1), atol=1e-5)


def test_k3_kl_matches_reference_and_stays_finite():
    cur = torch.tensor([-1.0, -2.0, -0.5, -50.0, -1.0], dtype=F64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -0.5, -1.0, -80.0], dtype=F64)
    kl = L.k3_kl(cur, ref)
    for t in range(5):
        d = ref[t].item() - cur[t].item()
        assert kl[t].item() == pytest.approx(min(10.0, max(-10.0, math.exp(min(d, 700)) - 1 - d)), abs=1e-12)
    kl.sum().backward()
    assert torch.isfinite(cur.grad).all() and cur.grad[3].item() == 0.0  # clamped: no gradient, no NaN


def test_aggregation_is_masked_token_mean_then_batch_mean():
    values = torch.tensor([[1.0, 2.0, 3.0], [5.0, float("nan"), 7.0], [4.0, 4.0, 4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    per_sample = L.masked_token_mean(values, mask)
    assert per_sample.tolist() == [1.5, 6.0, 0.0]  # masked NaN ignored; empty sample gives 0
    # The fully masked sample still counts in the batch denominator.
    assert per_sample.mean().item() == pytest.approx(7.5 / 3)
    assert batch_mean(list(per_sample)).item() == pytest.approx(7.5 / 3)


# ---------------------------------------------------------------------------------------------------------------
# TopKTargets
# ---------------------------------------------------------------------------------------------------------------


def test_topk_targets_validate_and_move():
    _, _, _, targets = make_case(11, T=4, V=9, C=2, K=3)
    assert targets.validate(vocab_size=9, num_tokens=4) is targets
    assert (targets.num_tokens, targets.num_candidates) == (4, 2)
    moved = targets.to("cpu", dtype=torch.float32)
    assert moved.student_logprobs_T_K.dtype == torch.float32 and moved.teacher_ids_C_T_K.dtype == torch.long
    bad_shape = L.TopKTargets(**{**vars(targets), "teacher_at_student_C_T_K": targets.teacher_at_student_C_T_K[:1]})
    with pytest.raises(ValueError, match="teacher_at_student_C_T_K"):
        bad_shape.validate()
    with pytest.raises(ValueError, match="student_ids_T_K must be int64"):
        L.TopKTargets(**{**vars(targets), "student_ids_T_K": targets.student_ids_T_K.int()}).validate()
    duplicated = targets.student_ids_T_K.clone()
    duplicated[0, 1] = duplicated[0, 0]
    with pytest.raises(ValueError, match="repeats an id"):
        L.TopKTargets(**{**vars(targets), "student_ids_T_K": duplicated}).validate()
    with pytest.raises(ValueError, match="outside"):
        targets.validate(vocab_size=3)
    with pytest.raises(ValueError, match="positions"):
        targets.validate(num_tokens=5)


# ---------------------------------------------------------------------------------------------------------------
# The per-sample objective and the batch combinator
# ---------------------------------------------------------------------------------------------------------------


def make_sample(seed: int, *, hinted: bool = True, T: int = 6, V: int = 12, reward: float = 1.0, mask=None):
    logits, old_full, teacher_full, targets = make_case(seed, T=T, V=V, C=3, K=3)
    g = torch.Generator().manual_seed(seed + 100)
    ids = torch.randint(0, V, (T,), generator=g)
    return L.ObjectiveSample(
        response_ids_T=ids,
        old_logprobs_T=old_full.gather(1, ids[:, None])[:, 0],
        reward=reward,
        logits_T_V=logits.clone().requires_grad_(True),
        mask_T=mask,
        targets=targets if hinted else None,
        teacher_logprobs_T=teacher_full[0].gather(1, ids[:, None])[:, 0] if hinted else None,
        ref_logprobs_T=old_full.gather(1, ids[:, None])[:, 0] - 0.1,
        behaviour_logprobs_T=old_full.gather(1, ids[:, None])[:, 0] + 0.05,
    )


def test_w_opd_zero_gives_the_grpo_loss_exactly():
    samples = [make_sample(s, hinted=s != 1, reward=(-1.0) ** s) for s in range(3)]
    hybrid, _ = compute_objective(samples, L.ObjectiveSettings(method="hybrid", w_rl=1.0, w_opd=0.0))
    rl, metrics = compute_objective(samples, L.ObjectiveSettings(method="rl"))
    manual = batch_mean([
        L.masked_token_mean(L.grpo_token_loss(L.logprobs_at(s.logits_T_V, s.response_ids_T), s.old_logprobs_T,
                                              s.reward)[0], s.mask_T)
        for s in samples])
    assert torch.equal(hybrid, rl) and torch.equal(rl, manual)
    assert not any(k.startswith("opd_") for k in metrics)


def test_sample_objective_reproduces_its_parts_and_reports_every_metric():
    sample = make_sample(12, mask=torch.tensor([1, 1, 1, 0, 1, 1]))
    settings = L.ObjectiveSettings(kl_coef=0.3, entropy_coef=0.01, hint_selection="token_optimal",
                                   subset_mode="overlap", temperature=0.8)
    out = L.sample_objective(sample, settings)
    m = out.metrics
    opd_T, opd_metrics = topk_select_opd_loss(sample.logits_T_V, sample.targets, hint_selection="token_optimal",
                                                subset_mode="overlap", temperature=0.8, mask_T=sample.mask_T)
    lp, entropy = L.logprobs_and_entropy(sample.logits_T_V, sample.response_ids_T, 0.8)
    grpo = L.masked_token_mean(L.grpo_token_loss(lp, sample.old_logprobs_T, 1.0)[0], sample.mask_T)
    opd = L.masked_token_mean(opd_T, sample.mask_T)
    kl = L.masked_token_mean(L.k3_kl(lp, sample.ref_logprobs_T), sample.mask_T)
    ent = L.masked_token_mean(entropy, sample.mask_T)
    assert out.loss.item() == pytest.approx((grpo + opd + 0.3 * kl - 0.01 * ent).item(), abs=1e-12)
    assert m["loss"] == pytest.approx(m["grpo_loss"] + m["opd_loss"] + 0.3 * m["ref_kl"] - 0.01 * m["entropy"])
    for key, value in opd_metrics.items():
        assert m["opd_" + key] == pytest.approx(value, abs=1e-12), key
    expected = {"loss", "grpo_loss", "grpo_clipfrac", "opd_loss", "opd_clipfrac", "opd_abs_diff", "opd_subset_size",
                "opd_overlap_at_h_star", "opd_h_star_mean", "opd_teacher_mass", "opd_applied", "ppo_kl",
                "train_behaviour_logprob_gap", "entropy", "ref_kl", "num_tokens"}
    assert expected <= set(m) and all(isinstance(v, float) for v in m.values())
    assert m["num_tokens"] == 5.0
    gap = (lp.detach() - sample.behaviour_logprobs_T).abs()
    assert m["train_behaviour_logprob_gap"] == pytest.approx(L.masked_token_mean(gap, sample.mask_T).item())


def test_sample_objective_gradient_matches_finite_differences():
    sample = make_sample(13, T=3, V=6)
    settings = L.ObjectiveSettings(kl_coef=0.5, entropy_coef=0.2, temperature=0.9, chunk_tokens=2)
    x = sample.logits_T_V.detach().clone().requires_grad_(True)

    def f(z):
        return L.sample_objective(L.ObjectiveSample(**{**vars(sample), "logits_T_V": z}), settings).loss

    assert torch.autograd.gradcheck(f, (x,))


def test_per_sample_accumulation_equals_the_batch_objective():
    settings = L.ObjectiveSettings()
    batch = [make_sample(s, hinted=s % 2 == 0) for s in range(3)]
    loss, metrics = compute_objective(batch, settings)
    loss.backward()
    full_grads = [s.logits_T_V.grad.clone() for s in batch]
    acc = L.MetricsAccumulator()
    for s in batch:
        s.logits_T_V.grad = None
        out = L.sample_objective(s, settings)
        (out.loss / len(batch)).backward()
        acc.add(out.metrics)
    for s, g in zip(batch, full_grads):
        assert torch.allclose(s.logits_T_V.grad, g, atol=1e-14)
    assert acc.result() == pytest.approx(metrics)
    assert metrics["num_samples"] == 3.0 and metrics["opd_applied"] == pytest.approx(2 / 3)
    # Branch losses average over every sample, so the batch identity holds.
    assert metrics["loss"] == pytest.approx(metrics["grpo_loss"] + metrics["opd_loss"])


def test_fully_masked_sample_contributes_zero_but_counts_in_the_batch():
    settings = L.ObjectiveSettings(kl_coef=0.1, entropy_coef=0.1)
    live = make_sample(14)
    dead = make_sample(15, mask=torch.zeros(6))
    out = L.sample_objective(dead, settings)
    assert out.loss.item() == 0.0 and all(math.isfinite(v) for v in out.metrics.values())
    out.loss.backward()
    assert torch.count_nonzero(dead.logits_T_V.grad) == 0
    both, _ = compute_objective([live, dead], settings)
    alone, _ = compute_objective([live], settings)
    assert both.item() == pytest.approx(alone.item() / 2)


def test_opd_on_unhinted_skip_and_anchor():
    hinted = make_sample(16)
    unhinted = L.ObjectiveSample(**{**vars(hinted), "hinted": False})  # targets computed on the plain prompt
    skip = L.sample_objective(unhinted, L.ObjectiveSettings(opd_on_unhinted="skip"))
    anchor = L.sample_objective(unhinted, L.ObjectiveSettings(opd_on_unhinted="anchor"))
    with_hint = L.sample_objective(hinted, L.ObjectiveSettings())
    assert skip.metrics["opd_applied"] == 0.0 and skip.metrics["opd_loss"] == 0.0
    assert skip.loss.item() == pytest.approx(skip.metrics["grpo_loss"])
    assert anchor.metrics["opd_applied"] == 1.0
    assert anchor.loss.item() == pytest.approx(with_hint.loss.item())
    no_targets = L.ObjectiveSample(**{**vars(hinted), "targets": None, "hinted": None})
    assert L.sample_objective(no_targets, L.ObjectiveSettings()).metrics["opd_applied"] == 0.0
    with pytest.raises(ValueError, match="anchor"):
        L.sample_objective(no_targets, L.ObjectiveSettings(opd_on_unhinted="anchor"))


def test_combine_and_topk_kl_methods():
    sample = make_sample(17, reward=-1.0)
    out = L.sample_objective(sample, L.ObjectiveSettings(method="combine", w_rl=0.5, w_opd=2.0))
    lp = L.logprobs_at(sample.logits_T_V, sample.response_ids_T)
    want = L.combine_token_loss(lp, sample.old_logprobs_T, -1.0, sample.teacher_logprobs_T, 0.5, 2.0)[0].mean()
    assert out.loss.item() == pytest.approx(want.item(), abs=1e-12)
    assert {"combine_loss", "combine_clipfrac", "combine_abs_diff"} <= set(out.metrics)

    kl = L.sample_objective(sample, L.ObjectiveSettings(method="topk_kl", hint_selection="shortest"))
    t = sample.targets
    want_kl, _ = topk_tail_kl_loss(sample.logits_T_V, t.teacher_ids_C_T_K[0], t.teacher_logprobs_C_T_K[0])
    assert kl.loss.item() == pytest.approx(want_kl.mean().item(), abs=1e-12)
    assert kl.metrics["topk_kl_applied"] == 1.0 and "grpo_loss" not in kl.metrics


def test_precomputed_logprobs_serve_the_rl_method_without_logits():
    sample = make_sample(18)
    lp = L.logprobs_at(sample.logits_T_V, sample.response_ids_T)
    pre = L.ObjectiveSample(**{**vars(sample), "logits_T_V": None, "logprobs_T": lp})
    with_logits = L.sample_objective(sample, L.ObjectiveSettings(method="rl"))
    without = L.sample_objective(pre, L.ObjectiveSettings(method="rl"))
    assert torch.equal(with_logits.loss, without.loss)
    with pytest.raises(ValueError, match="logits_T_V"):
        L.sample_objective(pre, L.ObjectiveSettings(method="hybrid"))


def test_settings_validate_and_follow_the_config():
    from clawloop import config

    assert L.METHODS == config.METHODS and L.METHOD_WEIGHTS == config.METHOD_WEIGHTS
    assert set(L.HINT_SELECTIONS) == set(config.HINT_SELECTIONS) and L.SUBSET_MODES == config.SUBSET_MODES
    for bad in ({"method": "ppo"}, {"subset_mode": "union"}, {"opd_on_unhinted": "maybe"}, {"eps_clip": 1.5},
                {"w_opd": -1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            L.ObjectiveSettings(**bad).validate()
    settings = L.ObjectiveSettings.from_config(config.Config(method="rl", subset_mode="teacher"))
    assert settings.weights == (1.0, 0.0) and settings.subset_mode == "teacher"


def test_losses_import_nothing_else_of_clawloop():
    # The math owns its presets; the config takes them from here, never the other way round.
    import ast
    from pathlib import Path

    from clawloop import config

    for path in Path(L.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("clawloop"):
                assert node.module.startswith("clawloop.losses"), f"{path.name} imports {node.module}"
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("clawloop") and not a.name.startswith("clawloop.losses")
                               for a in node.names), path.name
    assert config.check_objective is L.check_objective and config.METHOD_WEIGHTS is L.METHOD_WEIGHTS
    with pytest.raises(config.ConfigError, match="w_opd=1.0 contradicts method='rl'"):
        config.Config.load(env={}, method="rl", w_opd=1.0)
