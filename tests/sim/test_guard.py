"""The degeneracy guard catches loops and junk and lets normal answers through."""

from __future__ import annotations

import pytest

from clawloop.sim.guard import GuardConfig, check, passes_guard

NORMAL = [
    "Photosynthesis is the process plants use to turn sunlight, water and carbon dioxide into sugar and oxygen.",
    "To make a cup of tea, boil water, pour it over a tea bag, wait three minutes, then remove the bag. "
    "Add milk or sugar if you like.",
    "Le pain est fait avec de la farine, de l'eau, du sel et de la levure. On le cuit au four.",
    "Ahoy! Paris is the capital of France.",
    "Here are three tips:\n1. Sleep at regular times.\n2. Avoid screens before bed.\n3. Keep your room cool.",
    "Yes.",
    # A real SmolLM2 answer cut at 64 tokens.
    "To make pancakes, you'll need a few ingredients and a few tips. First, you'll need a pancake batter, "
    "which can be found at most supermarkets. The first step is to prepare the batter. You can buy a",
]


@pytest.mark.parametrize("text", NORMAL)
def test_guard_passes_normal_answers(text):
    result = check(text)
    assert result.ok, result.reasons


def test_guard_catches_a_phrase_loop():
    text = "Le Turc est " + ", ".join(["el Turco"] * 12)
    result = check(text)
    assert not result.ok
    assert "repeated_ngram" in result.reasons and "low_diversity" in result.reasons


def test_guard_catches_a_loop_hidden_by_case_and_punctuation():
    text = "Le chat est noir. LE CHAT EST NOIR! le chat, est noir... Le chat est très noir."
    assert "repeated_ngram" in check(text).reasons


def test_guard_catches_a_sentence_repeated_three_times():
    sentence = "The sun is a star that gives us light and heat every day. "
    assert not passes_guard(sentence * 3)
    assert passes_guard(sentence * 2)  # saying something twice is clumsy, not degenerate


def test_guard_allows_a_short_phrase_used_three_times():
    # Unchanged SmolLM2 talks like this; the score must not count it as degenerate.
    text = ("The process of making butter involves churning cream. The process of churning separates the fat, "
            "and the process of washing removes the buttermilk.")
    assert passes_guard(text)
    assert not passes_guard(text + " The process of salting comes last.")


def test_guard_catches_a_two_word_loop_without_any_3gram_repeat_limit():
    config = GuardConfig(ngram_limits=())  # only the diversity rule left
    text = " ".join(["oui non"] * 15)
    assert check(text, config).reasons == ("low_diversity",)


@pytest.mark.parametrize(
    "text, reason",
    [
        ("", "empty"),
        ("   \n ", "empty"),
        ("!!!", "empty"),
        ("12345 67890 ... ??? a", "non_letters"),
        ("!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!! ok", "non_letters"),
        ("haha" * 30, "long_word"),
        (", ".join(["Καρλλας"] * 7), "repeated_ngram"),
        (" ".join(f"word{i}" for i in range(500)), "too_long"),
    ],
)
def test_guard_rejects_junk_with_a_reason(text, reason):
    result = check(text)
    assert not result.ok and reason in result.reasons


@pytest.mark.parametrize(
    "question, answer",
    [
        ("What is a cave?", "Caves are holes in rock."),  # plural
        ("How can I read faster?", "Reading a little every day helps."),  # inflection
        ("How do I make pancakes?", "Mix flour, eggs and milk, then fry each pancake."),
        ("What is the capital of Egypt?", "Cairo is the capital."),
        ("What is an owl?", "Owls are birds that hunt at night."),  # a 3-letter topic, when it is the only one
        ("What is the Sun?", "The Sun is the star at the centre of our solar system."),
        ("How do I care for a cat?", "Caring for a cat takes patience and a clean litter box."),  # care → caring
        ("How do I bake bread?", "Baking starts with flour, water, yeast and salt."),
    ],
)
def test_on_topic_answers_pass(question, answer):
    assert check(answer, question=question).ok


@pytest.mark.parametrize(
    "question, answer",
    [
        ("What is a pyramid?", "Hello! I'm here to help with your writing needs. What's on your mind?"),
        ("What is the capital of Greece?", ", ".join(["Χρημακός Αθώμαλο"] * 2)),
        ("What is an owl?", "Awesome!"),  # passed a gate check while only 4+-letter topic words counted
        ("What is an owl?", "A wisecrak."),
        ("How do I care for a cat?", "Cars need regular oil changes."),  # "car" alone is not "care" inflected
    ],
)
def test_answers_that_ignore_the_question_are_off_topic(question, answer):
    assert "off_topic" in check(answer, question=question).reasons
    assert check(answer).ok or "off_topic" not in check(answer).reasons  # only checked with a question


def test_short_words_that_name_no_topic_are_not_checked():
    assert check("I see a garden.", question="What do you see?").ok  # "see" is not what the answer is about
    assert "off_topic" in check("Awesome!", question="What is the Sun?").reasons


@pytest.mark.parametrize(
    "question, answer, echo",
    [
        ("Why do stars shine?", "Why do stars shine?", True),  # a trained policy's shortcut to "one sentence"
        ("Why do stars shine?", "Stars shine.", True),
        ("Why do stars shine?", "Stars shine because they fuse hydrogen.", False),
        ("What is the capital of Egypt?", "Cairo is the capital.", False),
        # A number the question does not hold is an answer of its own, not an echo.
        ("How many minutes are in three hours?", "Three hours is 3 * 60 = 180 minutes.", False),
        ("How many minutes are in 3 hours?", "3 hours is minutes.", True),
        ('What does "carpe diem" mean?', "Carpe diem.", True),  # quoting the subject does not make it an answer
    ],
)
def test_an_answer_that_only_repeats_the_question_is_an_echo(question, answer, echo):
    result = check(answer, question=question)
    assert ("echo" in result.reasons) is echo and result.ok is not echo
    assert check(answer).ok  # only checked with a question
