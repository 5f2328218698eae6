"""Knowledge probes: short questions with known answers, so that a candidate steered off what the model knew fails.

The degeneracy guard sees whether an answer is sound text on topic; it cannot see that "The capital of France is
Lyon." is wrong. A policy trained toward one user's preferences can lose facts while still writing fluent
sentences, and users would be served the wrong facts. Each probe below names the answers that count as right
(``KnowledgeProbe.answers``); an answer knows the fact when it contains one of them as a whole word, in any case
(``knows``). A probe counts against a candidate only where the reference's own answers knew it, so a fact the
starting model never had cannot block publication. How many answers each probe gets (sampled at the serving
temperature, or one greedy answer) and when a fact counts as forgotten is the gate's business
(``clawloop.gate.gate``).

The set was chosen so that the default model (SmolLM2-135M-Instruct) knows most of it (docs/publication-gate.md
gives the measured count): capitals, a few everyday counts, simple sums and well-known science facts, each with a
one-word answer that an answer of ``KNOWLEDGE_TOKENS`` tokens reaches.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class KnowledgeProbe:
    question: str
    answers: tuple[str, ...]
    """Any of these, as a whole word or phrase in any case, makes the answer right (a number and its word)."""


KNOWLEDGE_TOKENS = 24
"""Most tokens of a knowledge probe's answer: the fact comes in the first sentence ("The capital of France
is Paris."); a longer answer would cost a check more without telling more."""

KNOWLEDGE: tuple[KnowledgeProbe, ...] = (
    KnowledgeProbe("What is the capital of France?", ("Paris",)),
    KnowledgeProbe("What is the capital of Japan?", ("Tokyo",)),
    KnowledgeProbe("What is the capital of Germany?", ("Berlin",)),
    KnowledgeProbe("What is 7 + 5?", ("12", "twelve")),
    KnowledgeProbe("What is 2 + 2?", ("4", "four")),
    KnowledgeProbe("What is 10 + 10?", ("20", "twenty")),
    KnowledgeProbe("How many days are there in a week?", ("7", "seven")),
    KnowledgeProbe("How many months are there in a year?", ("12", "twelve")),
    KnowledgeProbe("How many hours are there in a day?", ("24", "twenty-four", "twenty four")),
    KnowledgeProbe("How many sides does a triangle have?", ("3", "three")),
    KnowledgeProbe("What is the boiling point of water in degrees Celsius?", ("100", "one hundred")),
    KnowledgeProbe("Which planet is known as the Red Planet?", ("Mars",)),
    KnowledgeProbe("What is the chemical formula of water?", ("H2O", "H₂O")),
    KnowledgeProbe("Who wrote Romeo and Juliet?", ("Shakespeare",)),
    KnowledgeProbe("What gas do plants absorb from the air?", ("carbon dioxide", "CO2", "CO₂")),
    KnowledgeProbe("What is the largest ocean on Earth?", ("Pacific",)),
    KnowledgeProbe("What colour is the sky on a clear day?", ("blue",)),
)


def knows(answer: str, answers: tuple[str, ...]) -> bool:
    """True when ``answer`` contains one of ``answers`` as a whole word or phrase, in any case ("12" is found in
    "7 + 5 = 12." but not in "120"; "Paris" in "paris." but not in "Parisian")."""
    return _mentions(answer, answers, after=r"(?!\w)")


def names_fact(prefix: str, answers: tuple[str, ...]) -> bool:
    """True when an answer still being written already settles ``knows``: one of ``answers`` occurs as a whole word
    with a character that is no letter or digit after it ("= 12." or "= 12 "), so no later token can turn it into
    another number or word ("= 12" could still become "= 120")."""
    return _mentions(prefix, answers, after=r"(?=\W)")


def _mentions(text: str, answers: tuple[str, ...], *, after: str) -> bool:
    """One of ``answers`` in ``text``, in any case, with no letter or digit before it and ``after`` after it."""
    return any(re.search(rf"(?<!\w){re.escape(a)}{after}", text, re.IGNORECASE) for a in answers)
