"""Personas: simulated users with a hidden preference the agent has to learn from their replies.

A persona never states its preference up front. It asks a question; when the answer violates the preference
it replies with a concrete correction that reveals it (several phrasings, picked by a seeded RNG), which is
exactly the kind of next state the judge turns into a negative vote and a hindsight hint. When the answer
follows the preference it says a short thanks and asks its next question (a positive next state). A
degenerate answer (see ``guard``) gets a complaint about the nonsense, plus the correction when the
preference is violated too. Sessions last ``session_turns`` answers.

The personas were chosen so that SmolLM2-135M-Instruct *can* follow the preference when told (the hint
brings it in reach) yet does not by default; ``python -m clawloop.sim.probe`` measures that, and the table
that justified each choice (and the preferences that were dropped) is in ``clawloop/sim/README.md``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from clawloop.sim import checkers, guard
from clawloop.sim.data.questions import pool

Checker = Callable[[str], bool]


@dataclass(frozen=True)
class Verdict:
    """How one answer fares against a persona: the preference, the guard, and both together."""

    satisfied: bool
    """The persona's checker accepts the answer."""
    sound: bool
    """The degeneracy guard accepts the answer (including the topic rule when the persona checks it)."""
    guard_reasons: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """What the preference score counts: preference followed *and* not degenerate."""
        return self.satisfied and self.sound


@dataclass(frozen=True)
class Reply:
    """The persona's next message and why it said it."""

    text: str
    kind: str
    """``correction`` (preference violated), ``nonsense`` (degenerate answer), ``off_topic`` (the answer
    ignores the question, which is asked again), ``thanks`` (all good; asks the next question) or
    ``farewell`` (all good; last turn of the session)."""
    verdict: Verdict
    source: str = "rules"
    """Who wrote ``text``: ``rules`` (the persona's phrasings), ``llm`` or ``rules-fallback`` (the LLM gave
    nothing usable)."""


@dataclass(frozen=True)
class Persona:
    name: str
    preference: str
    """The preference as the user would state it as an instruction (also what a perfect hint says)."""
    description: str
    """Who the user is, in the second person; the system prompt of an LLM-driven simulated user."""
    checker: Checker
    pool_name: str
    corrections: tuple[str, ...]
    """Replies to an answer that violates the preference; each one reveals the preference concretely."""
    thanks: tuple[str, ...] = (
        "Thanks! {question}",
        "Great, thank you. Next question: {question}",
        "Perfect, that helps. {question}",
        "Thank you, that's what I wanted. {question}",
        "Nice, thanks. Another one: {question}",
        "Good answer, thanks! {question}",
    )
    """Replies to a good answer; ``{question}`` is the next question."""
    farewells: tuple[str, ...] = (
        "Thanks, that's all for today.",
        "Perfect, thank you. Bye!",
        "Great, thanks for your help.",
        "That's exactly what I wanted, thanks.",
    )
    nonsense: tuple[str, ...] = (
        "That doesn't make sense, you are repeating yourself. Please answer properly.",
        "This reply is garbled. Can you answer the question clearly?",
        "I can't understand that answer at all. Please try again.",
    )
    unanswered: tuple[str, ...] = (
        "That doesn't answer my question. {question}",
        "You didn't answer what I asked: {question}",
        "Please answer my question: {question}",
    )
    """Replies to an answer that ignores the question (``{question}`` is asked again)."""
    check_topic: bool = True
    """Whether an answer must mention a content word of the question to count as sound (off for personas
    that want another language than the question's)."""
    session_turns: int = 3
    """Answers per session (corrections included) before the persona ends the session."""
    guard_config: guard.GuardConfig = field(default_factory=guard.GuardConfig)
    own_train_questions: tuple[str, ...] = ()
    """Training questions of the persona's own (a persona file may list them); empty = the pool's."""
    own_heldout_questions: tuple[str, ...] = ()
    """Held-out questions of the persona's own; empty = the pool's."""
    source: str = ""
    """The file the persona was read from ("" for the built-in ones)."""

    @property
    def train_questions(self) -> tuple[str, ...]:
        return self.own_train_questions or pool(self.pool_name)["train"]

    @property
    def heldout_questions(self) -> tuple[str, ...]:
        return self.own_heldout_questions or pool(self.pool_name)["heldout"]

    def judge(self, answer: str, question: str | None = None) -> Verdict:
        """Score ``answer`` deterministically against the preference and the degeneracy guard.

        With ``question`` (and ``check_topic``), an answer that never mentions what was asked is not sound.
        """
        g = guard.check(answer, self.guard_config, question if self.check_topic else None)
        return Verdict(satisfied=bool(self.checker(answer)), sound=g.ok, guard_reasons=g.reasons)

    def reply(
        self, answer: str, next_question: str | None, rng: random.Random, question: str | None = None
    ) -> Reply:
        """The persona's next message after ``answer`` to ``question``.

        ``next_question`` is what to ask after a good answer; ``None`` means the session ends here, so a
        good answer gets a farewell instead. Without ``question`` the topic is not checked.
        """
        verdict = self.judge(answer, question)
        if not verdict.sound:
            degenerate = set(verdict.guard_reasons) - {"off_topic"}
            if degenerate or question is None:
                text, kind = rng.choice(self.nonsense), "nonsense"
            else:
                text, kind = rng.choice(self.unanswered).format(question=question), "off_topic"
            if not verdict.satisfied:
                text += " " + rng.choice(self.corrections)
            return Reply(text, kind, verdict)
        if not verdict.satisfied:
            return Reply(rng.choice(self.corrections), "correction", verdict)
        if next_question is None:
            return Reply(rng.choice(self.farewells), "farewell", verdict)
        return Reply(rng.choice(self.thanks).format(question=next_question), "thanks", verdict)

    def instruct(self, question: str) -> str:
        """``question`` with the preference appended the way the teacher's hint is (docs/method.md, section 3)."""
        return f"{question}\n\n[user's hint / instruction]\n{self.preference}"


FRENCH = Persona(
    name="french",
    preference="Always reply in French.",
    description=(
        "You are a French speaker who reads very little English. You chat with an AI assistant about everyday "
        "life. You want every answer written in French."
    ),
    checker=checkers.FrenchChecker(),
    pool_name="everyday",
    corrections=(
        "Please answer in French, I don't read English well.",
        "Could you say that in French? I only speak French.",
        "In French, please! Je ne parle pas anglais.",
        "I can't read English. Please write your answer in French.",
        "Répondez en français, s'il vous plaît. Please reply in French.",
        "Again in English... please always reply to me in French.",
    ),
    # The questions are English and the wanted answers French: shared topic words cannot be expected.
    check_topic=False,
)

BRIEF = Persona(
    name="brief",
    preference="Answer in one short sentence.",
    description=(
        "You are a busy person who reads answers on a phone. You ask an AI assistant simple science questions "
        "and want each answer to be a single short sentence (25 words at most)."
    ),
    checker=checkers.BriefChecker(max_words=25),
    pool_name="science",
    corrections=(
        "That's too long. Please answer in one short sentence.",
        "Too many words! Give me just one short sentence.",
        "I only have time for one sentence. Can you keep it that short?",
        "Please be brief: a single sentence of at most 25 words.",
        "Shorter, please. One sentence is enough for me.",
        "Way too long for me. Just one short sentence next time, please.",
    ),
)

INSHORT = Persona(
    name="inshort",
    preference='Begin every answer with "In short,".',
    description=(
        "You are a curious person who asks an AI assistant about places and the sea. You like to get the gist "
        'first: every answer should begin with the words "In short," and then answer your question.'
    ),
    checker=checkers.OpeningChecker("In short"),
    pool_name="places",
    corrections=(
        'Please begin your answer with "In short," and give me the gist.',
        'Start with "In short," next time, please.',
        'I like answers that open with "In short,". Can you do that?',
        'You forgot the "In short," at the start. Always begin with it, please.',
        'Give me the gist first: begin every answer with "In short,".',
        'Where is my "In short,"? Please start your answers with it.',
    ),
)

SPANISH = Persona(
    name="spanish",
    preference="Always reply in Spanish.",
    description=(
        "You are a Spanish speaker who reads very little English. You ask an AI assistant for advice about "
        "study, work and technology. You want every answer written in Spanish."
    ),
    checker=checkers.SpanishChecker(),
    pool_name="advice",
    corrections=(
        "Please answer in Spanish, I don't read English well.",
        "Could you write that in Spanish? I only speak Spanish.",
        "In Spanish, please! No hablo inglés.",
        "I can't read English. Please write your answer in Spanish.",
        "Responde en español, por favor. Please reply in Spanish.",
        "English again... please always reply to me in Spanish.",
    ),
    check_topic=False,
)

PERSONAS: dict[str, Persona] = {p.name: p for p in (BRIEF, INSHORT, FRENCH, SPANISH)}


def get_persona(name: str) -> Persona:
    if name not in PERSONAS:
        raise KeyError(f"no persona {name!r}; known: {', '.join(PERSONAS)}")
    return PERSONAS[name]
