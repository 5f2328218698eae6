"""Driving a clawloop server with a simulated user, over HTTP, like any client.

Training sessions (``Simulation``). A session opens with the persona's next training question and runs
``persona.session_turns`` answers. Every request carries ``X-Session-Id`` and ``X-Turn-Type: main``, so every
answer is a trainable turn. After each answer the simulated user replies: a correction (the same question is
then answered again), or thanks plus the next question, or, on the last answer, a farewell. Questions come from
the persona's training pool in a seeded shuffled order, cycled; a question is consumed only when the user
moves on to it.

Ending a session. By default (``end_mode="header"``) the user's last reply goes out in one more request that
carries ``X-Session-Done: true``: that reply is the next state of the last answer, so every answer of the
session can be judged. The answer to this closing request has no next state by construction (the server drops
it as ``no_next_state``), so it is generated with ``max_tokens=1`` to spend no time on it.
``end_mode="endpoint"`` instead calls ``POST /v1/sessions/{id}/end`` right after the last answer: the last
answer then gets no next state and is dropped by the server, which is what a client that just walks away
looks like.

Evaluation (``evaluate``). Each held-out question goes out as a fresh one-message conversation with
``X-Turn-Type: side`` (served, never trained), ``X-Session-Done: true``, ``temperature: 0`` and a fixed seed,
so the score is the greedy policy's and evaluation never feeds the trainer. The preference score is the share
of answers that satisfy the persona's checker *and* pass the degeneracy guard (including, for personas that
check it, staying on the question's topic); the guard's pass rate and the
checker's raw rate are reported next to it.

Reproducibility: everything random (question order, reply phrasings, per-request sampling seeds, session
ids) comes from ``random.Random`` instances seeded from ``seed``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from clawloop.sim.personas import Persona, Verdict
from clawloop.sim.user import RuleBasedUser, SimulatedUser


class ServerError(RuntimeError):
    """The server answered a request with an error."""


class ChatClient:
    """The few HTTP calls the simulation makes. ``base_url`` is the server root, with or without ``/v1``."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str = "default",
        timeout_s: float = 600.0,
        client: httpx.Client | None = None,
    ) -> None:
        root = base_url.rstrip("/")
        self.root = root[: -len("/v1")] if root.endswith("/v1") else root
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = client or httpx.Client(timeout=timeout_s)

    def chat(
        self,
        messages: list[dict[str, Any]],
        *,
        session_id: str,
        turn_type: str,
        done: bool = False,
        **params: Any,
    ) -> dict[str, Any]:
        """One non-streamed chat completion; returns the response JSON."""
        headers = {**self.headers, "X-Session-Id": session_id, "X-Turn-Type": turn_type}
        if done:
            headers["X-Session-Done"] = "true"
        body = {"model": self.model, "messages": messages, **{k: v for k, v in params.items() if v is not None}}
        resp = self.http.post(f"{self.root}/v1/chat/completions", json=body, headers=headers)
        if resp.status_code != 200:
            raise ServerError(f"chat request failed with HTTP {resp.status_code}: {resp.text[:500]}")
        return resp.json()

    def end_session(self, session_id: str) -> None:
        resp = self.http.post(f"{self.root}/v1/sessions/{session_id}/end", headers=self.headers)
        if resp.status_code not in (200, 204):
            raise ServerError(f"ending session {session_id} failed with HTTP {resp.status_code}: {resp.text[:500]}")

    def close(self) -> None:
        self.http.close()


def _content(response: dict[str, Any]) -> str:
    try:
        return response["choices"][0]["message"].get("content") or ""
    except (KeyError, IndexError, TypeError) as exc:
        raise ServerError(f"malformed chat response: {str(response)[:300]}") from exc


@dataclass
class SimTurn:
    """One trainable answer in a simulated session and the user's reaction to it."""

    session_id: str
    index: int
    """Position of the answer in its session (0-based)."""
    question: str
    """The question the answer is about (repeated after a correction)."""
    answer: str
    reply: str
    reply_kind: str
    reply_source: str
    satisfied: bool
    sound: bool
    guard_reasons: tuple[str, ...]
    turn_id: Any = None
    """The server's id for the stored turn, when it reports one."""
    policy_version: Any = None
    """The policy version that wrote the answer, when the server reports it."""
    latency_s: float = 0.0


@dataclass
class SimSession:
    session_id: str
    persona: str
    turns: list[SimTurn] = field(default_factory=list)
    end_mode: str = "header"


class Simulation:
    """Runs a persona's training sessions against a server."""

    def __init__(
        self,
        base_url: str,
        persona: Persona,
        *,
        seed: int = 0,
        user: SimulatedUser | None = None,
        api_key: str | None = None,
        model: str = "default",
        max_tokens: int = 64,
        temperature: float | None = None,
        end_mode: str = "header",
        timeout_s: float = 600.0,
        on_turn: Callable[[SimTurn], None] | None = None,
        session_prefix: str | None = None,
        client: ChatClient | None = None,
    ) -> None:
        if end_mode not in ("header", "endpoint"):
            raise ValueError(f"end_mode must be 'header' or 'endpoint', got {end_mode!r}")
        self.persona = persona
        self.seed = seed
        self.client = client or ChatClient(base_url, api_key=api_key, model=model, timeout_s=timeout_s)
        # Separate streams so that, e.g., switching to an LLM user does not change the question order.
        self.user = user or RuleBasedUser(persona, seed=seed)
        self._order_rng = random.Random(f"{seed}:questions:{persona.name}")
        self._sampling_rng = random.Random(f"{seed}:sampling:{persona.name}")
        self._questions: list[str] = []
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.end_mode = end_mode
        self.on_turn = on_turn
        self.sessions_started = 0
        # Session ids are deterministic; give a prefix of your own to run the same seed twice on one server.
        self.session_prefix = session_prefix or f"sim-{persona.name}-s{seed}"

    def _peek_question(self) -> str:
        if not self._questions:  # a new shuffled pass over the pool
            order = list(self.persona.train_questions)
            self._order_rng.shuffle(order)
            self._questions = order
        return self._questions[0]

    def _take_question(self) -> str:
        question = self._peek_question()
        self._questions.pop(0)
        return question

    def _session_id(self) -> str:
        return f"{self.session_prefix}-{self.sessions_started:04d}"

    def run_session(self, turns: int | None = None) -> SimSession:
        """One session of ``turns`` answers (default: the persona's session length)."""
        turns = self.persona.session_turns if turns is None else turns
        if turns < 1:
            raise ValueError("a session needs at least one turn")
        session_id = self._session_id()
        self.sessions_started += 1
        record = SimSession(session_id, self.persona.name, end_mode=self.end_mode)
        question = self._take_question()
        messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
        for index in range(turns):
            t0 = time.monotonic()
            response = self.client.chat(
                messages,
                session_id=session_id,
                turn_type="main",
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                seed=self._sampling_rng.randrange(2**31),
            )
            latency_s = time.monotonic() - t0
            answer = _content(response)
            last = index == turns - 1
            next_question = None if last else self._peek_question()
            reply = self.user.reply(messages, answer, next_question, question)
            if reply.kind == "thanks":  # the user moved on: that question is used up
                self._take_question()
            meta = response.get("clawloop") or {}
            turn = SimTurn(
                session_id=session_id,
                index=index,
                question=question,
                answer=answer,
                reply=reply.text,
                reply_kind=reply.kind,
                reply_source=reply.source,
                satisfied=reply.verdict.satisfied,
                sound=reply.verdict.sound,
                guard_reasons=reply.verdict.guard_reasons,
                turn_id=meta.get("turn_id"),
                policy_version=meta.get("policy_version"),
                latency_s=latency_s,
            )
            record.turns.append(turn)
            if self.on_turn is not None:
                self.on_turn(turn)
            if reply.kind == "thanks" and next_question is not None:
                question = next_question
            messages = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": reply.text}]
        if self.end_mode == "header":
            # Delivers the last reply as the next state of the last answer, then ends the session.
            self.client.chat(messages, session_id=session_id, turn_type="main", done=True, max_tokens=1,
                             temperature=self.temperature, seed=self._sampling_rng.randrange(2**31))
        else:
            self.client.end_session(session_id)
        return record

    def run(self, interactions: int) -> list[SimSession]:
        """Sessions until ``interactions`` answers have been given (the last session may be shorter)."""
        sessions: list[SimSession] = []
        remaining = interactions
        while remaining > 0:
            turns = min(self.persona.session_turns, remaining)
            sessions.append(self.run_session(turns))
            remaining -= turns
        return sessions


@dataclass
class EvalItem:
    question: str
    answer: str
    satisfied: bool
    sound: bool
    guard_reasons: tuple[str, ...]
    finish_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.satisfied and self.sound


@dataclass
class EvalResult:
    persona: str
    items: list[EvalItem]
    instructed: bool = False

    @property
    def n(self) -> int:
        return len(self.items)

    @property
    def score(self) -> float:
        """The preference score: share of answers that follow the preference and pass the guard."""
        return sum(i.ok for i in self.items) / self.n if self.items else 0.0

    @property
    def satisfied_rate(self) -> float:
        """Share that the checker accepts, degenerate or not."""
        return sum(i.satisfied for i in self.items) / self.n if self.items else 0.0

    @property
    def guard_pass_rate(self) -> float:
        return sum(i.sound for i in self.items) / self.n if self.items else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "persona": self.persona,
            "n": self.n,
            "instructed": self.instructed,
            "score": self.score,
            "satisfied_rate": self.satisfied_rate,
            "guard_pass_rate": self.guard_pass_rate,
        }

    def to_dict(self) -> dict[str, Any]:
        return {**self.summary(), "items": [asdict(i) for i in self.items]}


def evaluate(
    base_url: str,
    persona: Persona,
    questions: Sequence[str] | None = None,
    *,
    max_tokens: int = 64,
    instruct: bool = False,
    api_key: str | None = None,
    model: str = "default",
    timeout_s: float = 600.0,
    seed: int = 0,
    concurrency: int = 1,
    client: ChatClient | None = None,
) -> EvalResult:
    """Greedy answers to ``questions`` (default: the persona's held-out pool), scored by its checker and guard.

    ``instruct=True`` appends the preference to each question the way a hint is injected, which measures
    what the model can do when told (the ceiling the hint-conditioned teacher works from). ``concurrency``
    requests in flight at once let the server batch them; answers are greedy, so the result is the same.
    """
    questions = list(persona.heldout_questions if questions is None else questions)
    chat = client or ChatClient(base_url, api_key=api_key, model=model, timeout_s=timeout_s)
    tag = random.Random(f"{seed}:eval:{persona.name}").getrandbits(32)

    def ask(i: int) -> EvalItem:
        question = questions[i]
        content = persona.instruct(question) if instruct else question
        response = chat.chat(
            [{"role": "user", "content": content}],
            session_id=f"eval-{persona.name}-{tag:08x}-{i:03d}",
            turn_type="side",
            done=True,
            temperature=0.0,
            max_tokens=max_tokens,
            seed=seed,
        )
        answer = _content(response)
        verdict: Verdict = persona.judge(answer, question)
        finish = (response.get("choices") or [{}])[0].get("finish_reason")
        return EvalItem(question, answer, verdict.satisfied, verdict.sound, verdict.guard_reasons, finish)

    try:
        if concurrency <= 1:
            items = [ask(i) for i in range(len(questions))]
        else:
            with ThreadPoolExecutor(max_workers=concurrency) as pool:
                items = list(pool.map(ask, range(len(questions))))
    finally:
        if client is None:
            chat.close()
    return EvalResult(persona.name, items, instructed=instruct)
