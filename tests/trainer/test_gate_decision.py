"""The publication gate's decision on real answers: SmolLM2-135M-Instruct's greedy answers to the 20 shipped
probes, from its starting weights and from candidates perturbed by seeded noise (``data/smollm2_probe_answers.json``
says how they were made), judged by the real guard.

* 17 probes count (the reference answers 3 unsoundly), as in the OpenClaw run whose every candidate was rejected;
* a near-identical candidate (KL < 1e-3) is not rejected over one borderline probe that tipped into a loop, nor
  over two; one regression passes at any KL (the threshold means "one regression passes" below 20 probes too);
* real regressions are still rejected: two probes broken by a candidate that moved (KL 0.07), six by a broken one,
  and a KL above ``max_kl``;
* through the whole check, with the recorded answers replayed in place of generation and the KL measured by the
  gate itself.
"""

from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import pytest
import torch

from clawloop.gate import gate as gate_module
from clawloop.gate.gate import NEAR_IDENTICAL_KL, ProbeOutcome, PublicationGate, decide, tolerated_regressions
from clawloop.gate.guard import check as guard_check
from clawloop.gate.probes import PROBES
from clawloop.gate.scoring import answer_logprobs

DATA = json.loads((Path(__file__).parent / "data" / "smollm2_probe_answers.json").read_text(encoding="utf-8"))
CANDIDATES = DATA["candidates"]
BORDERLINE = "What does a thermometer measure?"
POLITE = "Rewrite this more politely: give me the report now."


def outcomes(answers: list[str]) -> list[ProbeOutcome]:
    """Each shipped probe's outcome as the gate records it: the guard's verdict (question rules on) on the
    candidate's answer, and whether the reference's answer was sound."""
    out = []
    for prompt, reference, answer in zip(DATA["probes"], DATA["reference"], answers):
        verdict = guard_check(answer, question=prompt)
        out.append(ProbeOutcome(source="shipped", prompt=prompt, answer=answer, ok=verdict.ok,
                                reasons=list(verdict.reasons), reference_ok=guard_check(reference, question=prompt).ok,
                                kl=0.0, tokens=0))
    return out


def regressed(probe_outcomes: list[ProbeOutcome]) -> list[str]:
    return [o.prompt for o in probe_outcomes if o.reference_ok and not o.ok]


def test_the_recorded_reference_counts_17_of_the_shipped_probes():
    assert DATA["probes"] == list(PROBES)
    unsound = [o.prompt for o in outcomes(DATA["reference"]) if not o.reference_ok]
    assert unsound == ["Name three planets of the solar system.", "Suggest a name for a friendly grey cat.",
                       "What is an umbrella?"]
    # The borderline probe: the reference's own answer repeats a 5-word clause twice, one short of a loop.
    assert DATA["reference"][0].count("typically a liquid or gas, and converts it into a temperature reading") == 2


def test_a_near_identical_candidate_is_not_rejected_over_one_flaky_borderline_probe():
    candidate = CANDIDATES["near_identical_one_flip"]
    probe_outcomes = outcomes(candidate["answers"])
    assert regressed(probe_outcomes) == [BORDERLINE]
    assert "repeated_ngram" in probe_outcomes[0].reasons and candidate["kl"] < NEAR_IDENTICAL_KL
    decision = decide(probe_outcomes, candidate["kl"], min_guard_pass=0.95, max_kl=4.0)
    assert decision.accepted and decision.reasons == []
    assert (decision.counted, decision.regressions) == (17, 1) and decision.guard_pass == pytest.approx(16 / 17)
    # One regression in 17 passes whatever the KL: a trained step (KL 0.05) with the same answers is accepted too.
    assert decide(probe_outcomes, 0.05, min_guard_pass=0.95, max_kl=4.0).accepted


def test_a_near_identical_candidate_may_tip_two_borderline_probes_a_moved_one_may_not():
    near = CANDIDATES["near_identical_two_flips"]
    assert regressed(outcomes(near["answers"])) == [BORDERLINE, POLITE] and near["kl"] < NEAR_IDENTICAL_KL
    assert decide(outcomes(near["answers"]), near["kl"], min_guard_pass=0.95, max_kl=4.0).accepted

    moved = CANDIDATES["moved_two_regressions"]
    assert regressed(outcomes(moved["answers"])) == [BORDERLINE, POLITE] and moved["kl"] >= NEAR_IDENTICAL_KL
    decision = decide(outcomes(moved["answers"]), moved["kl"], min_guard_pass=0.95, max_kl=4.0)
    assert not decision.accepted
    assert decision.reasons == ["guard pass 0.882 < 0.950: 2 of 17 counted probes regressed, 1 tolerated "
                                "(off_topic, repeated_ngram)"]


def test_real_regressions_are_still_rejected():
    broken = CANDIDATES["broken"]
    assert len(regressed(outcomes(broken["answers"]))) == 6
    decision = decide(outcomes(broken["answers"]), broken["kl"], min_guard_pass=0.95, max_kl=4.0)
    assert not decision.accepted and "6 of 17 counted probes regressed" in decision.reasons[0]
    # A near-identical KL does not excuse several broken probes.
    assert not decide(outcomes(broken["answers"]), 1e-4, min_guard_pass=0.95, max_kl=4.0).accepted
    # One flaky probe, but the candidate drifted past the KL bound.
    one_flip = outcomes(CANDIDATES["near_identical_one_flip"]["answers"])
    assert decide(one_flip, 4.5, min_guard_pass=0.95, max_kl=4.0).reasons == ["KL 4.50 > 4.00 nats/token"]
    assert not decide(one_flip, float("nan"), min_guard_pass=0.95, max_kl=4.0).accepted


@pytest.mark.parametrize(("counted", "min_guard_pass", "tolerated", "near_identical"), [
    (17, 0.95, 1, 2),   # 0.05 x 17 = 0.85: the share alone tolerated none
    (20, 0.95, 1, 2),
    (25, 0.95, 1, 2),
    (39, 0.95, 1, 2),
    (40, 0.95, 2, 3),
    (10, 0.9, 1, 2),    # 0.1 x 10 is 0.9999999999999998 in floating point
    (17, 1.0, 0, 0),    # every probe must pass
    (30, 0.0, 30, 31),
])
def test_the_tolerated_regressions_at_any_number_of_counted_probes(counted, min_guard_pass, tolerated,
                                                                    near_identical):
    assert tolerated_regressions(counted, min_guard_pass) == tolerated
    assert tolerated_regressions(counted, min_guard_pass, near_identical=True) == near_identical


def _replayed_check(monkeypatch, tokenizer, candidate_model, reference_model, candidate_answers):
    """The gate's whole check on the tiny model (same tokenizer as SmolLM2), with the recorded answers standing in
    for greedy generation; everything else (guard verdicts, the reference's kept verdicts, KL between the two
    models over the candidate's answers) is the gate's own."""
    gate = PublicationGate(tokenizer, min_guard_pass=0.95, max_kl=4.0, probe_tokens=64)
    recorded = {id(candidate_model): candidate_answers, id(reference_model): DATA["reference"]}
    by_prompt = {tuple(p.ids): i for i, p in enumerate(gate.shipped)}

    def replay(model, prompts, max_tokens, eos_ids, **sampling):  # no knowledge probes here: all greedy
        texts = recorded[id(model)]
        answers = [list(tokenizer(texts[by_prompt[tuple(p)]], add_special_tokens=False)["input_ids"])
                   for p in prompts]
        return answers, answer_logprobs(model, prompts, answers)

    monkeypatch.setattr(gate_module, "probe_answers", replay)
    return gate.check(candidate_model, lambda: contextlib.nullcontext(reference_model))


def test_the_check_accepts_the_near_identical_candidate_and_rejects_the_broken_one(monkeypatch, tiny_tokenizer,
                                                                                  base_model):
    candidate = copy.deepcopy(base_model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in candidate.parameters():  # a near-identical candidate, as the recorded one was made
            p.add_(torch.randn(p.shape, generator=generator) * 1e-3 * p.abs().mean())
    result = _replayed_check(monkeypatch, tiny_tokenizer, candidate, base_model,
                             CANDIDATES["near_identical_one_flip"]["answers"])
    assert 0 < result.kl < NEAR_IDENTICAL_KL
    assert result.accepted, result.reasons
    assert (result.counted, result.regressions) == (17, 1) and result.guard_pass < 0.95
    assert [p.prompt for p in result.probes if p.reference_ok and not p.ok] == [BORDERLINE]
    assert result.evidence()["thresholds"]["tolerated_regressions"] == 2.0

    broken = _replayed_check(monkeypatch, tiny_tokenizer, candidate, base_model, CANDIDATES["broken"]["answers"])
    assert not broken.accepted and "6 of 17 counted probes regressed" in broken.reasons[0]
