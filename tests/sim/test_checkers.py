"""Each persona's checker accepts what the persona wants and rejects what it does not."""

from __future__ import annotations

import pytest

from clawloop.sim.checkers import (
    BriefChecker,
    ClosingChecker,
    FrenchChecker,
    LowercaseChecker,
    NoDigitsChecker,
    NumberedListChecker,
    OpeningChecker,
    ParagraphChecker,
    SpanishChecker,
    sentence_count,
    word_count,
)
from clawloop.sim.personas import PERSONAS

FRENCH_YES = [
    "Pour faire une tasse de thé, il faut chauffer l'eau et laisser infuser le thé pendant trois minutes.",
    "Le pain est fait avec de la farine, de l'eau, du sel et de la levure.",
    # An English word inside French text is still French.
    "C'est une bonne idée de faire du shopping le weekend avec vos amis.",
    "Je regarde the news chaque soir avec ma famille, c'est très intéressant.",
    # Curly apostrophes and capitals.
    "L’eau est très importante pour la santé. Il faut boire beaucoup d’eau.",
    "Oui, bien sûr ! Les chats aiment le poisson et la viande.",
]
FRENCH_NO = [
    "To make a cup of tea, boil the water and let the tea steep for three minutes.",
    "Bread is made from flour, water, salt and yeast.",
    # English text quoting a French phrase is still English.
    "The French say 'bon appétit' before a meal, which means they wish you a good meal.",
    # Spanish is not French, even though it shares many short words.
    "El pan es muy bueno y lo hacemos con harina, agua y sal para todos los días.",
    "El Turco, el Turco, el Turco, el Turco, el Turco.",
    # Too little evidence: a lone French word or a name.
    "Paris.",
    "Bonjour",
    "",
]


SPANISH_YES = [
    "Un ordenador es una máquina que sigue instrucciones y es muy útil.",
    "Para estudiar mejor, lee un poco todos los días y haz pausas cortas.",
    "Es importante dormir bien porque el cuerpo necesita descansar, también el cerebro.",
]
SPANISH_NO = [
    "A computer is a machine that follows instructions.",
    "Le pain est fait avec de la farine et de l'eau, c'est très bon.",  # French is not Spanish
    "Hola",
]


@pytest.mark.parametrize("text", SPANISH_YES)
def test_spanish_checker_accepts_spanish(text):
    assert SpanishChecker()(text)


@pytest.mark.parametrize("text", SPANISH_NO)
def test_spanish_checker_rejects_non_spanish(text):
    assert not SpanishChecker()(text)


@pytest.mark.parametrize("text", FRENCH_YES)
def test_french_checker_accepts_french(text):
    assert FrenchChecker()(text)


@pytest.mark.parametrize("text", FRENCH_NO)
def test_french_checker_rejects_non_french(text):
    assert not FrenchChecker()(text)


BRIEF_YES = [
    "Photosynthesis is how plants turn sunlight into food.",
    "Gravity pulls things toward each other. ",  # trailing space
    "Gravity pulls things toward each other.\n",  # trailing newline
    "Dr. Smith says a planet is a big round object that orbits a star.",  # abbreviation
    "Pi is about 3.14, a number used for circles!",  # decimal point
    "**Rain** falls when water droplets in clouds get too heavy",  # no final period, markdown
    "Yes",
]
BRIEF_NO = [
    "Photosynthesis is how plants make food. They use sunlight, water and carbon dioxide.",
    "Gravity is a force. It pulls things down!",
    "A planet is a large object that orbits a star, is round because of its own gravity, and has cleared "
    "its orbit of other objects of similar size.",  # one sentence, 25 words
    "Rain:\n- water droplets\n- clouds",  # a list is several lines
    "",
    "   ",
]


@pytest.mark.parametrize("text", BRIEF_YES)
def test_brief_checker_accepts_one_short_sentence(text):
    assert BriefChecker(max_words=20)(text)


@pytest.mark.parametrize("text", BRIEF_NO)
def test_brief_checker_rejects_long_or_multiple_sentences(text):
    assert not BriefChecker(max_words=20)(text)


def test_brief_word_limit_is_inclusive():
    twenty = " ".join(["word"] * 19) + " end."
    assert word_count(twenty) == 20 and sentence_count(twenty) == 1
    assert BriefChecker(max_words=20)(twenty)
    assert not BriefChecker(max_words=19)(twenty)


AHOY_YES = [
    "Ahoy! Paris is the capital of France.",
    "Ahoy, matey! An island is land surrounded by water.",
    "AHOY! A ship is a large boat.",
    "  **Ahoy!** A lighthouse guides ships at night.",
    '"Ahoy!" A compass shows you where north is.',
    "ahoy there, a harbour is a safe place for boats.",
]
AHOY_NO = [
    "Paris is the capital of France.",
    "Hello! Ahoy! Paris is the capital of France.",  # not the opening
    "Ahoyhoy, a ship is a large boat.",  # a different word
    "A-hoy! A ship is a large boat.",
    "Ahoy!",  # a bare greeting is not an answer
    "Ahoy! Yes.",
    "",
]


@pytest.mark.parametrize("text", AHOY_YES)
def test_opening_checker_accepts_ahoy_first(text):
    assert OpeningChecker("Ahoy")(text)


@pytest.mark.parametrize("text", AHOY_NO)
def test_opening_checker_rejects_missing_opening(text):
    assert not OpeningChecker("Ahoy")(text)


CHEERS_YES = [
    "Study a little every day and take breaks. Cheers!",
    "Use a strong password. Cheers! ",
    "Use a strong password.\n\nCheers!",
    "Write short sentences. **Cheers!**",
    "Write short sentences. cheers!",
]
CHEERS_NO = [
    "Cheers! Study a little every day.",  # at the start, not the end
    "Study a little every day and take breaks.",
    "Study well. Cheers! And good luck with the exam.",
    "Study well. Thanks, Cheersy!",
    "Cheers!",  # a bare sign-off is not an answer
    "",
]


@pytest.mark.parametrize("text", CHEERS_YES)
def test_closing_checker_accepts_sign_off(text):
    assert ClosingChecker("Cheers!")(text)


@pytest.mark.parametrize("text", CHEERS_NO)
def test_closing_checker_rejects_missing_sign_off(text):
    assert not ClosingChecker("Cheers!")(text)


def test_lowercase_and_no_digits_checkers():
    assert LowercaseChecker()("a computer is a machine that follows instructions.")
    assert not LowercaseChecker()("A computer is a machine.")
    assert not LowercaseChecker()("123 ...")
    assert NoDigitsChecker()("There are seven days in a week.")
    assert not NoDigitsChecker()("There are 7 days in a week.")
    assert not NoDigitsChecker()("")


LIST_YES = [
    "1. Boil water.\n2. Add the pasta.\n3. Drain it.",
    "To make tea:\n\n1) Boil water\n2) Steep the leaves",  # a lead-in line before the list
    "1. **Sleep** helps memory.\n2. **Sleep** repairs the body.\n3. It cut",  # cut off mid-item by max_tokens
]
LIST_NO = [
    "Boil water, add the pasta and drain it.",  # prose
    "1. Boil water and add the pasta.",  # one item is not a list
    "1. A frog\n2. A frog\n3. A frog",  # a repeated item is a loop, not a list
    "In 1990 it rained. 2. was a good year.",  # numbers inside prose, not at the start of lines
]


@pytest.mark.parametrize("text", LIST_YES)
def test_numbered_list_checker_accepts_lists(text):
    assert NumberedListChecker()(text)


@pytest.mark.parametrize("text", LIST_NO)
def test_numbered_list_checker_rejects_prose_single_items_and_repeats(text):
    assert not NumberedListChecker()(text)


PARAGRAPH_YES = [
    "A glacier is a slow river of ice. It forms where snow piles up for centuries and turns to ice.",
    "Clouds form when warm air rises and cools. Its water vapour condenses into droplets. \"That is all.\"",
    "Sound is a wave of pressure! It travels through air, water and solids.",
]
PARAGRAPH_NO = [
    "A glacier is a slow river of ice.",  # one sentence: brief's answer, not a paragraph
    "A glacier is a slow river of ice. It forms where snow piles up for centuries and turns to ice, and it moves",
    # cut at the token cap, mid-sentence
    "Ice. " * 5,  # five sentences
    " ".join(["word"] * 40) + ". " + " ".join(["word"] * 25) + ".",  # 65 words
    "Glaciers form in two ways.\n- Snow piles up.\n- Ice flows downhill.",  # a list
    "",
]


@pytest.mark.parametrize("text", PARAGRAPH_YES)
def test_paragraph_checker_accepts_a_finished_short_paragraph(text):
    assert ParagraphChecker()(text)


@pytest.mark.parametrize("text", PARAGRAPH_NO)
def test_paragraph_checker_rejects_one_liners_cut_answers_long_answers_and_lists(text):
    assert not ParagraphChecker()(text)


@pytest.mark.parametrize("text", BRIEF_YES + BRIEF_NO + PARAGRAPH_YES + PARAGRAPH_NO)
def test_no_answer_follows_both_brief_and_a_paragraph(text):
    # Two users who want these lengths are told apart by their answers (clawloop eval-users).
    assert not (BriefChecker()(text) and ParagraphChecker()(text))


@pytest.mark.parametrize("name", sorted(PERSONAS))
def test_every_persona_checker_is_deterministic_and_described(name):
    persona = PERSONAS[name]
    text = "Ahoy! Le pain est fait avec de la farine. Cheers!"
    assert persona.checker(text) == persona.checker(text)
    assert persona.checker.describe()
