"""The degeneracy guard: is an answer still a sound piece of text?

A policy pushed toward a preference can "satisfy" a checker with garbage (a French stop word looped forever,
``El Turco, el Turco, ...``). The publication gate (``clawloop.gate.gate``) runs it on a candidate's probe
answers before the candidate is served; the simulation's preference score counts an answer only when it also
passes this guard, and reports the guard's own pass rate next to it so a collapse is visible even when the
checker is happy.

Rules (each one names its reason, so reports can say why an answer failed):

* ``empty``: fewer than ``min_letters`` letters;
* ``too_long``: more than ``max_words`` words or ``max_chars`` characters;
* ``non_letters``: letters are less than ``min_letter_ratio`` of the non-space characters (symbol or digit
  soup, a run of ``!!!!``);
* ``long_word``: a single "word" longer than ``max_word_chars`` (``hahahahaha...`` with no spaces);
* ``repeated_ngram``: for some ``(n, count)`` in ``ngram_limits``, a word n-gram occurs ``count`` times or
  more. The default ``((3, 4), (5, 3))`` rejects a 3-gram repeated three times after its first use, or a
  5-gram (a clause) seen three times. Counting a 3-gram's third occurrence as degenerate was too strict:
  unchanged SmolLM2-135M answers often say "the process of" or "primarily composed of" three times in 64
  tokens, and those are the answers the score must accept before training;
* ``low_diversity``: for answers of at least ``diversity_min_words`` words, distinct words are less than
  ``min_distinct_ratio`` of all words (a loop over a few words, even with varying punctuation).

With the question given (``check(text, question=...)``), two more rules apply:

* ``echo``: every word of the answer is a word of the question or a function word
  ("Why do stars shine?" answered with itself): short and on topic, yet no answer. A policy trained toward
  "one short sentence" found this shortcut, and a user who thanks for it would reward it;
* ``off_topic``: no content word of the question (4+ letters, or 3 when it has no longer one; not a function
  word) appears in the answer,
  matching on a 5-letter prefix so ``pancakes``/``pancake`` or ``read``/``reading`` count (and a final e
  dropped before an ending, ``care``/``caring``). This catches the
  commonest non-answer of a small model told to open with a greeting ("Hello! I'm here to help. What's your
  question?"). It assumes question and answer share a language, so personas that want another language
  than the question's leave it off.

Which question a conversation asks is ``question_of`` (its last user message's last sentence, when that is a
wh-question), for the gate's recent prompts and the pipeline's context answers alike.

Words are lower-cased runs of letters/digits (contractions kept whole: ``it's``), so punctuation and case do
not hide a loop. The thresholds
are set for answers of up to a few hundred tokens, which is what the evaluation asks for.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from clawloop.judge.envelopes import strip_messages

ENGLISH_STOPWORDS = frozenset(
    """
    the and is are was were be been being it its this that these those of to in for with
    by from at or but not yes you your we our they their he she his her him them i my
    have has had do does did will would can could should may might must which who what when
    where why how there here than then also very more most some any all each other into
    about over after before because if so such only just one many much well thank thanks hello
    it' don' doesn' isn' aren' can' won' i' you' we' they' that' there' let' what'
    """.split()
)
"""English function words (also used by the simulation's language checker)."""

_WORD_RE = re.compile(r"\w+(?:['\u2019]\w+)*", re.UNICODE)
_LETTERS_RE = re.compile(r"[^\W\d_]+", re.UNICODE)
_NUMBER_RE = re.compile(r"\d+(?:[.,]\d+)?")
# Words of a question that say nothing about its topic.
_NOT_TOPIC = ENGLISH_STOPWORDS | frozenset(
    "make good best does like thing things keep take give get way ways something someone better need "
    "tell know mean means".split()
)
# Three-letter words that name no topic either, for questions whose only content words are that short.
_NOT_SHORT_TOPIC = frozenset("see say now new old use try ask far put set out off own too yet got lot let way "
                             "get day two few big".split())


@dataclass(frozen=True)
class GuardConfig:
    min_letters: int = 2
    max_words: int = 400
    max_chars: int = 3000
    min_letter_ratio: float = 0.5
    max_word_chars: int = 40
    ngram_limits: tuple[tuple[int, int], ...] = ((3, 4), (5, 3))
    diversity_min_words: int = 20
    min_distinct_ratio: float = 0.3


@dataclass(frozen=True)
class GuardResult:
    ok: bool
    reasons: tuple[str, ...] = field(default_factory=tuple)


def topic_words(question: str) -> set[str]:
    """The content words of ``question`` (lower case, not function words): those of 4+ letters, or, when it has
    none, those of 3 ("What is an owl?", "What is the Sun?": a gate check let "Awesome!" through as an answer
    about owls while only longer words counted; 3-letter words match on their prefix, so "sun" also takes
    "Sunday")."""
    words = [w for w in (x.lower() for x in _LETTERS_RE.findall(question)) if w not in _NOT_TOPIC]
    return {w for w in words if len(w) >= 4} or {w for w in words if len(w) == 3 and w not in _NOT_SHORT_TOPIC}


def on_topic(question: str, answer: str) -> bool:
    """True when the answer mentions a content word of the question (or the question has none)."""
    keys = topic_words(question)
    if not keys:
        return True
    shortest = min(4, *(len(k) for k in keys))
    said = {w.lower() for w in _LETTERS_RE.findall(answer) if len(w) >= shortest}
    return any(s.startswith(k[:5]) or k.startswith(s[:5]) or _drops_final_e(k, s) for k in keys for s in said)


def _drops_final_e(key: str, word: str) -> bool:
    """``word`` is ``key`` inflected after dropping its final e ("care" → "caring", "bake" → "baked"): the prefix
    rule misses these, and "How do I care for a cat?" answered "Caring for a cat …" was called off topic."""
    return len(key) >= 4 and key.endswith("e") and word.startswith(key[:-1]) and \
        word[len(key) - 1:] in ("ing", "ings", "ed", "er", "ers")


def echoes(question: str, answer: str) -> bool:
    """True when the answer adds no word of its own to the question ("Why do stars shine?" answered with
    "Why do stars shine?" or "Stars shine."): it says nothing, although it is short and on topic."""
    asked = {w.lower() for w in _LETTERS_RE.findall(question)}
    said = [w.lower() for w in _LETTERS_RE.findall(answer)]
    # A number the question does not hold is content of its own ("Three hours is 180 minutes.").
    new_numbers = set(_NUMBER_RE.findall(answer)) - set(_NUMBER_RE.findall(question))
    return bool(said) and not new_numbers and all(w in asked or w in ENGLISH_STOPWORDS for w in said)


def check(text: str, config: GuardConfig = GuardConfig(), question: str | None = None) -> GuardResult:
    """All the rules ``text`` breaks (none = sound); with ``question``, also whether it stays on topic."""
    reasons: list[str] = []
    letters = sum(ch.isalpha() for ch in text)
    visible = sum(not ch.isspace() for ch in text)
    words = [w.lower() for w in _WORD_RE.findall(text)]

    if letters < config.min_letters:
        reasons.append("empty")
    if len(words) > config.max_words or len(text) > config.max_chars:
        reasons.append("too_long")
    if visible and letters < config.min_letter_ratio * visible:
        reasons.append("non_letters")
    if any(len(w) > config.max_word_chars for w in words):
        reasons.append("long_word")
    for n, limit in config.ngram_limits:
        if len(words) >= n:
            grams = Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))
            if grams.most_common(1)[0][1] >= limit:
                reasons.append("repeated_ngram")
                break
    if len(words) >= config.diversity_min_words and len(set(words)) < config.min_distinct_ratio * len(words):
        reasons.append("low_diversity")
    if question is not None and not on_topic(question, text):
        reasons.append("off_topic")
    if question is not None and echoes(question, text):
        reasons.append("echo")
    return GuardResult(ok=not reasons, reasons=tuple(reasons))


def passes_guard(text: str, config: GuardConfig = GuardConfig(), question: str | None = None) -> bool:
    """True when ``text`` breaks none of the guard's rules."""
    return check(text, config, question).ok


WH_WORDS = frozenset("what why how where when who whom whose which".split())
_SENTENCE_END_RE = re.compile(r"(?<=[.!?:;])\s+|\n+")
"""Where a sentence ends: punctuation followed by white space ("Node.js" and "10:30" stay whole), or a new line."""
_CLOSERS = "\"'”’)]*_ \t"


def question_of(messages: Sequence[dict[str, Any]]) -> str | None:
    """The question a recent prompt asks, for the guard's question rules (on topic, not an echo): the last
    sentence of its last user message (``last_user_text``: client envelopes removed) when that sentence is a
    wh-question ("Thanks! What is an atom?" gives "What is an atom?"), else None. Thanks, farewells and requests
    about the answer itself ("Great, thanks for your help.", "Can you keep it that short?", "Shorter, please.")
    say nothing about what the answer should be about: checked against their words, "You're welcome." was off
    topic and a compliant short re-answer would be too, and such false alarms fell on the candidates that had
    learnt the preference. The price: a recent
    prompt that asks in another form ("Explain photosynthesis.", "Can you tell me what a fossil is?", "What is
    X? One word, please.") gets the text rules only; the shipped probes keep the question rules for every form."""
    text = last_user_text(messages)
    if text is None:
        return None
    sentences = [s.strip() for s in _SENTENCE_END_RE.split(text) if any(ch.isalpha() for ch in s)]
    last = sentences[-1].rstrip(_CLOSERS).rstrip("!") if sentences else ""
    first = re.match(r"[^\W\d_]+", last.lstrip("\"'“‘(*_").lower())
    if not last.endswith("?") or first is None or first.group() not in WH_WORDS:  # "What's" counts as "what"
        return None
    return last


def last_user_text(messages: Sequence[dict[str, Any]]) -> str | None:
    """What the user wrote in a prompt's last message, when that is a user message of plain text, else None (a
    tool result, an image). Client envelopes are removed first (``clawloop.judge.envelopes``, as for the judge):
    OpenClaw's timestamp before the question ("[Mon 2026-11-23 19:51 UTC] What is a frog?") hid it from
    ``question_of``, and its internal-context message, sent after the user's, is no message of the user's."""
    kept = strip_messages(messages)
    return plain_text(kept[-1]) if kept and kept[-1].get("role") == "user" else None


def plain_text(message: dict[str, Any]) -> str | None:
    """A message's content when it is plain text (a string, or text parts only), stripped; else None."""
    content = message.get("content")
    if isinstance(content, list):  # content parts: only an all-text message counts
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
            return None
        content = " ".join(str(part.get("text", "")) for part in content)
    if not isinstance(content, str):
        return None
    return content.strip() or None
