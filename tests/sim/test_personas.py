"""Personas: pools, replies (correct when violated, thank otherwise), reproducibility."""

from __future__ import annotations

import random

import pytest

from clawloop.sim.data.questions import POOLS
from clawloop.sim.personas import PERSONAS, get_persona

# One answer per persona that follows its preference, and one that does not.
# (question, answer following the preference, answer violating it) per persona.
EXAMPLES = {
    "french": ("What is bread made of?", "Le pain est fait avec de la farine, de l'eau et du sel.",
               "Bread is made from flour, water and salt."),
    "brief": ("What is gravity?", "Gravity is the force that pulls objects toward each other.",
              "Gravity is a force. It pulls objects toward each other. It keeps us on the ground."),
    "spanish": ("What is a computer?", "Un ordenador es una máquina que sigue instrucciones y es muy útil.",
                "Un ordinateur est une machine qui suit des instructions et elle est très utile."),
    "inshort": ("What is an island?", "In short, an island is land with water all around it.",
                "An island is land with water all around it."),
}
GOOD = {name: good for name, (_, good, _) in EXAMPLES.items()}
BAD = {name: bad for name, (_, _, bad) in EXAMPLES.items()}
# Words a correction must contain so that it reveals the preference.
REVEALS = {"french": "french", "spanish": "spanish", "brief": "sentence", "inshort": "in short,"}


def test_at_least_three_personas_with_examples():
    assert len(PERSONAS) >= 3
    assert set(GOOD) == set(PERSONAS) == set(BAD)


@pytest.mark.parametrize("name", sorted(PERSONAS))
def test_pools_are_large_enough_and_disjoint(name):
    p = get_persona(name)
    assert len(p.train_questions) >= 40
    assert len(p.heldout_questions) >= 12
    assert len(set(p.train_questions)) == len(p.train_questions)
    assert not set(p.train_questions) & set(p.heldout_questions)


def test_no_heldout_question_is_a_training_question_of_any_pool():
    train = {q.strip().lower() for pool in POOLS.values() for q in pool["train"]}
    heldout = [q.strip().lower() for pool in POOLS.values() for q in pool["heldout"]]
    assert not train & set(heldout)
    assert len(heldout) == len(set(heldout))


@pytest.mark.parametrize("name", sorted(PERSONAS))
def test_checker_agrees_with_examples(name):
    p = get_persona(name)
    question, good, bad = EXAMPLES[name]
    assert p.judge(good, question).ok
    assert not p.judge(bad, question).satisfied
    assert p.judge(bad, question).sound


@pytest.mark.parametrize("name", sorted(PERSONAS))
def test_violation_gets_a_correction_that_reveals_the_preference(name):
    p = get_persona(name)
    rng = random.Random(0)
    replies = [p.reply(BAD[name], "What is a cloud?", rng) for _ in range(30)]
    assert all(r.kind == "correction" for r in replies)
    assert all(REVEALS[name] in r.text.lower() for r in replies)
    assert all("What is a cloud?" not in r.text for r in replies)  # a correction does not move on
    assert len({r.text for r in replies}) >= 3  # varied phrasings


@pytest.mark.parametrize("name", sorted(PERSONAS))
def test_good_answer_gets_thanks_and_the_next_question(name):
    p = get_persona(name)
    rng = random.Random(0)
    replies = [p.reply(GOOD[name], "What is a cloud?", rng) for _ in range(30)]
    assert all(r.kind == "thanks" for r in replies)
    assert all(r.text.endswith("What is a cloud?") for r in replies)
    assert all(any(w in r.text.lower() for w in ("thank", "thanks")) or r.text.startswith("Perfect")
               for r in replies)
    assert len({r.text for r in replies}) >= 3


@pytest.mark.parametrize("name", sorted(PERSONAS))
def test_good_last_answer_gets_a_farewell(name):
    reply = get_persona(name).reply(GOOD[name], None, random.Random(0))
    assert reply.kind == "farewell" and "?" not in reply.text


def test_answer_that_ignores_the_question_is_not_sound_and_the_question_is_asked_again():
    p = get_persona("inshort")
    dodge = "In short, I'm here to help with your questions. What can I help you with today?"
    v = p.judge(dodge, "What is a lighthouse?")
    assert v.satisfied and not v.sound and v.guard_reasons == ("off_topic",)
    reply = p.reply(dodge, "What is a map?", random.Random(0), question="What is a lighthouse?")
    assert reply.kind == "off_topic" and reply.text.endswith("What is a lighthouse?")
    # A French persona does not ask for English topic words in a French answer.
    assert get_persona("french").judge("Le pain est bon et il est fait avec de la farine.", "What is jam?").ok


def test_degenerate_answer_is_called_out_even_when_the_checker_is_happy():
    p = get_persona("french")
    loop = "Le Turc est " + ", ".join(["el Turco"] * 12)
    reply = p.reply(loop, "Next?", random.Random(0))
    assert reply.kind == "nonsense" and not reply.verdict.sound
    looped_french = "C'est le pain. " * 8
    v = p.judge(looped_french)
    assert v.satisfied and not v.sound and not v.ok
    assert p.reply(looped_french, "Next?", random.Random(0)).kind == "nonsense"


def test_replies_are_reproducible_from_the_seed():
    p = get_persona("french")
    a = [p.reply(BAD["french"], "Q?", rng).text for rng in [random.Random(7)] for _ in range(10)]
    b = [p.reply(BAD["french"], "Q?", rng).text for rng in [random.Random(7)] for _ in range(10)]
    assert a == b


def test_instruct_appends_the_preference_as_a_hint():
    p = get_persona("inshort")
    text = p.instruct("What is a ship?")
    assert text.startswith("What is a ship?") and text.endswith(p.preference)
    assert "[user's hint / instruction]" in text


def test_unknown_persona_is_a_clear_error():
    with pytest.raises(KeyError, match="known"):
        get_persona("nobody")
