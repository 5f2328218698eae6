"""The reference's kept prompt states (``clawloop.gate.scoring.PromptStates``): scoring answers after a kept KV cache
gives what a forward over the whole sequence gives, each prompt is prefilled once while it is kept, the states stay
within their token budget, and a check using them decides, measures and reads as one without them.

The tiny random Llama with the real tokenizer; answers are token ids of real text.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from clawloop.gate.gate import PublicationGate
from clawloop.gate.scoring import PromptStates, answer_logprob_sums, answer_logprobs

TEXTS = ("A turtle is a reptile with a hard shell.", "Yes.", "", "Paris",
         "Plants make sugar from light, water and air in their leaves, and store it for the night.")


def _prompts(tokenizer):
    long = " ".join(["Tell me about the weather in the mountains in spring and what to pack."] * 12)
    chats = [[{"role": "user", "content": "What is a turtle?"}],
             [{"role": "user", "content": "Hi"}],
             [{"role": "user", "content": long}, {"role": "assistant", "content": "Warm layers."},
              {"role": "user", "content": "And for the rain?"}],
             [{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "How do plants get energy from sunlight? " * 3}]]
    return [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
            for c in chats]


def _answers(tokenizer):
    return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in TEXTS]


def _close(a, b, tol=1e-4):
    assert a.shape == b.shape
    return a.numel() == 0 or float((a - b).abs().max()) < tol


def test_scores_after_a_kept_prompt_equal_scores_of_the_whole_sequence(tiny_tokenizer, base_model):
    prompts, answers = _prompts(tiny_tokenizer), _answers(tiny_tokenizer)
    assert len({len(p) for p in prompts}) == len(prompts) and max(len(p) for p in prompts) > 3 * min(map(len, prompts))
    whole = answer_logprobs(base_model, prompts, answers)
    states = PromptStates(100_000)
    kept = answer_logprobs(base_model, prompts, answers, states=states)
    assert all(_close(w, k) for w, k in zip(whole, kept))
    assert [len(k) for k in kept] == [len(a) for a in answers]
    assert states.prefilled == 4  # the empty answer's prompt needs nothing
    # Asked again (other answers, another order): nothing is prefilled again, and the scores still agree.
    again_prompts, again_answers = prompts[::-1], [a[:3] for a in answers[::-1]]
    again = answer_logprobs(base_model, again_prompts, again_answers, states=states)
    assert states.prefilled == 4
    assert all(_close(w, k) for w, k in zip(answer_logprobs(base_model, again_prompts, again_answers), again))
    sums = answer_logprob_sums(base_model, prompts, answers)
    assert answer_logprob_sums(base_model, prompts, answers, states=states) == pytest.approx(sums, abs=1e-3)


def test_scores_of_a_soft_capping_model_are_those_of_its_own_forward(tiny_tokenizer, soft_capped_model):
    """The gate scores answers from the decoder's hidden states through the output layer; for a model whose
    forward soft-caps its logits (Gemma 2), with or without kept prompt states, the log-probs are its forward's."""
    prompts, answers = _prompts(tiny_tokenizer)[:2], _answers(tiny_tokenizer)[:2]
    plain = answer_logprobs(soft_capped_model, prompts, answers)
    kept = answer_logprobs(soft_capped_model, prompts, answers, states=PromptStates(100_000))
    for p, a, got, got_kept in zip(prompts, answers, plain, kept):
        with torch.no_grad():
            logits_L_V = soft_capped_model(input_ids=torch.tensor([p + a])).logits[0]
        want = torch.log_softmax(logits_L_V[len(p) - 1:len(p) - 1 + len(a)].float(), dim=-1)
        assert _close(got, want) and _close(got_kept, want)


def test_kept_states_stay_within_their_budget_and_a_prompt_beyond_it_is_scored_without(tiny_tokenizer, base_model):
    prompts, answers = _prompts(tiny_tokenizer), _answers(tiny_tokenizer)
    # The longest prompt with an answer to score does not fit.
    budget = sorted(len(p) for p, a in zip(prompts, answers) if a)[-2]
    states = PromptStates(budget)
    kept = answer_logprobs(base_model, prompts, answers, states=states)
    assert all(_close(w, k) for w, k in zip(answer_logprobs(base_model, prompts, answers), kept))
    assert 0 < states.tokens <= budget and states.nbytes > 0
    assert states.prefilled >= 1  # in order, while they fit beside each other; the rest scored as without states
    longest = max((i for i in range(len(prompts)) if answers[i]), key=lambda i: len(prompts[i]))
    before = states.prefilled
    alone = answer_logprobs(base_model, [prompts[longest]], [answers[longest]], states=states)
    assert states.prefilled == before  # never kept: it alone exceeds the budget
    assert _close(answer_logprobs(base_model, [prompts[longest]], [answers[longest]])[0], alone[0])
    nothing = PromptStates(0)
    answer_logprobs(base_model, prompts, answers, states=nothing)
    assert nothing.tokens == 0 and nothing.prefilled == 0 and nothing.nbytes == 0
    with pytest.raises(ValueError):
        PromptStates(-1)


def test_a_check_with_kept_states_decides_measures_and_reads_as_one_without(tiny_tokenizer, base_model, perturb):
    # The tiny model answers with noise; the gate's own greedy answers are what gets scored, so the KL and the
    # preference reading run over real, varied answers. The rules that judge noise are switched off.
    candidates = [perturb(base_model, 0.02, seed) for seed in (1, 2, 3)]
    probes = ["What is a turtle?", "Give me two tips for writing a clear email.", "What is a kettle?"]

    def gate(states):
        return PublicationGate(tiny_tokenizer, min_guard_pass=0.0, max_kl=1e6, probe_tokens=12, probes=probes,
                               preference_hint=lambda: "Answer in one short sentence.", max_preference_drop=1e6,
                               prompt_states=states)

    states = PromptStates(100_000)
    with_states, without = gate(states), gate(None)
    reference = lambda: contextlib.nullcontext(base_model)  # noqa: E731
    for n, candidate in enumerate(candidates):
        a, b = with_states.check(candidate, reference), without.check(candidate, reference)
        assert a.accepted == b.accepted and a.kl == pytest.approx(b.kl, rel=1e-4, abs=1e-7)
        assert [p.answer for p in a.probes] == [p.answer for p in b.probes]
        assert [p.kl for p in a.probes] == pytest.approx([p.kl for p in b.probes], rel=1e-4, abs=1e-7)
        assert [p.preference for p in a.probes] == pytest.approx([p.preference for p in b.probes], abs=1e-3)
        if n > 0:  # from the second check on the preference check compares with an accepted version
            assert a.preference is not None and a.preference.drop == pytest.approx(b.preference.drop, abs=1e-3)
    # Each plain and each hinted prompt was prefilled once over the three checks.
    assert states.prefilled == 2 * len(probes)
    # Against weights that change (the last accepted version), no kept state is used.
    unused = PromptStates(100_000)
    gate(unused).check(candidates[0], reference, kl_to="last_accepted")
    assert unused.prefilled == 0


def test_the_least_recently_used_prompt_goes_first_and_a_call_keeps_what_it_uses(tiny_tokenizer, base_model):
    prompts, answers = _prompts(tiny_tokenizer), _answers(tiny_tokenizer)
    a, b, c = 0, 3, 4  # three prompts with answers
    states = PromptStates(len(prompts[a]) + len(prompts[b]) + len(prompts[c]) - 1)  # room for two of them
    answer_logprobs(base_model, [prompts[a]], [answers[a]], states=states)
    answer_logprobs(base_model, [prompts[b]], [answers[b]], states=states)
    answer_logprobs(base_model, [prompts[a]], [answers[a]], states=states)  # a is now the more recently used
    answer_logprobs(base_model, [prompts[c]], [answers[c]], states=states)  # c needs the room b had
    assert states.prefilled == 3
    answer_logprobs(base_model, [prompts[a], prompts[c]], [answers[a], answers[c]], states=states)
    assert states.prefilled == 3  # both still kept
    answer_logprobs(base_model, [prompts[b]], [answers[b]], states=states)
    assert states.prefilled == 4 and states.tokens <= states.max_tokens


def test_one_token_answers_and_a_prompt_asked_twice_in_one_call(tiny_tokenizer, base_model):
    prompts, answers = _prompts(tiny_tokenizer), _answers(tiny_tokenizer)
    twice = [prompts[0], prompts[1], prompts[0]]
    short = [answers[0][:1], answers[1][:1], answers[4][:1]]  # no forward beyond the kept prompts is needed
    states = PromptStates(100_000)
    kept = answer_logprobs(base_model, twice, short, states=states)
    assert all(_close(w, k) for w, k in zip(answer_logprobs(base_model, twice, short), kept))
    assert states.prefilled == 2 and [len(k) for k in kept] == [1, 1, 1]
