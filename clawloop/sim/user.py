"""Simulated users: who writes the persona's next message.

* ``RuleBasedUser`` (default): the persona's own phrasings (``Persona.reply``), chosen by a seeded
  ``random.Random``, so a run is reproducible message for message.
* ``LLMUser``: the message is written by any OpenAI-compatible chat model (``base_url`` ending in ``/v1``,
  ``model``, optional ``api_key``), role-playing the persona from a system prompt that holds the hidden
  preference. The deterministic checker still decides the score; by default the model is also told the
  checker's verdict so that its reply (correction or thanks) agrees with the score, which a small simulator
  model would otherwise get wrong often. Set ``share_verdict=False`` to let the model judge on its own, as
  the original's simulator did. Reasoning blocks (``<think>...</think>``) are stripped; an empty or failed
  reply falls back to the persona's rule-based reply and is marked ``rules-fallback`` (never silent).

Both expose ``reply(conversation, answer, next_question, question) -> Reply``; ``conversation`` is the OpenAI
message list so far (without ``answer``), ``question`` the question ``answer`` is meant to answer (after a
correction, the same question as before).
"""

from __future__ import annotations

import logging
import random
import re
from typing import Any, Protocol

import httpx

from clawloop.sim.personas import Persona, Reply

log = logging.getLogger(__name__)

_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


class SimulatedUser(Protocol):
    persona: Persona

    def reply(
        self, conversation: list[dict[str, Any]], answer: str, next_question: str | None, question: str | None = None
    ) -> Reply: ...


class RuleBasedUser:
    """The persona's scripted replies, varied by a seeded RNG."""

    def __init__(self, persona: Persona, seed: int = 0) -> None:
        self.persona = persona
        self.rng = random.Random(seed)

    def reply(
        self, conversation: list[dict[str, Any]], answer: str, next_question: str | None, question: str | None = None
    ) -> Reply:
        return self.persona.reply(answer, next_question, self.rng, question)


def system_prompt(persona: Persona) -> str:
    """The simulator's instructions: who it is, its hidden preference, and how to react."""
    return (
        f"{persona.description}\n\n"
        f"Your hidden preference: {persona.preference}\n"
        "Do not announce the preference in advance. After each answer of the assistant you write your next "
        "chat message, and nothing else:\n"
        "- if the answer does not follow your preference, reply with one or two short sentences that tell the "
        "assistant concretely what you want instead;\n"
        "- if the answer is garbled, repeats itself or does not answer your question, say so and ask again;\n"
        "- otherwise thank the assistant in a few words and ask your next question, word for word as given "
        "(or, when there is no next question, say goodbye)."
    )


def _transcript(conversation: list[dict[str, Any]]) -> str:
    lines = []
    for m in conversation:
        who = "You" if m.get("role") == "user" else "Assistant"
        lines.append(f"{who}: {m.get('content') or ''}")
    return "\n".join(lines)


class LLMUser:
    """A persona whose messages are written by an OpenAI-compatible chat model."""

    def __init__(
        self,
        persona: Persona,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        seed: int = 0,
        temperature: float = 0.7,
        max_tokens: int = 128,
        share_verdict: bool = True,
        timeout_s: float = 60.0,
        client: httpx.Client | None = None,
    ) -> None:
        self.persona = persona
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.share_verdict = share_verdict
        self.rng = random.Random(seed)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = client or httpx.Client(timeout=timeout_s)
        self.fallbacks = 0
        """How many replies came from the rule-based fallback because the LLM gave nothing usable."""

    def messages(
        self, conversation: list[dict[str, Any]], answer: str, next_question: str | None, question: str | None = None
    ) -> list[dict[str, str]]:
        """The chat request sent to the simulator model (public so a user can see what it is told)."""
        verdict = self.persona.judge(answer, question)
        parts = []
        if conversation:
            parts.append("The conversation so far:\n" + _transcript(conversation))
        parts.append("The assistant just answered:\n<<<\n" + answer + "\n>>>")
        if self.share_verdict:
            if "off_topic" in verdict.guard_reasons:
                parts.append("Note: this answer does not answer your question.")
            elif not verdict.sound:
                parts.append("Note: this answer is garbled or repetitive.")
            parts.append(
                "Note: this answer follows your preference."
                if verdict.satisfied
                else "Note: this answer does NOT follow your preference."
            )
        if next_question is None:
            parts.append("This is your last message in this chat.")
        else:
            parts.append(f"Your next question: {next_question}")
        parts.append("Write your next message now.")
        return [
            {"role": "system", "content": system_prompt(self.persona)},
            {"role": "user", "content": "\n\n".join(parts)},
        ]

    def reply(
        self, conversation: list[dict[str, Any]], answer: str, next_question: str | None, question: str | None = None
    ) -> Reply:
        rule = self.persona.reply(answer, next_question, self.rng, question)  # same RNG draws either way
        body = {
            "model": self.model,
            "messages": self.messages(conversation, answer, next_question, question),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "seed": self.rng.randrange(2**31),
        }
        try:
            resp = self.client.post(self.url, json=body, headers=self.headers)
            resp.raise_for_status()
            text = resp.json()["choices"][0]["message"].get("content") or ""
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            log.warning("simulated user LLM failed (%s); using the persona's scripted reply", exc)
            text = ""
        text = _THINK_RE.sub("", text).strip()
        if not text:
            self.fallbacks += 1
            return Reply(rule.text, rule.kind, rule.verdict, source="rules-fallback")
        return Reply(text, rule.kind, rule.verdict, source="llm")
