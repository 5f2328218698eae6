"""The gate's preference check: a candidate whose answers the run's hint favours less than the last accepted
version's, by more than the margin, is rejected; the implicit reward it reads is the starting weights' own."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from clawloop.engines.model_files import turn_end_token_id
from clawloop.gate import gate as gate_module
from clawloop.gate.gate import PublicationGate, decide
from clawloop.gate.preference import PreferenceReading, implicit_rewards
from clawloop.renderers.chat import ChatRenderer, template_default_system
from clawloop.teacher import inject_hint

HINT = 'Begin every answer with "In short,".'
QUESTION = "What is a frog?"
ANSWERS = ("In short, a frog is a small animal that lives near water.",
           "A frog is a small animal that lives near water and eats insects.")


def _chat(tokenizer, messages):
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _direct_reward(model, tokenizer, answer_ids, system=None):
    """R by two plain full-sequence forwards in float64, independent of the gate's batching (``system``: the hint
    placed in the system prompt too, ``inject_hint``'s argument)."""
    messages = [{"role": "user", "content": QUESTION}]
    total = 0.0
    hinted = inject_hint(messages, HINT, system=system)
    for sign, prompt in ((1.0, _chat(tokenizer, hinted)), (-1.0, _chat(tokenizer, messages))):
        ids = torch.tensor([prompt + answer_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
        total += sign * sum(float(logp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(answer_ids))
    return total


def test_implicit_rewards_equal_a_direct_forward(tiny_tokenizer, base_model):
    messages = [{"role": "user", "content": QUESTION}]
    plain, hinted = _chat(tiny_tokenizer, messages), _chat(tiny_tokenizer, inject_hint(messages, HINT))
    answers = [list(tiny_tokenizer(a, add_special_tokens=False)["input_ids"]) for a in ANSWERS]
    got = implicit_rewards(base_model, [plain, plain], [hinted, hinted], answers)
    for r, ids in zip(got, answers):
        assert r == pytest.approx(_direct_reward(base_model, tiny_tokenizer, ids), abs=1e-3)


def test_decide_rejects_a_drop_beyond_the_margin_and_only_that():
    def reading(accepted, candidate):
        return PreferenceReading.of(HINT, [accepted], [candidate], [1], [1])

    assert reading(3.0, 1.0).drop == pytest.approx(2.0)
    rejected = decide([], 0.1, min_guard_pass=0.95, max_kl=4.0, preference=reading(3.0, 1.0), max_preference_drop=1.0)
    assert not rejected.accepted and "the hint's reward of the answers fell 2.000 nats/token" in rejected.reasons[0]
    for kept in (reading(3.0, 2.5), reading(1.0, 3.0)):  # within the margin, or higher than before
        assert decide([], 0.1, min_guard_pass=0.95, max_kl=4.0, preference=kept, max_preference_drop=1.0).accepted
    assert decide([], 0.1, min_guard_pass=0.95, max_kl=4.0, preference=None, max_preference_drop=0.0).accepted
    nan = PreferenceReading(HINT, 1, 1.0, math.nan)  # a reward that is not a number never passes
    assert not decide([], 0.1, min_guard_pass=0.95, max_kl=4.0, preference=nan, max_preference_drop=1.0).accepted


def test_the_reading_compares_rewards_per_answer_token_so_a_longer_answer_is_not_a_drop_by_itself():
    # A 40-token answer at -0.1 nats a token sums to -4 against a 5-token answer's -1.5 (-0.3 a token): summed, the
    # longer answer would read as 2.5 nats less favoured; per token it is 0.2 more favoured.
    reading = PreferenceReading.of(HINT, [-1.5, 2.0], [-4.0, 2.0], [5, 4], [40, 8])
    assert reading.accepted_mean == pytest.approx((-0.3 + 0.5) / 2)
    assert reading.candidate_mean == pytest.approx((-0.1 + 0.25) / 2)
    assert reading.drop == pytest.approx(0.1 - 0.075)
    assert (reading.accepted_sum_mean, reading.candidate_sum_mean) == (pytest.approx(0.25), pytest.approx(-1.0))
    assert decide([], 0.1, min_guard_pass=0.95, max_kl=4.0, preference=reading, max_preference_drop=0.05).accepted
    # An empty answer (R 0) counts as one token rather than dividing by zero.
    assert PreferenceReading.of(HINT, [0.0], [-2.0], [0], [4]).drop == pytest.approx(0.5)
    with pytest.raises(ValueError, match="same non-zero number"):
        PreferenceReading.of(HINT, [1.0], [1.0], [3], [])


@pytest.mark.parametrize("margin", [0.0, 1e6])
def test_a_candidate_the_hint_favours_less_than_the_accepted_version_is_rejected(monkeypatch, tiny_tokenizer,
                                                                                base_model, perturb, scripted,
                                                                                margin):
    # The gate reads each answer with its end token, since both ended before the cap.
    ids = [list(tiny_tokenizer(a, add_special_tokens=False)["input_ids"]) + [turn_end_token_id(tiny_tokenizer)]
           for a in ANSWERS]
    rewards = [_direct_reward(base_model, tiny_tokenizer, i) for i in ids]
    # The random tiny model favours one of the two answers under the hint; that one is the accepted version's.
    favoured, other = (0, 1) if rewards[0] > rewards[1] else (1, 0)
    accepted, candidate = perturb(base_model, 0.0, 1), perturb(base_model, 0.0, 2)
    scripted(monkeypatch, {id(base_model): {QUESTION: ANSWERS[other]}, id(accepted): {QUESTION: ANSWERS[favoured]},
                           id(candidate): {QUESTION: ANSWERS[other]}})
    hints: list[str | None] = [None]
    gate = PublicationGate(tiny_tokenizer, probe_tokens=64, probes=[QUESTION], max_kl=1e6,
                           preference_hint=lambda: hints[0], max_preference_drop=margin)
    reference = lambda: contextlib.nullcontext(base_model)  # noqa: E731
    first = gate.check(accepted, reference)
    assert first.accepted and first.preference is None  # nothing accepted before it: nothing to keep
    hints[0] = HINT
    second = gate.check(candidate, reference)
    reading = second.preference
    assert reading is not None and reading.hint == HINT and reading.probes == 1
    # Compared per answer token (each probe's summed R over its answer's length); the sums are kept beside.
    per_token = [r / len(i) for r, i in zip(rewards, ids)]
    assert reading.accepted_mean == pytest.approx(per_token[favoured], abs=1e-4)
    assert reading.candidate_mean == pytest.approx(per_token[other], abs=1e-4)
    assert reading.accepted_sum_mean == pytest.approx(rewards[favoured], abs=1e-3)
    assert reading.candidate_sum_mean == pytest.approx(rewards[other], abs=1e-3)
    assert second.probes[0].preference == pytest.approx(rewards[other], abs=1e-3)
    assert second.evidence()["preference"]["drop"] == pytest.approx(per_token[favoured] - per_token[other],
                                                                    abs=2e-4)
    # The margin is what decides: the tiny model's per-token readings of the two answers differ.
    assert abs(per_token[favoured] - per_token[other]) > 1e-3
    assert second.accepted == (margin > 0)
    if margin == 0:
        assert any("the hint's reward" in r for r in second.reasons)
    else:  # the accepted candidate's rewards, kept from its own check, are what the next one is held to
        third = gate.check(accepted, reference)
        assert third.preference.accepted_mean == pytest.approx(reading.candidate_mean, abs=1e-9)
        assert third.preference.candidate_mean == pytest.approx(per_token[favoured], abs=1e-4)
        # The same answers again: their rewards are known, so the reading runs no forward and finds no drop.
        forwards = []
        monkeypatch.setattr(gate_module, "answer_logprob_sums", lambda *a, **kw: forwards.append(a) or [])
        fourth = gate.check(accepted, reference)
        assert fourth.accepted and fourth.preference.drop == 0.0 and forwards == []


def test_the_check_reads_the_hint_where_the_teacher_does(monkeypatch, tiny_tokenizer, base_model, perturb,
                                                        scripted):
    # Under hint_placement = "system_and_user" the teacher reads the hint in the system prompt too; the check's
    # reward must be the one that teacher gives, not the user-message-only one.
    system = template_default_system(tiny_tokenizer)
    ids = list(tiny_tokenizer(ANSWERS[1], add_special_tokens=False)["input_ids"]) + [turn_end_token_id(tiny_tokenizer)]
    expected = _direct_reward(base_model, tiny_tokenizer, ids, system=system)
    assert abs(expected - _direct_reward(base_model, tiny_tokenizer, ids)) > 1e-3
    accepted, candidate = perturb(base_model, 0.0, 1), perturb(base_model, 0.0, 2)
    scripted(monkeypatch, {id(base_model): {QUESTION: ANSWERS[0]}, id(accepted): {QUESTION: ANSWERS[0]},
                           id(candidate): {QUESTION: ANSWERS[1]}})
    gate = PublicationGate(tiny_tokenizer, probe_tokens=64, probes=[QUESTION], max_kl=1e6,
                           preference_hint=lambda: HINT, max_preference_drop=1e6, hint_system=system)
    reference = lambda: contextlib.nullcontext(base_model)  # noqa: E731
    assert gate.check(accepted, reference).accepted
    assert gate.check(candidate, reference).probes[0].preference == pytest.approx(expected, abs=1e-3)


def test_the_unhinted_half_is_read_from_the_kl_forward_where_the_ids_are_the_messages_rendering(tiny_tokenizer):
    # A shipped probe's ids are its messages as the serving renderer writes them, so its reading costs the
    # reference no unhinted forward.
    shipped = PublicationGate(tiny_tokenizer, probes=[QUESTION]).shipped[0]
    assert ChatRenderer(tiny_tokenizer).render(shipped.messages).ids == shipped.ids


def test_no_hint_or_the_check_switched_off_changes_nothing(monkeypatch, tiny_tokenizer, base_model, perturb,
                                                          scripted):
    accepted, candidate = perturb(base_model, 0.0, 1), perturb(base_model, 0.0, 2)
    scripted(monkeypatch, {id(base_model): {QUESTION: ANSWERS[0]}, id(accepted): {QUESTION: ANSWERS[0]},
                           id(candidate): {QUESTION: ANSWERS[1]}})
    reference = lambda: contextlib.nullcontext(base_model)  # noqa: E731
    for hint_source in (None, lambda: None):
        gate = PublicationGate(tiny_tokenizer, probe_tokens=64, probes=[QUESTION], max_kl=1e6,
                               preference_hint=hint_source, max_preference_drop=0.0)
        assert gate.check(accepted, reference).accepted
        result = gate.check(candidate, reference)
        assert result.accepted and result.preference is None and result.probes[0].preference is None


def _one_accepted(monkeypatch, tiny_tokenizer, base_model, perturb, scripted, kl_to="reference"):
    """A gate with a hint to read that has accepted one version, and a candidate answering otherwise."""
    accepted, candidate = perturb(base_model, 0.0, 1), perturb(base_model, 0.0, 2)
    scripted(monkeypatch, {id(base_model): {QUESTION: ANSWERS[0]}, id(accepted): {QUESTION: ANSWERS[0]},
                           id(candidate): {QUESTION: ANSWERS[1]}})
    gate = PublicationGate(tiny_tokenizer, probe_tokens=64, probes=[QUESTION], max_kl=1e6,
                           preference_hint=lambda: HINT, max_preference_drop=0.0)
    reference = lambda: contextlib.nullcontext(base_model)  # noqa: E731
    assert gate.check(accepted, reference, kl_to=kl_to).accepted
    return gate, candidate, reference


def test_without_the_starting_weights_as_reader_the_check_does_not_read(monkeypatch, tiny_tokenizer, base_model,
                                                                       perturb, scripted):
    # Full fine-tuning without a frozen copy measures against the last accepted weights: a reader that changes with
    # every accepted version would compare readers, not answers.
    gate, candidate, reference = _one_accepted(monkeypatch, tiny_tokenizer, base_model, perturb, scripted,
                                               kl_to="last accepted")
    result = gate.check(candidate, reference, kl_to="last accepted")
    assert result.accepted and result.preference is None


def test_after_a_rollback_the_next_candidate_is_not_held_to_the_old_rewards(monkeypatch, tiny_tokenizer, base_model,
                                                                           perturb, scripted):
    gate, candidate, reference = _one_accepted(monkeypatch, tiny_tokenizer, base_model, perturb, scripted)
    gate.forget_accepted()  # the served version changed outside the gate
    result = gate.check(candidate, reference)
    assert result.accepted and result.preference is None


def test_a_reward_that_is_not_a_number_is_left_out_and_decides_nothing(monkeypatch, tiny_tokenizer, base_model,
                                                                     perturb, scripted):
    gate, candidate, reference = _one_accepted(monkeypatch, tiny_tokenizer, base_model, perturb, scripted)
    monkeypatch.setattr(gate_module, "answer_logprob_sums",
                        lambda model, prompts, answers, **kw: [math.nan] * len(prompts))
    result = gate.check(candidate, reference)
    assert result.accepted and result.preference is None and result.probes[0].preference is None


def test_an_answer_that_ended_is_read_with_its_end_token_and_one_cut_at_the_cap_without(
        monkeypatch, tiny_tokenizer, base_model, perturb, scripted):
    # Where an answer ends is part of what a length or closing preference asks; an answer the cap cut could go on,
    # so its reading must not include an end it never wrote.
    ids = list(tiny_tokenizer(ANSWERS[1], add_special_tokens=False)["input_ids"])
    end = [turn_end_token_id(tiny_tokenizer)]
    # The end token moves R, so a reading with it and one without cannot pass for each other.
    assert abs(_direct_reward(base_model, tiny_tokenizer, ids + end)
               - _direct_reward(base_model, tiny_tokenizer, ids)) > 1e-3
    # Ended well before the cap, one token before it, exactly at it (cut: a greedy answer that reaches its cap may
    # have gone on), and well past it.
    for cap, read in ((64, ids + end), (len(ids) + 1, ids + end), (len(ids), ids), (5, ids[:5])):
        accepted, candidate = perturb(base_model, 0.0, 1), perturb(base_model, 0.0, 2)
        scripted(monkeypatch, {id(base_model): {QUESTION: ANSWERS[0]}, id(accepted): {QUESTION: ANSWERS[0]},
                               id(candidate): {QUESTION: ANSWERS[1]}})
        gate = PublicationGate(tiny_tokenizer, probe_tokens=cap, probes=[QUESTION], max_kl=1e6,
                               preference_hint=lambda: HINT, max_preference_drop=1e6)
        reference = lambda: contextlib.nullcontext(base_model)  # noqa: E731
        assert gate.check(accepted, reference).accepted
        result = gate.check(candidate, reference)
        assert result.probes[0].tokens == min(cap, len(ids))
        expected = _direct_reward(base_model, tiny_tokenizer, read)
        assert result.probes[0].preference == pytest.approx(expected, abs=1e-3)
        assert result.preference.candidate_mean == pytest.approx(expected / len(read), abs=1e-4)
