"""The sampling distribution and the draw from it."""

from __future__ import annotations

import torch

from clawloop.engines.sampling import choose_tokens, sampling_logprobs, top_alternatives, top_p_renormalise


def test_draws_follow_the_distribution_and_never_hit_zero_probability_tokens():
    probs_V = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    logprobs_V = probs_V.log()
    n = 20000
    gen = torch.Generator().manual_seed(0)
    logits_B_V = logprobs_V.expand(n, -1).clone()
    draws = choose_tokens(logits_B_V, logits_B_V, [1.0] * n, [gen] * n)
    freq_V = torch.bincount(draws, minlength=6).float() / n
    assert freq_V[1] == 0 and freq_V[5] == 0
    assert torch.allclose(freq_V, probs_V, atol=0.015)


def test_draws_are_reproducible_per_generator_and_greedy_is_argmax():
    logits_B_V = torch.randn(3, 1000)
    logprobs_B_V = sampling_logprobs(logits_B_V, torch.tensor([0.0, 1.0, 1.0]), torch.ones(3))
    a = choose_tokens(logits_B_V, logprobs_B_V, [0.0, 1.0, 1.0],
                      [torch.Generator().manual_seed(s) for s in (0, 1, 2)])
    b = choose_tokens(logits_B_V, logprobs_B_V, [0.0, 1.0, 1.0],
                      [torch.Generator().manual_seed(s) for s in (9, 1, 2)])
    assert torch.equal(a, b)  # the greedy row ignores its generator; the others replay
    assert a[0] == logits_B_V[0].argmax()


def test_temperature_and_top_p():
    logits_V = torch.tensor([3.0, 2.0, 1.0, 0.0])
    lp = sampling_logprobs(logits_V[None], torch.tensor([0.5]), torch.tensor([1.0]))[0]
    assert torch.allclose(lp, torch.log_softmax(logits_V / 0.5, -1))
    greedy = sampling_logprobs(logits_V[None], torch.tensor([0.0]), torch.tensor([0.1]))[0]
    assert torch.allclose(greedy, torch.log_softmax(logits_V, -1))  # temperature 0: plain, top-p ignored
    probs = torch.softmax(logits_V, -1)  # ~[0.64, 0.24, 0.09, 0.03]
    nucleus = top_p_renormalise(probs.log()[None], torch.tensor([0.8]))[0]
    assert torch.isinf(nucleus[2:]).all()
    assert torch.allclose(nucleus[:2].exp(), probs[:2] / probs[:2].sum())
    only_top = top_p_renormalise(probs.log()[None], torch.tensor([0.01]))[0]
    assert only_top[0] == 0 and torch.isinf(only_top[1:]).all()
    assert top_alternatives(nucleus, 4) == [(0, float(nucleus[0])), (1, float(nucleus[1]))]
