"""Deterministic checkers: does an answer follow a persona's hidden preference?

Each checker is a small frozen object with ``__call__(text) -> bool`` and a ``describe()`` for reports. They are
pure functions of the text (no model, no randomness), so a preference score is reproducible anywhere.

* ``LanguageChecker`` (``FrenchChecker``, ``SpanishChecker``): language identification by stop-word lists. Words
  are lower-cased, curly apostrophes straightened, and elided forms kept with their apostrophe (``l'``, ``qu'``).
  Words that are stop words in more than one of French/English/Spanish (``a``, ``on``, ``de``, ``la``, ``que``...)
  are simply not in the lists, so they vote for nobody. The text is French when it has at least ``min_hits`` French
  stop words and French holds at least ``min_share`` of all stop-word hits (likewise for Spanish). Keeping both
  lists matters: a policy pushed toward French can drift into Spanish-looking text, which must not count.
* ``BriefChecker``: one sentence of at most ``max_words`` words. Sentences end at ``.``, ``!``, ``?`` (or
  a line break) followed by more text; a few common abbreviations and decimal points do not end one.
* ``ParagraphChecker``: one short paragraph, a finished answer of ``min_sentences``–``max_sentences`` sentences and
  at most ``max_words`` words, no list lines: the length between a one-liner and the model's usual answer.
* ``OpeningChecker``: the answer starts with a fixed word (``Ahoy``), allowing leading quotes or markdown
  emphasis and any case, requiring a word boundary after it and an actual answer (a few words) after it.
* ``ClosingChecker``: the answer ends with a fixed phrase, ignoring trailing spaces, quotes and emphasis, after
  an actual answer (a few words).
* ``NumberedListChecker``: the answer is a numbered list (``1. ...``, ``2) ...``) of distinct items, an optional
  lead-in line before it.
* ``LowercaseChecker`` / ``NoDigitsChecker``: character-class rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from clawloop.gate.guard import ENGLISH_STOPWORDS  # noqa: F401 - shared with the guard, re-exported here

_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'"})
# A word is a run of letters (accented ones included); an elided French article keeps its apostrophe.
_WORD_RE = re.compile(r"[a-zà-öø-ÿœæ]+'?", re.IGNORECASE)

FRENCH_STOPWORDS = frozenset(
    """
    le les un une des du au aux et est sont il elle ils elles nous vous je ce cette ces cet
    dans pour par sur avec sans mais ou où donc qui quoi dont ne pas plus très aussi être avoir
    été fait faire peut sont leur leurs mon ma mes ton ta tes sa ses notre nos votre vos
    c'est c' l' d' j' qu' n' s' m' t' chez comme tout tous toute toutes
    bien encore alors quand parce peu beaucoup ici voici voilà oui non merci bonjour
    cela ça celui celle ceux quel quelle quels quelles lorsque puis ainsi avant après
    """.split()
)
SPANISH_STOPWORDS = frozenset(
    """
    el los las y es está están son del al por para con una unos unas lo pero como muy
    más también este esta estos estas ese esa eso su sus mi mis tus nosotros ellos ellas
    hay ser estar fue gracias hola sí cuando donde porque sin sobre todo todos
    """.split()
)


def words(text: str) -> list[str]:
    """Lower-cased words of ``text``; French elisions keep their apostrophe (``l'eau`` -> ``l'``, ``eau``)."""
    return [w.lower() for w in _WORD_RE.findall(text.translate(_APOSTROPHES))]


@dataclass(frozen=True)
class LanguageCounts:
    french: int
    english: int
    spanish: int


def count_stopwords(text: str) -> LanguageCounts:
    fr = en = es = 0
    for w in words(text):
        fr += w in FRENCH_STOPWORDS
        en += w in ENGLISH_STOPWORDS
        es += w in SPANISH_STOPWORDS
    return LanguageCounts(fr, en, es)


@dataclass(frozen=True)
class LanguageChecker:
    """Text in ``language``: enough of its stop words, and that language clearly ahead of the other two."""

    language: str = "french"
    """``french``, ``spanish`` or ``english``."""
    min_hits: int = 2
    min_share: float = 0.6

    def __call__(self, text: str) -> bool:
        c = count_stopwords(text)
        hits = getattr(c, self.language)
        total = c.french + c.english + c.spanish
        return hits >= self.min_hits and hits >= self.min_share * total

    def describe(self) -> str:
        return (f"written in {self.language.capitalize()} (>= {self.min_hits} of its stop words, "
                f">= {self.min_share:.0%} of all stop-word hits)")


@dataclass(frozen=True)
class FrenchChecker(LanguageChecker):
    language: str = "french"


@dataclass(frozen=True)
class SpanishChecker(LanguageChecker):
    language: str = "spanish"


# Tokens ending in a period that do not end a sentence.
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "mr.", "mrs.", "ms.", "dr.", "st.", "vs.", "u.s.", "a.m.", "p.m.")
_SENTENCE_END_RE = re.compile(r"[.!?]+[\"')\]*]*$")


def sentence_count(text: str) -> int:
    """Number of sentences: text pieces ended by ``.!?`` before more text, or by a line break."""
    count = 0
    for line in text.strip().splitlines():
        tokens = line.split()
        if not tokens:
            continue
        count += 1  # a non-empty line is at least one sentence
        for tok in tokens[:-1]:  # a terminator on the last token only closes the current sentence
            if _SENTENCE_END_RE.search(tok) and tok.lower() not in _ABBREVIATIONS:
                count += 1
    return count


def word_count(text: str) -> int:
    """Whitespace-separated pieces that contain a letter or digit (a lone dash or emoji is not a word)."""
    return sum(1 for tok in text.split() if any(ch.isalnum() for ch in tok))


@dataclass(frozen=True)
class BriefChecker:
    """Exactly one sentence of at most ``max_words`` words."""

    max_words: int = 20

    def __call__(self, text: str) -> bool:
        n = word_count(text)
        return 1 <= n <= self.max_words and sentence_count(text) == 1

    def describe(self) -> str:
        return f"one sentence of at most {self.max_words} words"


# Decoration a model may put around its text: quotes, markdown emphasis, spaces.
_DECORATION = " \t\r\n\"'*_`“”‘’"
# A list line: a bullet (-, *, •) or a number with "." or ")" at its start.
_LIST_LINE = re.compile(r"^[ \t]*(?:[-*•]|\d{1,2}[.)])[ \t]+\S", re.MULTILINE)


@dataclass(frozen=True)
class ParagraphChecker:
    """One short paragraph: ``min_sentences`` to ``max_sentences`` sentences (as ``sentence_count`` counts them),
    at most ``max_words`` words, no list lines, and a sentence end as its last character: an answer cut at the
    token cap mid-sentence is not a paragraph of this size (one cut just after a full stop cannot be told apart).

    Disjoint from ``BriefChecker`` whenever ``min_sentences`` ≥ 2, so two users who want these two lengths can be
    told apart by their answers."""

    min_sentences: int = 2
    max_sentences: int = 4
    max_words: int = 60

    def __call__(self, text: str) -> bool:
        body = text.rstrip(_DECORATION + ")]")
        return (self.min_sentences <= sentence_count(text) <= self.max_sentences
                and 1 <= word_count(text) <= self.max_words
                and body[-1:] in (".", "!", "?") and not _LIST_LINE.search(text))

    def describe(self) -> str:
        return (f"one paragraph of {self.min_sentences}-{self.max_sentences} sentences and at most "
                f"{self.max_words} words")


@dataclass(frozen=True)
class OpeningChecker:
    """The answer starts with ``word`` (any case), followed by a non-letter (``Ahoy!``, ``Ahoy,``, ``AHOY``)."""

    word: str = "Ahoy"
    min_words_after: int = 3
    """A bare greeting is not an answer: at least this many words must follow the opening."""

    def __call__(self, text: str) -> bool:
        head = text.lstrip(_DECORATION)
        match = re.match(re.escape(self.word) + r"(?![a-zA-Z0-9])", head, re.IGNORECASE)
        return match is not None and word_count(head[match.end() :]) >= self.min_words_after

    def describe(self) -> str:
        return f"starts with {self.word!r}"


@dataclass(frozen=True)
class ClosingChecker:
    """The answer ends with ``phrase`` (any case), ignoring trailing decoration and a final period."""

    phrase: str = "Cheers!"
    min_words_before: int = 3
    """A bare sign-off is not an answer: at least this many words must come before the closing."""

    def __call__(self, text: str) -> bool:
        tail = text.rstrip(_DECORATION + ".")
        want = self.phrase.rstrip(".")
        if not tail.lower().endswith(want.lower()):
            return False
        body = tail[: len(tail) - len(want)]
        return (not body or not body[-1].isalnum()) and word_count(body) >= self.min_words_before

    def describe(self) -> str:
        return f"ends with {self.phrase!r}"


# A numbered item: a line that starts with a number and "." or ")" and has text after it.
_NUMBERED_ITEM = re.compile(r"^[ \t]*\d{1,2}[.)][ \t]+(\S.*)$", re.MULTILINE)


@dataclass(frozen=True)
class NumberedListChecker:
    """At least ``min_items`` numbered lines with distinct text (``1. Boil water`` / ``2) Add salt``).

    Distinct, because a model pushed toward lists can repeat one item ("1. A frog 2. A frog"), which no user who
    asked for a list would accept. Text before the first item (a lead-in sentence) is allowed."""

    min_items: int = 2

    def __call__(self, text: str) -> bool:
        items = [m.group(1).strip().lower() for m in _NUMBERED_ITEM.finditer(text)]
        return len(items) >= self.min_items and len(set(items)) == len(items)

    def describe(self) -> str:
        return f"a numbered list of at least {self.min_items} distinct items"


@dataclass(frozen=True)
class LowercaseChecker:
    """Letters present, none of them upper case."""

    def __call__(self, text: str) -> bool:
        return any(ch.isalpha() for ch in text) and not any(ch.isupper() for ch in text)

    def describe(self) -> str:
        return "all lower case"


@dataclass(frozen=True)
class NoDigitsChecker:
    """Letters present, no digit characters."""

    def __call__(self, text: str) -> bool:
        return any(ch.isalpha() for ch in text) and not any(ch.isdigit() for ch in text)

    def describe(self) -> str:
        return "no digits"


CHECKER_KINDS: dict[str, type] = {
    "language": LanguageChecker,
    "french": FrenchChecker,
    "spanish": SpanishChecker,
    "brief": BriefChecker,
    "paragraph": ParagraphChecker,
    "opening": OpeningChecker,
    "closing": ClosingChecker,
    "numbered_list": NumberedListChecker,
    "lowercase": LowercaseChecker,
    "no_digits": NoDigitsChecker,
}
"""The checker kinds a persona file can name (``[checker] kind = ...``); its other keys are the fields of the class."""
