"""The teacher-support term: its value and gradients against an independent float64 derivation, its edge cases
(a real tail, a teacher tail of zero mass, −inf teacher entries), its position options, its pull on a token the
student almost never picks, and its place in ``sample_objective``."""

from __future__ import annotations

import math

import pytest
import torch

import clawloop.losses as L
from losses_support import build_topk_targets


def reference_support(logits_T_V, teacher_ids_T_K, teacher_logprobs_T_K, used_T=None):
    """KL(q ‖ p) over the teacher's ids plus one tail bin, written out position by position in float64.

    The student's tail is the mass of every id outside the teacher's set (summed, not 1 − Σ), and a teacher bin
    of zero mass is skipped (0 · log 0 = 0)."""
    logp_T_V = torch.log_softmax(logits_T_V.double(), dim=-1)
    T, V = logp_T_V.shape
    out = []
    for t in range(T):
        if used_T is not None and not bool(used_T[t]):
            out.append(logp_T_V.new_zeros(()))
            continue
        ids = teacher_ids_T_K[t].tolist()
        total = logp_T_V.new_zeros(())
        q_inside = 0.0
        for v, lq in zip(ids, teacher_logprobs_T_K[t].double().tolist()):
            q = math.exp(lq)
            q_inside += q
            if q > 0:
                total = total + q * (lq - logp_T_V[t, v])
        outside = torch.ones(V, dtype=torch.bool)
        outside[ids] = False
        q_tail = max(0.0, 1.0 - q_inside)
        if q_tail > 0:
            p_tail = logp_T_V[t, outside].exp().sum()
            total = total + q_tail * (math.log(q_tail) - torch.log(p_tail))
        out.append(total)
    return torch.stack(out)


def support_loss_and_grad(logits_T_V, teacher_ids_T_K, teacher_logprobs_T_K, positions_T=None):
    logits = logits_T_V.detach().clone().requires_grad_(True)
    cur_T_K = L.logprobs_at(logits, teacher_ids_T_K)
    loss_T = L.teacher_support_kl(cur_T_K, teacher_logprobs_T_K, positions_T=positions_T)
    (grad,) = torch.autograd.grad(loss_T.sum(), logits)
    return loss_T.detach(), grad


def reference_loss_and_grad(logits_T_V, teacher_ids_T_K, teacher_logprobs_T_K, used_T=None):
    logits = logits_T_V.detach().double().clone().requires_grad_(True)
    loss_T = reference_support(logits, teacher_ids_T_K, teacher_logprobs_T_K, used_T)
    (grad,) = torch.autograd.grad(loss_T.sum(), logits)
    return loss_T.detach(), grad


def distinct_ids(T, V, K, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(T)])


def test_loss_and_gradient_match_a_float64_derivation_with_a_real_tail():
    T, V, K = 6, 40, 5
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(T, V, generator=g, dtype=torch.float64) * 2
    ids = distinct_ids(T, V, K, 1)
    # A teacher holding 40-90% of its mass on its K ids, sorted most likely first.
    raw = torch.rand(T, K, generator=g, dtype=torch.float64) + 0.05
    mass_T_1 = 0.4 + 0.5 * torch.rand(T, 1, generator=g, dtype=torch.float64)
    teacher = torch.log(raw / raw.sum(-1, keepdim=True) * mass_T_1).sort(-1, descending=True).values

    loss, grad = support_loss_and_grad(logits, ids, teacher)
    ref_loss, ref_grad = reference_loss_and_grad(logits, ids, teacher)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert (loss > 0).all()

    # The closed form: p_u − q_u on the teacher's ids, p_u (1 − q_tail / p_tail) elsewhere.
    p = torch.softmax(logits, -1)
    q_inside = torch.zeros_like(p).scatter(1, ids, teacher.exp())
    in_T_V = torch.zeros_like(p, dtype=torch.bool).scatter(1, ids, True)
    q_tail_T_1 = 1 - teacher.exp().sum(-1, keepdim=True)
    p_tail_T_1 = (p * ~in_T_V).sum(-1, keepdim=True)
    closed = torch.where(in_T_V, p - q_inside, p * (1 - q_tail_T_1 / p_tail_T_1))
    torch.testing.assert_close(grad, closed, rtol=1e-9, atol=1e-12)


def test_a_student_matching_the_teacher_on_every_bin_has_zero_loss_and_gradient():
    T, V, K = 3, 30, 4
    logits = torch.randn(T, V, dtype=torch.float64)
    logp = torch.log_softmax(logits, -1)
    teacher, ids = logp.topk(K, dim=-1)
    loss, grad = support_loss_and_grad(logits, ids, teacher)
    torch.testing.assert_close(loss, torch.zeros(T, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, torch.zeros_like(grad), atol=1e-12, rtol=0)


@pytest.mark.parametrize("vocab", [4, 12], ids=["V==K", "V>K"])
def test_a_teacher_tail_of_exactly_zero_mass_contributes_nothing_and_stays_finite(vocab):
    T, K = 3, 4
    logits = torch.randn(T, vocab, dtype=torch.float64) * 3
    ids = distinct_ids(T, vocab, K, 2)
    # Exactly representable masses that add up to 1: the teacher's top-K holds all of it.
    teacher = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]] * T, dtype=torch.float64))
    loss, grad = support_loss_and_grad(logits, ids, teacher)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    ref_loss, ref_grad = reference_loss_and_grad(logits, ids, teacher)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-7, atol=1e-9)
    if vocab > K:  # every id the teacher leaves out is pushed down by its full p_u
        p = torch.softmax(logits, -1)
        outside_T_V = torch.ones_like(p, dtype=torch.bool).scatter(1, ids, False)
        torch.testing.assert_close(grad[outside_T_V], p[outside_T_V], rtol=1e-9, atol=1e-12)

    # float32 with V == K: the student's own tail rounds to 0 and is clamped, nothing becomes NaN or inf.
    logits32 = torch.randn(T, K) * 3
    loss32, grad32 = support_loss_and_grad(logits32, torch.arange(K).expand(T, K).contiguous(), teacher.float())
    assert torch.isfinite(loss32).all() and torch.isfinite(grad32).all()


def test_minus_infinity_teacher_entries_contribute_exactly_zero():
    T, V, K = 4, 20, 4
    logits = torch.randn(T, V, dtype=torch.float64)
    ids = distinct_ids(T, V, K, 3)
    teacher = torch.log(torch.tensor([[0.6, 0.2, 0.1, 0.05]] * T, dtype=torch.float64))
    padded = teacher.clone()
    padded[:, -1] = -math.inf  # a padded slot: the teacher gives that id nothing
    loss, grad = support_loss_and_grad(logits, ids, padded)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    ref_loss, ref_grad = reference_loss_and_grad(logits, ids, padded)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    # All of a row −inf: the teacher's mass is all tail, still finite.
    empty = torch.full((T, K), -math.inf, dtype=torch.float64)
    loss, grad = support_loss_and_grad(logits, ids, empty)
    ref_loss, ref_grad = reference_loss_and_grad(logits, ids, empty)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)


def test_position_options_pick_the_positions_they_name_and_leave_the_rest_untouched():
    T, V, K = 4, 30, 3
    logits = torch.randn(T, V, dtype=torch.float64)
    student_ids = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]])
    # Position 0 and 2: the teacher's ids inside the student's top-k; 1: one outside; 3: the outside id is padding.
    teacher_ids = torch.tensor([[2, 0, 1], [3, 20, 4], [8, 7, 6], [9, 21, 10]])
    teacher = torch.log(torch.tensor([[0.3, 0.3, 0.3], [0.9, 0.05, 0.04], [0.5, 0.2, 0.1], [0.5, 0.3, 0.1]],
                                     dtype=torch.float64))
    teacher[3, 1] = -math.inf

    assert L.support_positions("all", teacher_ids, teacher, student_ids) is None
    outside = L.support_positions("outside", teacher_ids, teacher, student_ids)
    assert outside.tolist() == [False, True, False, False]

    # Entropy over K + tail bins, by hand: 0.3·3 + 0.1 tail; 0.9/0.05/0.04 + 0.01; 0.5/0.2/0.1 + 0.2; ...
    def entropy(qs):
        return -sum(q * math.log(q) for q in qs if q > 0)

    by_hand = [entropy([0.3, 0.3, 0.3, 0.1]), entropy([0.9, 0.05, 0.04, 0.01]), entropy([0.5, 0.2, 0.1, 0.2]),
               entropy([0.5, 0.0, 0.1, 0.4])]
    torch.testing.assert_close(L.teacher_entropy(teacher), torch.tensor(by_hand, dtype=torch.float64))
    high = L.support_positions("entropy", teacher_ids, teacher, student_ids, min_entropy=1.2)
    assert high.tolist() == [h > 1.2 for h in by_hand] and 0 < int(high.sum()) < T

    for used in (outside, high):
        loss, grad = support_loss_and_grad(logits, teacher_ids, teacher, used)
        ref_loss, ref_grad = reference_loss_and_grad(logits, teacher_ids, teacher, used)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
        assert (loss[~used] == 0).all() and (grad[~used] == 0).all() and (grad[used] != 0).any()
    with pytest.raises(ValueError, match="support_positions"):
        L.support_positions("nowhere", teacher_ids, teacher, student_ids)


def test_a_token_the_student_almost_never_picks_is_pulled_up_by_about_q_minus_p():
    """The surrogate's pull on a token scales with the student's own p_u; the support term's does not."""
    V, K = 64, 4
    logits = torch.zeros(1, V, dtype=torch.float64)
    logits[0, :K] = 4.0  # the student's top-k: ids 0..3
    u = 40
    # p_u = 0.0009: its logit solved from the others' logsumexp.
    others = torch.logsumexp(torch.cat([logits[0, :u], logits[0, u + 1:]]), 0)
    logits[0, u] = others + math.log(0.0009 / (1 - 0.0009))
    p_u = float(torch.softmax(logits[0], -1)[u])
    assert p_u == pytest.approx(0.0009, rel=1e-9)

    q_u = 0.4
    teacher_ids = torch.tensor([[u, 0, 1, 2]])
    teacher = torch.log(torch.tensor([[q_u, 0.3, 0.1, 0.05]], dtype=torch.float64))
    _, grad = support_loss_and_grad(logits, teacher_ids, teacher)
    assert float(grad[0, u]) == pytest.approx(p_u - q_u, rel=1e-9)  # descent raises z_u by ~0.4 per unit step

    # The top-k select surrogate with the teacher's ids as its subset (the only mode where u is in S_t at all).
    student_logp = torch.log_softmax(logits, -1)
    targets = build_topk_targets(student_logp, student_logp.unsqueeze(0), K)
    targets.teacher_ids_C_T_K = teacher_ids.unsqueeze(0)
    targets.teacher_logprobs_C_T_K = teacher.unsqueeze(0)
    targets.old_at_teacher_C_T_K = student_logp.gather(1, teacher_ids).unsqueeze(0)
    subset = L.topk_subset(targets, subset_mode="teacher")
    leaf = logits.clone().requires_grad_(True)
    opd_T, _ = L.topk_select_loss(L.logprobs_at(leaf, subset.ids_T_K), subset)
    (opd_grad,) = torch.autograd.grad(opd_T.sum(), leaf)
    assert abs(float(opd_grad[0, u])) < 0.01 * abs(float(grad[0, u]))
    assert abs(float(grad[0, u])) > 0.39


def _sample(seed=0, T=7, V=50, K=4, C=2, teacher_width=None, hinted=True, agree_T=None):
    """A sample with C teacher candidates; where ``agree_T`` is True the teachers are the student itself."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, V, generator=g) * 2
    old = torch.log_softmax(logits, -1)
    noise_C_T_V = torch.randn(C, T, V, generator=g) * 2
    if agree_T is not None:
        noise_C_T_V[:, agree_T] = 0.0
    teacher_tables = torch.log_softmax(logits.unsqueeze(0) + noise_C_T_V, -1)
    targets = build_topk_targets(old, teacher_tables, K)
    if teacher_width is not None:  # the teacher asked for K' ids: the first K are the same as above
        wide = build_topk_targets(old, teacher_tables, teacher_width)
        targets.teacher_ids_C_T_K = wide.teacher_ids_C_T_K
        targets.teacher_logprobs_C_T_K = wide.teacher_logprobs_C_T_K
        targets.old_at_teacher_C_T_K = wide.old_at_teacher_C_T_K
    response = torch.randint(0, V, (T,), generator=g)
    sample = L.ObjectiveSample(response_ids_T=response, old_logprobs_T=old.gather(1, response[:, None])[:, 0],
                               reward=1.0, logits_T_V=logits.clone().requires_grad_(True), targets=targets,
                               hinted=hinted)
    return sample, teacher_tables


def _loss_and_grad(sample, settings):
    out = L.sample_objective(sample, settings)
    (grad,) = torch.autograd.grad(out.loss, sample.logits_T_V)
    return out, grad


@pytest.mark.parametrize("subset_mode", ["student", "teacher", "overlap"])
def test_support_coef_zero_reproduces_the_loss_without_the_term_bit_for_bit(subset_mode):
    sample, _ = _sample()
    settings = L.ObjectiveSettings(subset_mode=subset_mode)
    out, grad = _loss_and_grad(sample, settings)
    assert "opd_support_loss" not in out.metrics

    # The objective as it was before the term existed: one log-softmax over [response | subset] columns.
    subset = L.topk_subset(sample.targets, hint_selection=settings.hint_selection, subset_mode=subset_mode,
                           mask_T=torch.ones(7))
    gathered, _ = L.logprobs_and_entropy(sample.logits_T_V, torch.cat([sample.response_ids_T[:, None],
                                                                       subset.ids_T_K], 1))
    grpo_T, _ = L.grpo_token_loss(gathered[:, 0], sample.old_logprobs_T, 1.0, 0.2, 0.28)
    opd_T, _ = L.topk_select_loss(gathered[:, 1:], subset)
    before = 1.0 * L.masked_token_mean(grpo_T, torch.ones(7)) + 1.0 * L.masked_token_mean(opd_T, torch.ones(7))
    (before_grad,) = torch.autograd.grad(before, sample.logits_T_V)
    assert torch.equal(out.loss.detach(), before.detach())
    assert torch.equal(grad, before_grad)

    # Targets carrying a wider teacher top-K' change nothing while the term is off.
    wide, _ = _sample(teacher_width=12)
    wide_out, wide_grad = _loss_and_grad(wide, settings)
    assert torch.equal(wide_out.loss.detach(), out.loss.detach()) and torch.equal(wide_grad, grad)
    assert wide_out.metrics == out.metrics


@pytest.mark.parametrize("support_k,teacher_width", [(4, None), (2, None), (8, 12), (16, 12)])
def test_the_term_adds_its_weighted_kl_under_the_surrogates_h_star(support_k, teacher_width):
    sample, tables = _sample(teacher_width=teacher_width)
    base_out, base_grad = _loss_and_grad(sample, L.ObjectiveSettings())
    coef = 0.7
    out, grad = _loss_and_grad(sample, L.ObjectiveSettings(support_coef=coef, support_k=support_k))
    # h* is the surrogate's (sequence_optimal over the first K teacher ids); the term reads min(support_k, K')
    # of that candidate's ids, most likely first.
    narrow = sample.targets.teacher_top(4)
    h = int(L.select_hints(L.topk_overlap(narrow.student_ids_T_K, narrow.teacher_ids_C_T_K), "sequence_optimal")[0])
    width = min(support_k, teacher_width or 4)
    teacher_T_S, ids_T_S = tables[h].topk(width, dim=-1)
    ref_loss, ref_grad = reference_loss_and_grad(sample.logits_T_V, ids_T_S, teacher_T_S)
    torch.testing.assert_close(out.loss.double(), base_out.loss.double() + coef * ref_loss.mean(), rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(grad.double(), base_grad.double() + coef * ref_grad / 7, rtol=1e-4, atol=1e-6)
    m = out.metrics
    assert m["opd_support_applied"] == 1.0 and m["opd_support_positions"] == 1.0
    assert m["opd_support_loss"] == pytest.approx(float(ref_loss.mean()), rel=1e-5)
    assert m["loss"] == pytest.approx(base_out.metrics["loss"] + coef * m["opd_support_loss"], rel=1e-5)
    assert m["opd_support_teacher_mass"] == pytest.approx(float(teacher_T_S.exp().sum(-1).mean()), rel=1e-5)
    p_T_V = torch.softmax(sample.logits_T_V.detach().double(), -1)
    assert m["opd_support_student_mass"] == pytest.approx(float(p_T_V.gather(1, ids_T_S).sum(-1).mean()), rel=1e-5)
    # Everything else the objective reports is unchanged.
    for key, value in base_out.metrics.items():
        if key != "loss":
            assert m[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def test_the_term_follows_the_opd_branch_rule_for_unhinted_samples_and_the_method_weight():
    unhinted, _ = _sample(hinted=False)
    out = L.sample_objective(unhinted, L.ObjectiveSettings(support_coef=1.0))
    assert out.metrics["opd_support_applied"] == 0.0 and out.metrics["opd_support_loss"] == 0.0
    anchor = L.sample_objective(unhinted, L.ObjectiveSettings(support_coef=1.0, opd_on_unhinted="anchor"))
    assert anchor.metrics["opd_support_applied"] == 1.0 and anchor.metrics["opd_support_loss"] > 0

    sample, _ = _sample()
    half = L.sample_objective(sample, L.ObjectiveSettings(method="opd", w_opd=0.5, support_coef=1.0))
    off = L.sample_objective(sample, L.ObjectiveSettings(method="opd", w_opd=0.5))
    expected = float(off.loss.detach()) + 0.5 * half.metrics["opd_support_loss"]
    assert float(half.loss.detach()) == pytest.approx(expected, rel=1e-6)

    # Teachers that agree with the student's top-k at 3 of 7 positions: "outside" leaves exactly those out.
    mixed, _ = _sample(agree_T=torch.tensor([True, False, True, False, False, True, False]))
    full = L.sample_objective(mixed, L.ObjectiveSettings(support_coef=1.0))
    outside = L.sample_objective(mixed, L.ObjectiveSettings(support_coef=1.0, support_positions="outside"))
    assert full.metrics["opd_support_positions"] == 1.0
    assert outside.metrics["opd_support_positions"] == pytest.approx(4 / 7)
    # The positions left out are those where the teacher already matches the student: they had no KL to lose.
    assert outside.metrics["opd_support_loss"] == pytest.approx(full.metrics["opd_support_loss"], rel=1e-6)
    assert outside.metrics["opd_support_loss"] > 0


@pytest.mark.parametrize("bad,match", [
    (dict(support_coef=-0.1), "support_coef"),
    (dict(support_coef=float("nan")), "support_coef"),
    (dict(support_k=0), "support_k"),
    (dict(support_positions="some"), "support_positions"),
    (dict(support_min_entropy=-1.0), "support_min_entropy"),
])
def test_settings_are_checked_with_the_setting_named(bad, match):
    from clawloop.config import Config, ConfigError

    with pytest.raises(ValueError, match=match):
        L.ObjectiveSettings(**bad).validate()
    with pytest.raises(ConfigError, match=match):
        Config.from_dict(bad)


@pytest.mark.parametrize("method,w_opd", [("rl", None), ("combine", None), ("topk_kl", None), ("hybrid", 0.0)])
def test_methods_without_a_select_branch_leave_the_term_out(method, w_opd):
    """The default weight is on; a method that trains no top-k select OPD branch is accepted and unchanged by it."""
    from clawloop.config import Config

    settings = L.ObjectiveSettings(method=method, w_opd=w_opd, support_coef=1.0).validate()
    assert not L.support_active(settings)
    config = Config.from_dict(dict(method=method, **({} if w_opd is None else {"w_opd": w_opd})))
    assert config.support_coef > 0 and not L.support_active(config)


def test_the_config_turns_the_term_on_for_hybrid_and_opd():
    from clawloop.config import Config

    assert L.support_active(Config()) and L.support_active(Config.from_dict(dict(method="opd")))
    assert not L.support_active(Config.from_dict(dict(support_coef=0.0)))


def test_the_config_section_carries_the_settings_into_the_objective():
    from clawloop.config import Config

    config = Config.from_dict(dict(support_coef=0.25, support_k=8, support_positions="entropy",
                                   support_min_entropy=1.5))
    settings = L.ObjectiveSettings.from_config(config)
    assert (settings.support_coef, settings.support_k, settings.support_positions,
            settings.support_min_entropy) == (0.25, 8, "entropy", 1.5)
    assert config.objective.support_k == 8
    # The loss layer's own default is the original objective (no term); the product's config turns it on.
    assert L.ObjectiveSettings().support_coef == 0.0
    assert L.ObjectiveSettings.from_config(Config.from_dict({})).support_coef == Config().support_coef > 0
