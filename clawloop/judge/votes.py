"""One turn's judgement: m evaluative votes and m hint votes, all in flight at once, each recorded.

``Judge.judge(turn)`` builds both prompts once, issues the 2m calls concurrently (the client bounds how many run
at the same time; the embedded engine batches them), parses each answer as it arrives and hands every vote to
``on_vote`` immediately, so the store holds the raw judge texts even if the process dies before the turn is done.
A vote whose call timed out is tried again (up to ``timeout_retries`` times) while the turn's deadline leaves at
least ``min_retry_s``; the deadline then cancels the calls still running, which count as invalid votes with the
reason recorded. The judge reads the turn without client envelopes (``envelopes.judged_turn``).
The result is the majority evaluative vote (0 when none is valid or votes tie) and the hint candidates.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from clawloop.config import Config
from clawloop.judge.client import Completion, JudgeClient
from clawloop.judge.envelopes import judged_turn
from clawloop.judge.parse import majority, parse_eval, parse_hint, select_candidates
from clawloop.judge.prompts import answer_text, build_messages
from clawloop.store import TurnRecord, VoteRecord


@dataclass
class Judgement:
    eval_votes: list[VoteRecord] = field(default_factory=list)
    hint_votes: list[VoteRecord] = field(default_factory=list)
    reward: int = 0
    """Majority of the evaluative votes (0 when they were not asked for)."""
    candidates: list[str] = field(default_factory=list)
    latency_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        def scores(votes: list[VoteRecord]) -> list[int | None]:
            return [v.score for v in sorted(votes, key=lambda v: v.index)]

        return {
            "eval_scores": scores(self.eval_votes),
            "hint_scores": scores(self.hint_votes),
            "invalid_votes": sum(v.score is None for v in self.eval_votes + self.hint_votes),
            "judge_latency_s": round(self.latency_s, 3),
        }


@dataclass
class JudgeSettings:
    votes_m: int = 3
    temperature: float = 0.6
    max_tokens: int = 384
    judge_context: str = "last_user"
    hint_min_chars: int = 10
    max_candidates: int = 3
    max_section_chars: int = 3000
    timeout_retries: int = 2
    """Further tries of a vote whose call timed out (only while the turn's deadline leaves time)."""
    min_retry_s: float = 5.0
    """A timed-out vote is tried again only when at least this much of the turn's deadline remains."""

    @classmethod
    def from_config(cls, config: Config) -> "JudgeSettings":
        return cls(votes_m=config.prm_m, temperature=config.judge_temperature, max_tokens=config.judge_max_tokens,
                   judge_context=config.judge_context, hint_min_chars=config.hint_min_chars,
                   max_candidates=config.max_candidates, timeout_retries=config.judge_retries)


class Judge:
    def __init__(self, client: JudgeClient, settings: JudgeSettings | None = None):
        self.client = client
        self.settings = settings or JudgeSettings()

    def messages_for(self, kind: str, turn: TurnRecord) -> list[dict[str, str]]:
        s = self.settings
        turn = judged_turn(turn)
        return build_messages(
            kind, request_messages=turn.messages, answer=answer_text(turn.assistant_message, turn.response_text),
            next_state=turn.next_state or [], judge_context=s.judge_context, max_context_chars=s.max_section_chars,
            max_answer_chars=s.max_section_chars, max_next_state_chars=s.max_section_chars)

    async def _call(self, messages: list[dict[str, str]]) -> Completion:
        try:
            return await self.client.complete(messages, temperature=self.settings.temperature,
                                              max_tokens=self.settings.max_tokens)
        except Exception as exc:  # noqa: BLE001 - clients should not raise; if one does, the vote is invalid
            return Completion(text="", error=f"{type(exc).__name__}: {exc}")

    async def _vote(self, kind: str, messages: list[dict[str, str]], turn_id: int, index: int,
                    attempt: int, deadline_at: float | None = None) -> VoteRecord:
        start = time.monotonic()
        reply = await self._call(messages)
        tries = max(1, reply.attempts)  # a client that retries by itself (HTTP) has used its tries already
        while (reply.error and "timed out" in reply.error and tries <= self.settings.timeout_retries
               and (deadline_at is None or deadline_at - time.monotonic() >= self.settings.min_retry_s)):
            reply = await self._call(messages)
            tries += max(1, reply.attempts)
        if tries > max(1, reply.attempts):
            reply.latency_s = time.monotonic() - start
            if reply.error:
                reply.error = f"{reply.error} ({tries} tries in all)"
        parsed = parse_eval(reply.text) if kind == "eval" else parse_hint(reply.text)
        error = reply.error or parsed.error
        return VoteRecord(turn_id=turn_id, kind=kind, index=index, score=None if reply.error else parsed.score,
                          raw_text=reply.text, hint=parsed.hint if kind == "hint" else "", error=error,
                          latency_s=reply.latency_s, attempt=attempt)

    async def judge(self, turn: TurnRecord, *, want_eval: bool = True, want_hints: bool = True, attempt: int = 0,
                    deadline_s: float | None = None,
                    on_vote: Callable[[VoteRecord], None] | None = None) -> Judgement:
        """Run the votes asked for; never raises for judge failures (they become invalid votes)."""
        start = time.monotonic()
        deadline_at = None if deadline_s is None else start + deadline_s
        turn_id = int(turn.id or 0)
        jobs: dict[asyncio.Task, tuple[str, int]] = {}
        for kind, wanted in (("eval", want_eval), ("hint", want_hints)):
            if not wanted:
                continue
            messages = self.messages_for(kind, turn)
            for index in range(self.settings.votes_m):
                task = asyncio.create_task(self._vote(kind, messages, turn_id, index, attempt, deadline_at))
                jobs[task] = (kind, index)
        out = Judgement()
        pending = set(jobs)
        try:
            while pending:
                timeout = None if deadline_s is None else max(0.0, deadline_s - (time.monotonic() - start))
                done, pending = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if not done:  # deadline passed with calls still running
                    break
                for task in done:
                    vote = task.result()
                    (out.eval_votes if vote.kind == "eval" else out.hint_votes).append(vote)
                    if on_vote is not None:
                        on_vote(vote)
        finally:
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        for task in pending:
            kind, index = jobs[task]
            vote = VoteRecord(turn_id=turn_id, kind=kind, index=index, score=None,
                              error=f"turn deadline of {deadline_s:g}s exceeded",
                              latency_s=time.monotonic() - start, attempt=attempt)
            (out.eval_votes if kind == "eval" else out.hint_votes).append(vote)
            if on_vote is not None:
                on_vote(vote)
        out.eval_votes.sort(key=lambda v: v.index)
        out.hint_votes.sort(key=lambda v: v.index)
        out.reward = majority(v.score for v in out.eval_votes) if want_eval else 0
        out.candidates = select_candidates([(v.score, v.hint) for v in out.hint_votes],
                                           min_chars=self.settings.hint_min_chars,
                                           max_candidates=self.settings.max_candidates)
        out.latency_s = time.monotonic() - start
        return out
