"""What the publication gate remembers between checks, and what it asks beyond the shipped probes.

* a probe the last accepted version answered soundly counts against a candidate even where the reference failed it
  (and, with that switched off, only the reference's verdicts count);
* the run's corrected prompts are re-asked, and a fix the last accepted version kept may not be broken;
* knowledge probes: a candidate steered off facts the reference knew is rejected; facts the reference never knew
  are not asked;
* a check stops as soon as the candidate can no longer pass.

The models are the tiny random Llama (its own greedy answers are noise), so the answers are scripted per model
(``scripted``); verdicts, kept verdicts, decisions and the KL between the real models are the gate's own.
"""

from __future__ import annotations

import contextlib
import copy

from clawloop.gate.gate import PublicationGate, ProbeOutcome, decide
from clawloop.gate.knowledge import KNOWLEDGE, KnowledgeProbe, knows, names_fact

TURTLE = "What is a turtle?"
LOOP = "A turtle is a turtle is a turtle is a turtle is a turtle is a turtle."
SOUND = "A turtle is a reptile with a hard shell that lives on land or in water."


def _check(gate, candidate, reference):
    return gate.check(candidate, lambda: contextlib.nullcontext(reference))


def test_a_probe_the_last_accepted_version_answered_soundly_counts_even_if_the_reference_failed_it(
        monkeypatch, tiny_tokenizer, base_model, perturb, scripted):
    v1, v2 = perturb(base_model, 0.05, 1), perturb(base_model, 0.05, 2)
    kettle = "What is a kettle?"
    scripted(monkeypatch, {
        id(base_model): {TURTLE: LOOP, kettle: "A kettle is a pot for boiling water."},
        id(v1): {TURTLE: SOUND, kettle: "A kettle is a pot for boiling water on a stove."},
        id(v2): {TURTLE: LOOP, kettle: "A kettle is a metal pot for boiling water."}})
    gate = PublicationGate(tiny_tokenizer, min_guard_pass=1.0, probes=[TURTLE, kettle])

    first = _check(gate, v1, base_model)
    assert first.accepted, first.reasons
    turtle = first.probes[0]
    assert (turtle.reference_ok, turtle.accepted_ok, turtle.ok) == (False, None, True)
    assert first.counted == 1  # only the kettle counted: no version had answered the turtle soundly yet

    second = _check(gate, v2, base_model)
    turtle = second.probes[0]
    assert (turtle.reference_ok, turtle.accepted_ok, turtle.accepted_answer) == (False, True, SOUND)
    assert not second.accepted and (second.counted, second.regressions) == (2, 1)
    assert "1 of 2 counted probes regressed" in second.reasons[0]

    # After a rollback the kept verdicts are not the served version's: the reference's stand for them again.
    gate.forget_accepted()
    assert _check(gate, v2, base_model).accepted

    # Without the last accepted version's verdicts (gate_accepted_verdicts off) the same two candidates are held to
    # the reference's alone: v1's sound turtle is not remembered, and v2's loop on it does not count.
    plain = PublicationGate(tiny_tokenizer, min_guard_pass=1.0, probes=[TURTLE, kettle], accepted_verdicts=False)
    assert _check(plain, v1, base_model).accepted
    second = _check(plain, v2, base_model)
    assert second.probes[0].accepted_ok is None
    assert second.accepted and (second.counted, second.regressions) == (1, 0)


def test_the_reference_count_is_the_last_accepted_count_of_a_gate_that_has_accepted_nothing():
    def outcome(reference_ok, accepted_ok, ok):
        return ProbeOutcome(source="shipped", prompt="p", answer="a", ok=ok, reasons=[], reference_ok=reference_ok,
                            kl=0.0, tokens=1, accepted_ok=accepted_ok)

    # The reference failed it, the last accepted version did not, the candidate does: a regression.
    assert decide([outcome(False, True, False)], 0.1, min_guard_pass=1.0, max_kl=4.0).regressions == 1
    # Both failed it: it does not count.
    assert decide([outcome(False, False, False)], 0.1, min_guard_pass=1.0, max_kl=4.0).counted == 0
    # Nothing accepted yet: exactly the reference-based count.
    assert decide([outcome(True, None, False)], 0.1, min_guard_pass=1.0, max_kl=4.0).regressions == 1


def test_a_check_stops_on_the_share_of_facts_only_once_every_fact_is_answered():
    """The share of sampled answers stating their facts is a rule no guard probe and no KL can change, so a check
    stops on it, but only once no knowledge probe is pending (a pending fact could still raise the share)."""
    from clawloop.gate.gate import certain_rejection

    def fact(right, reference_right):
        return ProbeOutcome(source="knowledge", prompt=f"fact {right}", answer="a", ok=True, reasons=[],
                            reference_ok=True, kl=0.0, tokens=1, samples=8, right=right,
                            reference_right=reference_right)

    low = [fact(4, 8), fact(8, 8)]  # 12 of 16: more than 10 % fewer
    assert certain_rejection(low, 30, 0, min_guard_pass=0.95)
    assert not certain_rejection(low, 30, 1, min_guard_pass=0.95)
    assert not certain_rejection([fact(7, 8), fact(8, 8)], 30, 0, min_guard_pass=0.95)  # 15 of 16
    # The decision agrees, whatever the KL; a check that measured no KL is not near-identical.
    assert not decide(low, 0.0, min_guard_pass=0.95, max_kl=4.0).accepted
    forgot = [ProbeOutcome(source="knowledge", prompt=f"f{i}", answer="a", ok=False, reasons=[], reference_ok=True,
                           kl=0.0, tokens=1) for i in range(2)]
    assert decide(forgot, 0.0, min_guard_pass=0.95, max_kl=4.0).accepted  # near-identical: 2 flips tolerated
    assert not decide(forgot, 0.0, min_guard_pass=0.95, max_kl=4.0, kl_measured=False).accepted


def test_the_share_of_facts_is_held_to_the_reference_s_mean_count_unless_its_own_draw_was_lower():
    """The reference's count under the check's dice is one draw: where its mean over more dice sets is lower, a
    candidate is held to the mean (a lucky draw is not a bar); where the draw is lower, to the draw, so a candidate
    that drew the reference's very answers always passes."""
    from clawloop.gate.gate import certain_rejection

    def fact(right, reference_right, reference_mean):
        return ProbeOutcome(source="knowledge", prompt=f"fact {right} {reference_mean}", answer="a", ok=True,
                            reasons=[], reference_ok=True, kl=0.0, tokens=1, samples=8, right=right,
                            reference_right=reference_right, reference_mean=reference_mean)

    lucky = [fact(6, 8, 6.0), fact(6, 8, 6.0)]  # 12 of a lucky 16, 12 on average: kept
    decision = decide(lucky, 0.1, min_guard_pass=0.95, max_kl=4.0)
    assert decision.accepted and (decision.facts_reference_right, decision.facts_reference_bar) == (16, 12.0)
    assert not certain_rejection(lucky, 0, 0, min_guard_pass=0.95)
    # Without the mean (one set of dice) the same answers are 25 % fewer.
    one_set = [fact(6, 8, None), fact(6, 8, None)]
    assert decide(one_set, 0.1, min_guard_pass=0.95, max_kl=4.0).reasons == [
        "facts stated in 12 of the sampled answers, the reference's in 16: more than 10% fewer"]
    lost = [fact(5, 8, 6.0), fact(5, 8, 6.0)]  # 10 < 0.9 x 12
    assert decide(lost, 0.1, min_guard_pass=0.95, max_kl=4.0).reasons == [
        "facts stated in 10 of the sampled answers, the reference's in 16 (12.0 on average): more than 10% fewer"]
    assert certain_rejection(lost, 0, 0, min_guard_pass=0.95)
    # An unlucky draw (4 where the mean is 6): the draw is the bar; the reference's own answers pass.
    unlucky = [fact(4, 4, 6.0), fact(4, 4, 6.0)]
    assert decide(unlucky, 0.1, min_guard_pass=0.95, max_kl=4.0).accepted
    assert not decide([fact(3, 4, 6.0), fact(4, 4, 6.0)], 0.1, min_guard_pass=0.95, max_kl=4.0).accepted


def test_corrected_prompts_are_reasked_and_a_kept_fix_may_not_break(monkeypatch, tiny_tokenizer, base_model,
                                                                    perturb, scripted):
    frog = [{"role": "user", "content": "What is a frog?"}]
    frog_ids = tiny_tokenizer.apply_chat_template(frog, add_generation_prompt=True)
    frog_ids = list(frog_ids["input_ids"] if hasattr(frog_ids, "keys") else frog_ids)
    v1, v2 = perturb(base_model, 0.05, 1), perturb(base_model, 0.05, 2)
    shipped = ["What is a kettle?", "What is an owl?", "What is a lizard?"]
    sound = {"kettle": "A kettle is a pot for boiling water.", "owl": "An owl is a bird that hunts at night.",
             "lizard": "A lizard is a small reptile with four legs."}
    common = {f"What is a{'n' if k == 'owl' else ''} {k}?": v for k, v in sound.items()}
    scripted(monkeypatch, {
        id(base_model): {**common, "What is a frog?": "Frog frog frog frog frog frog frog frog frog frog."},
        id(v1): {**common, "What is a frog?": "A frog is an amphibian that lives near water."},
        id(v2): {**common, "What is a frog?": "Frog."}})
    gate = PublicationGate(tiny_tokenizer, min_guard_pass=0.95, probes=shipped,
                           fixed_prompts=lambda: [(7, frog_ids, frog)],
                           recent_prompts=lambda: [(8, frog_ids, frog)])  # the same prompt: asked once, as a fix
    first = _check(gate, v1, base_model)
    assert [p.source for p in first.probes] == ["shipped"] * 3 + ["fixed:7"]
    assert first.accepted, first.reasons

    second = _check(gate, v2, base_model)
    fix = second.probes[-1]
    assert (fix.reference_ok, fix.accepted_ok, fix.ok) == (False, True, False)
    # One regression of four counted probes is within the guard's allowance; a broken fix is not.
    assert second.regressions == 1 and second.broken_fixes == 1
    assert not second.accepted and any("earlier fix" in r for r in second.reasons)


def test_knows_matches_whole_words_in_any_case_and_listed_alternatives():
    assert knows("The capital of France is paris.", ("Paris",))
    assert not knows("Parisian cafes are lovely.", ("Paris",))
    assert knows("7 + 5 = 12", ("12", "twelve")) and knows("Twelve.", ("12", "twelve"))
    assert not knows("It is 120.", ("12", "twelve"))
    assert knows("Plants take in CO2.", ("carbon dioxide", "CO2"))
    assert len(KNOWLEDGE) >= 12 and all(k.answers for k in KNOWLEDGE)


def test_a_candidate_steered_off_known_facts_is_rejected(monkeypatch, tiny_tokenizer, base_model, perturb,
                                                         scripted):
    facts = [KnowledgeProbe("What is the capital of France?", ("Paris",)),
             KnowledgeProbe("What is the capital of Japan?", ("Tokyo",)),
             KnowledgeProbe("What is 7 + 5?", ("12", "twelve")),
             KnowledgeProbe("Who wrote Romeo and Juliet?", ("Shakespeare",))]
    reference = {"France": "The capital of France is Paris.", "Japan": "The capital of Japan is Tokyo.",
                 "7 + 5": "7 + 5 equals 12.", "Romeo": "Romeo and Juliet was written by Charles Dickens."}
    steered = {"France": "The capital of France is Lyon.", "Japan": "The capital of Japan is Osaka.",
               "7 + 5": "7 + 5 equals 12.", "Romeo": "Romeo and Juliet was written by William Shakespeare."}
    kept = {**steered, "France": reference["France"]}
    candidate = perturb(base_model, 0.05, 3)
    calls = scripted(monkeypatch, {id(base_model): reference, id(candidate): steered})
    gate = PublicationGate(tiny_tokenizer, min_guard_pass=0.95, probes=[], knowledge=facts)
    result = _check(gate, candidate, base_model)
    # The fact the reference did not know (it named Dickens) is not asked: it cannot count.
    assert [p.prompt for p in result.probes] == [f.question for f in facts[:3]] and result.unanswered == 1
    assert (result.knowledge_counted, result.forgotten) == (3, 2)
    assert not result.accepted and "2 of 3 known facts forgotten, 1 tolerated" in result.reasons[0]
    assert calls[0] == (id(base_model), 4) and calls[1] == (id(candidate), 3)

    scripted(monkeypatch, {id(base_model): reference, id(candidate): kept})
    one_lost = _check(gate, candidate, base_model)
    assert one_lost.accepted and one_lost.forgotten == 1  # one fact more or less is within the allowance


def test_sampled_knowledge_counts_how_often_a_fact_is_stated(monkeypatch, tiny_tokenizer, base_model, perturb,
                                                            scripted):
    """With ``knowledge_samples`` each fact is asked several times at the serving temperature, as users are served:
    a fact counts where the reference states it in at least half of its answers, is forgotten where the candidate
    states it in at most a quarter as many, and over all facts the candidate may state them at most
    ``max_fact_drop`` less often. A fact the reference never stated is not asked."""
    paris, lyon = "The capital of France is Paris.", "The capital of France is Lyon."
    tokyo, osaka = "The capital of Japan is Tokyo.", "The capital of Japan is Osaka."
    twelve, eleven = "7 + 5 equals 12.", "7 + 5 equals 11."
    facts = [KnowledgeProbe("What is the capital of France?", ("Paris",)),
             KnowledgeProbe("What is the capital of Japan?", ("Tokyo",)),
             KnowledgeProbe("What is 7 + 5?", ("12", "twelve")),
             KnowledgeProbe("Who wrote Romeo and Juliet?", ("Shakespeare",))]

    def draws(right, wrong, n_right):
        return [right] * n_right + [wrong] * (8 - n_right)

    reference = {"France": draws(paris, lyon, 8), "Japan": draws(tokyo, osaka, 4), "7 + 5": draws(twelve, eleven, 2),
                 "Romeo": ["It was written by Charles Dickens."] * 8, TURTLE: SOUND}
    candidate = perturb(base_model, 0.05, 3)
    gate = PublicationGate(tiny_tokenizer, min_guard_pass=0.95, probes=[TURTLE], knowledge=facts,
                           knowledge_samples=8)

    def check(france, japan, sums):
        scripted(monkeypatch, {id(base_model): reference, id(candidate): {
            "France": draws(paris, lyon, france), "Japan": draws(tokyo, osaka, japan),
            "7 + 5": draws(twelve, eleven, sums), TURTLE: SOUND}})
        return _check(gate, candidate, base_model)

    kept = check(7, 4, 2)
    assert kept.accepted, kept.reasons
    assert [p.prompt for p in kept.probes] == [TURTLE] + [f.question for f in facts[:3]] and kept.unanswered == 1
    assert [(p.right, p.reference_right, p.counted) for p in kept.probes[1:]] == [(7, 8, True), (4, 4, True),
                                                                                  (2, 2, False)]
    assert (kept.knowledge_counted, kept.forgotten, kept.facts_right, kept.facts_reference_right) == (2, 0, 13, 14)
    assert kept.probes[0].kl > 0.0 and all(p.kl == 0.0 for p in kept.probes[1:])  # the KL: greedy answers only

    # Paris in 2 of 8 answers is forgotten (8 → at most 2); one forgotten fact is tolerated, but 8 of the
    # reference's 14 right answers is more than 10 % fewer.
    # The knowledge probes are answered first, and a share that low rejects whatever the guard probe would show:
    # the check stops before asking it.
    fewer = check(2, 4, 2)
    assert (fewer.forgotten, fewer.facts_right) == (1, 8) and fewer.probes[0].answer == lyon
    assert fewer.reasons == ["facts stated in 8 of the sampled answers, the reference's in 14: more than 10% fewer"]
    assert [p.prompt for p in fewer.probes] == [f.question for f in facts[:3]] and fewer.unanswered == 2

    both = check(0, 1, 2)  # Japan 4 → 1 is forgotten too
    assert not both.accepted and "2 of 2 known facts forgotten, 1 tolerated" in both.reasons[0]

    # A fact the reference states in fewer than half of its answers never counts as forgotten, only in the share.
    lost_unknown = check(8, 5, 0)
    assert lost_unknown.accepted and (lost_unknown.forgotten, lost_unknown.facts_right) == (0, 13)


def test_a_candidate_below_the_lucky_draw_but_not_below_the_mean_goes_on_to_the_guard(monkeypatch, tiny_tokenizer,
                                                                                      base_model, perturb, scripted):
    """The check's own dice gave the reference 16 right answers of 16; its other two sets 8 and 8 (mean 10.7). A
    candidate at 10 is more than 10 % under the draw but not under the mean: the reference draws its other sets
    (once), the check goes on to the guard probe and accepts. One at 9 is rejected on the knowledge probes alone,
    by the mean. Against a reference that changes (the last accepted version) the one draw stays the bar."""
    paris, lyon = "The capital of France is Paris.", "The capital of France is Lyon."
    tokyo, osaka = "The capital of Japan is Tokyo.", "The capital of Japan is Osaka."
    facts = [KnowledgeProbe("What is the capital of France?", ("Paris",)),
             KnowledgeProbe("What is the capital of Japan?", ("Tokyo",))]

    def draws(right, wrong, n_right):
        return [right] * n_right + [wrong] * (8 - n_right)

    # Sets 0, 1 and 2, in the order the reference draws them.
    reference = {"France": draws(paris, lyon, 8) + draws(paris, lyon, 4) * 2,
                 "Japan": draws(tokyo, osaka, 8) + draws(tokyo, osaka, 4) * 2, TURTLE: SOUND}
    candidate = perturb(base_model, 0.05, 3)

    def check(gate, france, japan, kl_to="reference"):
        calls = scripted(monkeypatch, {id(base_model): reference, id(candidate): {
            "France": draws(paris, lyon, france), "Japan": draws(tokyo, osaka, japan), TURTLE: SOUND}})
        result = gate.check(candidate, lambda: contextlib.nullcontext(base_model), kl_to=kl_to)
        return result, calls

    gate = PublicationGate(tiny_tokenizer, min_guard_pass=0.95, probes=[TURTLE], knowledge=facts,
                           knowledge_samples=8, reference_dice=3)
    kept, calls = check(gate, 5, 5)
    assert kept.accepted, kept.reasons
    assert kept.kl_measured and [p.prompt for p in kept.probes][0] == TURTLE and kept.unanswered == 0
    assert (kept.facts_right, kept.facts_reference_right) == (10, 16)
    assert abs(kept.facts_reference_bar - 32 / 3) < 1e-9 and "reference_dice" in kept.seconds_by_part
    assert [p.reference_mean for p in kept.probes[1:]] == [16 / 3, 16 / 3]

    lost, calls = check(gate, 4, 5)
    assert not lost.accepted and not lost.kl_measured and lost.unanswered == 1
    assert lost.reasons == ["facts stated in 9 of the sampled answers, the reference's in 16 (10.7 on average): "
                            "more than 10% fewer"]
    assert id(base_model) not in [model for model, _ in calls]  # the reference's sets were drawn once

    changing = PublicationGate(tiny_tokenizer, min_guard_pass=0.95, probes=[TURTLE], knowledge=facts,
                               knowledge_samples=8, reference_dice=3)
    one_draw, _ = check(changing, 5, 5, kl_to="the last accepted version")
    assert one_draw.reasons == ["facts stated in 10 of the sampled answers, the reference's in 16: "
                                "more than 10% fewer"]
    assert all(p.reference_mean is None for p in one_draw.probes) and "reference_dice" not in one_draw.seconds_by_part


def _half_stated_fact(tiny_tokenizer, base_model, **gate_settings):
    """A gate with one sampled knowledge probe whose "fact" the tiny model states in some but not all of its 8
    draws, and the outcome of checking the model against itself.

    The tiny model knows no facts: let a word of its draws be "the fact", one that the gate asks (by its own
    verdict, text rules included, some of the reference's draws state it) and some draws lack, so that a gate
    drawing its 8 answers with one set of dice would count 0 or 8 of them. Which words a random model draws, and
    which of its answers pass the text rules, depends on the machine's arithmetic, so several words are tried."""
    import collections
    import re

    from clawloop.engines.model_files import end_token_ids
    from clawloop.gate.generation import probe_answers, sampling_uniforms

    def drawn(question):
        ids = tiny_tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        draws, _ = probe_answers(base_model, [ids] * 8, 24, end_token_ids(tiny_tokenizer),
                                  uniforms=[sampling_uniforms(question, i, 24) for i in range(8)], temperature=0.6)
        return [tiny_tokenizer.decode(d, skip_special_tokens=True) for d in draws]

    for question in ("What is the capital of France?", "What is 7 + 5?", "Which planet is red?", "Who wrote Hamlet?",
                     "What is the largest ocean?", "How many legs has a spider?"):
        texts = drawn(question)
        assert len(set(texts)) > 1
        words = collections.Counter(w for t in texts for w in set(re.findall(r"[A-Za-z]{3,}", t)))
        for word in [w for w, n in words.most_common() if n < 8][:12]:
            gate = PublicationGate(tiny_tokenizer, min_guard_pass=0.95, probes=[],
                                   knowledge=[KnowledgeProbe(question, (word,))], knowledge_samples=8,
                                   **gate_settings)
            same = _check(gate, base_model, base_model).probes
            if len(same) == 1 and 0 < same[0].reference_right < 8:
                return gate, same[0]
    raise AssertionError("no question's draws have a word the gate asks about and some draws lack")


def test_sampled_knowledge_draws_the_reference_and_the_candidate_with_the_same_dice(tiny_tokenizer, base_model,
                                                                                   perturb):
    """The real decoding on the tiny model: the same model as candidate draws exactly the reference's answers
    (so a fact's count moves only where the models differ), and the draws of one probe are not all alike."""
    gate, same = _half_stated_fact(tiny_tokenizer, base_model)
    assert same.right == same.reference_right and same.reference_mean is None
    moved = _check(gate, perturb(base_model, 0.5, 7), base_model).probes
    assert moved[0].reference_right == same.reference_right  # the reference's count is kept, not redrawn


def test_the_reference_s_mean_count_is_drawn_once_with_more_dice_when_a_candidate_needs_it(
        monkeypatch, tiny_tokenizer, base_model, perturb):
    """With ``reference_dice`` the reference also draws the sampled knowledge probes with more sets of dice, but
    only once a candidate's share of facts falls below what the check's own dice gave the reference (the mean can
    only lower the bar), and only once: its mean count is that of ``fact_counts`` over the sets, set 0 being the
    check's own."""
    from clawloop.gate import gate as gate_module

    gate, same = _half_stated_fact(tiny_tokenizer, base_model, reference_dice=3)
    assert same.right == same.reference_right and same.reference_mean is None
    candidates = (perturb(base_model, 0.5, seed) for seed in range(7, 27))
    found = next(((c, o) for c in candidates for o in _check(gate, c, base_model).probes
                  if o.right < 0.9 * o.reference_right), None)
    assert found is not None, "no perturbed model drew the fact less often than the reference"
    candidate, moved = found
    counts = [gate.fact_counts(base_model, d)[0][1:] for d in range(3)]
    assert counts[0] == (same.reference_right, 8)
    assert moved.reference_right == same.reference_right and moved.reference_mean == sum(c for c, _ in counts) / 3

    calls = []
    real = gate_module.probe_answers
    monkeypatch.setattr(gate_module, "probe_answers", lambda model, *a, **k: calls.append(id(model)) or real(
        model, *a, **k))
    again = _check(gate, candidate, base_model).probes  # it needs the mean again: kept, not redrawn
    assert again[0].right == moved.right and again[0].reference_mean == moved.reference_mean
    assert id(base_model) not in calls


def test_a_gate_that_worked_ahead_asks_the_reference_nothing_more_and_decides_as_one_that_did_not(
        monkeypatch, tiny_tokenizer, base_model, perturb):
    """``prepare`` does the fixed reference's work before any check, one piece a call: its answers to the
    knowledge probes, then to the shipped probes, then its other dice sets, one set a call. Its checks then ask
    the reference for no answer (no ``reference_answers`` or ``reference_dice`` part, no decoding by it) and
    reach the verdicts of a gate that did that work within its checks, on the real decoding of the tiny model."""
    from clawloop.gate import gate as gate_module

    found, _ = _half_stated_fact(tiny_tokenizer, base_model, reference_dice=3)
    knowledge = [KnowledgeProbe(p.question, p.answers) for p in found.knowledge]

    def gate():
        return PublicationGate(tiny_tokenizer, min_guard_pass=0.95, probes=["Name a colour.", "What is rain?"],
                               knowledge=knowledge, knowledge_samples=8, reference_dice=3)

    ahead, within = gate(), gate()
    reference = lambda: contextlib.nullcontext(base_model)  # noqa: E731
    calls = []
    real = gate_module.probe_answers
    monkeypatch.setattr(gate_module, "probe_answers", lambda model, *a, **k: calls.append(id(model)) or real(
        model, *a, **k))
    more = [ahead.prepare(reference) for _ in range(5)]
    # knowledge answers, shipped answers, dice set 1, dice set 2 (the last), then nothing left to do
    assert more == [True, True, True, False, False] and len(calls) == 4

    candidates = [base_model] + [perturb(base_model, 0.5, seed) for seed in range(7, 27)]
    drew = False
    for candidate in candidates:
        calls.clear()
        mine = _check(ahead, candidate, base_model)
        assert id(base_model) not in calls or candidate is base_model
        assert not {"reference_answers", "reference_dice"} & set(mine.seconds_by_part)
        theirs = _check(within, candidate, base_model)
        assert (mine.accepted, mine.reasons, mine.facts_right, mine.facts_reference_right) == \
            (theirs.accepted, theirs.reasons, theirs.facts_right, theirs.facts_reference_right)
        assert [(o.ok, o.right, o.answer) for o in mine.probes] == [(o.ok, o.right, o.answer) for o in theirs.probes]
        drew = drew or "reference_dice" in theirs.seconds_by_part
    assert drew, "no candidate fell below the reference's own draw, where the mean is drawn and can decide"


def test_a_prompt_asked_several_times_is_prefilled_once(tiny_tokenizer, base_model):
    """A knowledge probe's sampled answers share one prefill of its prompt: the first forward sees each distinct
    prompt once, and rows of the same prompt drawn with the same dice draw the same answer."""
    from clawloop.engines.model_files import end_token_ids
    from clawloop.gate.generation import probe_answers, sampling_uniforms

    def ids(question):
        out = tiny_tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    fact, other = ids("What is the capital of France?"), ids("What is a turtle?")
    batch_sizes = []
    hook = base_model.register_forward_pre_hook(
        lambda module, args, kwargs: batch_sizes.append(int(kwargs["input_ids"].shape[0])), with_kwargs=True)
    try:
        dice = [sampling_uniforms("France", i % 4, 24) for i in range(8)]
        answers, logprobs = probe_answers(base_model, [fact] * 8 + [other], 24, end_token_ids(tiny_tokenizer),
                                          uniforms=[*dice, None], temperature=0.6)
    finally:
        hook.remove()
    assert batch_sizes[0] == 2 and max(batch_sizes[1:]) <= 9
    assert answers[:4] == answers[4:8] and len(set(map(tuple, answers[:4]))) > 1
    assert logprobs[8].shape[0] == len(answers[8]) > 0 and all(lp.shape[0] == 0 for lp in logprobs[:8])


def test_an_answer_names_a_fact_for_good_only_once_something_follows_it():
    assert names_fact("7 + 5 = 12.", ("12", "twelve")) and names_fact("It is Paris, of course", ("Paris",))
    assert not names_fact("7 + 5 = 12", ("12", "twelve"))  # the next token could make it 120
    assert not names_fact("7 + 5 = 120.", ("12", "twelve")) and not names_fact("Parisian ", ("Paris",))


def test_a_check_stops_once_the_candidate_cannot_pass(monkeypatch, tiny_tokenizer, base_model, perturb, scripted):
    shipped = ["What is a kettle?", "What is an owl?", "What is a lizard?"]
    long_question = "Here is some context about my garden. " * 12 + "What is a turtle?"
    long_messages = [{"role": "user", "content": long_question}]
    long_ids = tiny_tokenizer.apply_chat_template(long_messages, add_generation_prompt=True)
    long_ids = list(long_ids["input_ids"] if hasattr(long_ids, "keys") else long_ids)
    sound = {"kettle": "A kettle is a pot for boiling water.", "owl": "An owl is a bird that hunts at night.",
             "lizard": "A lizard is a small reptile with four legs.", "turtle": SOUND}
    script = {f"What is a{'n' if k == 'owl' else ''} {k}?": v for k, v in sound.items()}
    broken = perturb(base_model, 0.05, 4)
    calls = scripted(monkeypatch, {id(base_model): script, id(broken): {k: LOOP for k in script}})
    gate = PublicationGate(tiny_tokenizer, min_guard_pass=0.95, probes=shipped,
                           recent_prompts=lambda: [(1, long_ids, long_messages)])
    assert len({len(p.ids) for p in gate.probe_set()}) > 1
    result = _check(gate, broken, base_model)
    # The short probes (one batch) already show three regressions where at most two could be tolerated: the long
    # prompt's batch is never answered by the candidate.
    assert not result.accepted and result.regressions == 3 and result.unanswered == 1
    assert [c for c in calls if c[0] == id(broken)] == [(id(broken), 3)]


def test_a_candidate_that_lost_its_facts_is_rejected_before_the_long_answers(monkeypatch, tiny_tokenizer, base_model,
                                                                           perturb, scripted):
    """The knowledge probes are answered first. A candidate whose sampled answers state the facts too rarely is
    rejected there: neither it nor the reference answers the guard's probes or the run's new prompts; they wait
    for a check that needs them, and the next check asks them."""
    facts = [KnowledgeProbe("What is the capital of France?", ("Paris",)),
             KnowledgeProbe("What is the capital of Japan?", ("Tokyo",))]
    recent = "What is a lizard?"
    messages = [{"role": "user", "content": recent}]
    ids = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    sound = {TURTLE: SOUND, recent: "A lizard is a small reptile with four legs."}
    knows = {"France": ["The capital of France is Paris."] * 8, "Japan": ["The capital of Japan is Tokyo."] * 8}
    forgot = {"France": ["The capital of France is Lyon."] * 8, "Japan": ["The capital of Japan is Tokyo."] * 8}
    candidate = perturb(base_model, 0.05, 3)
    gate = PublicationGate(tiny_tokenizer, min_guard_pass=0.95, probes=[TURTLE], knowledge=facts, knowledge_samples=8,
                           recent_prompts=lambda: [(1, ids, messages)])
    calls = scripted(monkeypatch, {id(base_model): {**knows, **sound}, id(candidate): {**forgot, **sound}})
    rejected = _check(gate, candidate, base_model)
    assert not rejected.accepted and rejected.reasons[0].startswith("facts stated in 8 of the sampled answers")
    assert rejected.unanswered == 2 and {p.source for p in rejected.probes} == {"knowledge"}
    assert calls == [(id(base_model), 16), (id(candidate), 16)]  # 2 facts x 8 draws each, nothing else
    calls = scripted(monkeypatch, {id(base_model): {**knows, **sound}, id(candidate): {**knows, **sound}})
    accepted = _check(gate, candidate, base_model)
    assert accepted.accepted and accepted.unanswered == 0 and len(accepted.probes) == 4
    assert calls == [(id(candidate), 16), (id(base_model), 2), (id(candidate), 2)]  # the reference's verdicts on
    # the facts were kept; the guard's two probes are asked of it now
    # Each check says where its time went, by the parts it ran.
    assert set(rejected.seconds_by_part) == {"reference_answers", "knowledge"}
    assert set(accepted.seconds_by_part) == {"knowledge", "reference_answers", "guard", "kl"}
    for result in (rejected, accepted):
        assert all(s >= 0 for s in result.seconds_by_part.values())
        assert sum(result.seconds_by_part.values()) <= result.seconds
        assert result.evidence()["seconds_by_part"].keys() == result.seconds_by_part.keys()


def test_a_right_fact_counts_whatever_the_question_rules_say(monkeypatch, tiny_tokenizer, base_model, perturb,
                                                            scripted):
    """A knowledge probe checks the fact: a short right answer that never names the question's topic ("The answer
    is 3.") still knows it, and a fluent answer without the fact does not."""
    facts = [KnowledgeProbe("How many sides does a triangle have?", ("3", "three")),
             KnowledgeProbe("Which planet is known as the Red Planet?", ("Mars",))]
    reference = {"triangle": "A triangle has three sides.", "Red Planet": "Mars is known as the Red Planet."}
    terse = {"triangle": "The answer is 3.", "Red Planet": "Mars."}
    vague = {"triangle": "The answer is 3.", "Red Planet": "The Red Planet is a planet in the habitable zone."}
    candidate = perturb(base_model, 0.05, 3)
    scripted(monkeypatch, {id(base_model): reference, id(candidate): terse})
    gate = PublicationGate(tiny_tokenizer, min_guard_pass=1.0, probes=[], knowledge=facts)
    result = _check(gate, candidate, base_model)
    assert result.accepted and (result.knowledge_counted, result.forgotten) == (2, 0)
    scripted(monkeypatch, {id(base_model): reference, id(candidate): vague})
    assert _check(gate, candidate, base_model).forgotten == 1


def test_answers_kept_by_one_run_spare_the_next_every_reference_answer_and_change_no_decision(
        monkeypatch, tmp_path, tiny_tokenizer, base_model, perturb):
    """The starting weights' answers to the shipped and knowledge probes, dice sets included, are kept on disk
    (``KeptAnswers``): a gate of a later run (a new gate, the file read afresh) asks the reference for none of
    them, neither working ahead nor in a check, and reaches the verdicts of a gate that asks it everything, on the
    real decoding of the tiny model as a gate that asked it the same ahead of its checks. The run's own prompts are
    asked of the reference as before and never kept."""
    from clawloop.gate import gate as gate_module
    from clawloop.gate.kept_answers import KeptAnswers

    found, _ = _half_stated_fact(tiny_tokenizer, base_model, reference_dice=3)
    knowledge = [KnowledgeProbe(p.question, p.answers) for p in found.knowledge]
    path = tmp_path / "kept.json"
    recent_ids = list(tiny_tokenizer.apply_chat_template([{"role": "user", "content": "What is a kettle?"}],
                                                         add_generation_prompt=True)["input_ids"])
    recent = lambda: [(7, recent_ids, [{"role": "user", "content": "What is a kettle?"}])]  # noqa: E731

    def gate(kept=None):
        return PublicationGate(tiny_tokenizer, min_guard_pass=0.95, probes=["Name a colour.", "What is rain?"],
                               knowledge=knowledge, knowledge_samples=8, reference_dice=3, recent_prompts=recent,
                               kept_answers=kept)

    reference = lambda: contextlib.nullcontext(base_model)  # noqa: E731
    first = gate(KeptAnswers(path))
    while first.prepare(reference):
        pass
    # one greedy answer per shipped probe, and per knowledge probe one entry per dice set (3): nothing recent
    assert len(KeptAnswers(path)) == 2 + 3 * len(knowledge)

    calls = []
    real = gate_module.probe_answers
    monkeypatch.setattr(gate_module, "probe_answers", lambda model, prompts, *a, **k: calls.append(
        (id(model), len(prompts))) or real(model, prompts, *a, **k))
    later, asking = gate(KeptAnswers(path)), gate()
    while later.prepare(reference):
        pass
    assert calls == []
    while asking.prepare(reference):  # the same work done by the reference itself (decisions within checks: above)
        pass
    candidates = [base_model] + [perturb(base_model, 0.5, seed) for seed in range(7, 27)]
    drew = False
    for n, candidate in enumerate(candidates):
        calls.clear()
        mine = _check(later, candidate, base_model)
        asked_reference = [rows for model, rows in calls if model == id(base_model) and candidate is not base_model]
        # only the run's own prompt, once, at the first check that reaches the guard probes
        assert asked_reference in ([], [1]) and not (n and "reference_dice" in mine.seconds_by_part)
        theirs = _check(asking, candidate, base_model)
        assert (mine.accepted, mine.reasons, mine.facts_right, mine.facts_reference_right,
                mine.facts_reference_bar) == (theirs.accepted, theirs.reasons, theirs.facts_right,
                                              theirs.facts_reference_right, theirs.facts_reference_bar)
        assert [(o.ok, o.right, o.answer) for o in mine.probes] == [(o.ok, o.right, o.answer) for o in theirs.probes]
        drew = drew or mine.facts_reference_bar < mine.facts_reference_right
    assert drew, "no candidate was held to the mean of the kept dice rather than the check's own draw"
    assert len(KeptAnswers(path)) == 2 + 3 * len(knowledge)

    # A gate that did not work ahead reads the file within its checks: the reference answers only the run's own
    # prompt and draws no dice, and every outcome (the reference's counts and mean included) is that of a gate
    # that asks the reference within its checks.
    within, asking = gate(KeptAnswers(path)), gate()
    needed_dice = False
    for candidate in candidates:
        calls.clear()
        mine = _check(within, candidate, base_model)
        assert [rows for model, rows in calls if model == id(base_model) and candidate is not base_model] in ([], [1])
        assert "reference_dice" not in mine.seconds_by_part
        theirs = _check(asking, candidate, base_model)
        needed_dice = needed_dice or "reference_dice" in theirs.seconds_by_part
        assert (mine.accepted, mine.reasons, mine.facts_reference_bar) == \
            (theirs.accepted, theirs.reasons, theirs.facts_reference_bar)
        assert [(o.ok, o.right, o.answer, o.reference_ok, o.reference_right, o.reference_mean) for o in mine.probes] \
            == [(o.ok, o.right, o.answer, o.reference_ok, o.reference_right, o.reference_mean) for o in theirs.probes]
    assert needed_dice, "no check needed the reference's other dice, which the file then gave"
    assert len(KeptAnswers(path)) == 2 + 3 * len(knowledge)


def test_kept_answers_are_not_used_when_the_reference_is_the_last_accepted_version(
        monkeypatch, tmp_path, tiny_tokenizer, base_model, perturb):
    """Kept answers are the starting weights'; a gate measuring against the last accepted weights (full
    fine-tuning without a frozen copy) asks its reference every probe afresh, though the file holds them all, and
    adds nothing to it."""
    from clawloop.gate import gate as gate_module
    from clawloop.gate.kept_answers import KeptAnswers

    path = tmp_path / "kept.json"
    probes = ["Name a colour.", "What is rain?"]
    filler = PublicationGate(tiny_tokenizer, min_guard_pass=0.95, probes=probes, kept_answers=KeptAnswers(path))
    while filler.prepare(lambda: contextlib.nullcontext(base_model)):
        pass
    kept_before = path.read_bytes()
    assert len(KeptAnswers(path)) == 2

    calls = []
    real = gate_module.probe_answers
    monkeypatch.setattr(gate_module, "probe_answers", lambda model, prompts, *a, **k: calls.append(
        (id(model), len(prompts))) or real(model, prompts, *a, **k))
    gate = PublicationGate(tiny_tokenizer, min_guard_pass=0.95, probes=probes, kept_answers=KeptAnswers(path))
    result = gate.check(perturb(base_model, 0.05, 1), lambda: contextlib.nullcontext(base_model),
                        kl_to="the last accepted version")
    assert "reference_answers" in result.seconds_by_part and (id(base_model), 2) in calls
    assert path.read_bytes() == kept_before


def test_a_candidate_whose_greedy_answers_all_end_at_once_is_not_near_identical(tiny_tokenizer, base_model):
    """Empty answers give the KL no token to measure: the candidate is not treated as within KL 1e-3 of the
    reference, which would allow it one more regression and forgive its broken fixes."""
    candidate = copy.deepcopy(base_model)
    eos = tiny_tokenizer.eos_token_id

    def end_at_once(_module, _inputs, logits):
        logits[..., eos] += 1e4
        return logits

    candidate.get_output_embeddings().register_forward_hook(end_at_once)
    gate = PublicationGate(tiny_tokenizer, min_guard_pass=0.0, max_kl=1e6, probe_tokens=8,
                           probes=["What is a turtle?", "What is a kettle?"])
    result = gate.check(candidate, lambda: contextlib.nullcontext(base_model))
    assert [p.answer for p in result.probes] == ["", ""]
    assert not result.kl_measured
