"""From judgeable turn to durable training sample (docs/method.md, section 1, steps 4-6), off the request path.

``Pipeline`` is one asyncio component. It claims judgeable turns from the store (compare-and-set to ``judging``,
so no turn is taken twice), runs at most ``concurrency`` of them at a time, and for each:

1. runs the judge: m evaluative votes (unless the method trains no RL branch) and m hint votes (unless it trains
   no OPD branch), all concurrently, each vote written to the store as soon as it is parsed, tagged with the
   turn's attempt number (one more than any earlier, interrupted attempt);
2. assembles the sample: hint(s) and a ±1 vote -> ``rl+opd``; hint(s) and vote 0 -> ``opd``; no hint and ±1 ->
   ``rl``; neither -> dropped with reason ``no_signal`` (``judge_failed`` when not one vote was valid);
3. with ``context_samples > 0`` and accepted hints: asks the teacher for that many answers of its own to the
   hint-augmented request (``context_answers``; docs/context-distillation.md);
4. writes the sample (votes and hints) and its context samples with ``store.put_sample``, which moves the turn
   to ``ready`` in the same transaction and refuses a second sample for the same turn.

The teacher does not score anything here: the trainer asks it at training time, at the old policy's exact top-k
ids (``clawloop.trainer.old_policy``), so a sample is ready as soon as it is judged. Context answers are the one
model call besides the judge's; they are sampled before the write, so a crash before it leaves nothing (the turn
is judged again and its answers sampled again) and a crash after it leaves the turn with all of them.

Every store call runs in a worker thread (``asyncio.to_thread``): the store's lock may be held by a trainer
transaction, and chat requests on this event loop must not wait for it.

Robustness: the pipeline wakes on ``notify()`` and also polls, so a missed notification delays a turn by at most
``poll_interval_s``; ``start()`` first calls ``store.recover()`` so turns a crash left in ``judging`` are judged
again; each turn has a deadline (votes still running at the deadline count as invalid); a turn that has already
been attempted ``max_attempts`` times (counted from its recorded votes: a turn that keeps killing the process) is
dropped; any unexpected error is recorded as a drop reason rather than leaving the turn stuck. ``stop()`` returns
in-flight turns to ``judgeable``.

Drop reasons written here: ``no_signal``, ``judge_failed``, ``no_next_state``, ``empty_response``,
``too_many_attempts``, ``pipeline_error``. A written sample's turn carries its kind as reason.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from clawloop.engines.base import Generation, SamplingParams
from clawloop.gate.guard import check as guard_check, question_of
from clawloop.judge.describe import startup_message
from clawloop.judge.factory import configured_turn_deadline_s
from clawloop.judge.votes import Judge, Judgement
from clawloop.store import CONTEXT_KIND, ContextSample, SampleRecord, Store, TurnRecord, TurnState, VoteRecord
from clawloop.teacher import Teacher
from clawloop.temperature import effective_temperature

log = logging.getLogger(__name__)

CONTEXT_REWARD = {"sft": 1.0, "objective": 0.0}
"""A context sample's vote per ``context_loss``: sft treats the teacher's answer as a good one (A = +1 in the
GRPO surrogate, whose gradient at ρ = 1 is the SFT gradient); objective leaves the GRPO branch out (nobody
voted on the answer) and trains the OPD branch toward the hinted teacher."""


def sample_kind(reward: int, has_hints: bool) -> str | None:
    """The sample rule of docs/method.md, section 2; None means no training signal."""
    if has_hints:
        return "rl+opd" if reward != 0 else "opd"
    return "rl" if reward != 0 else None


def context_params(config: Any, turn: TurnRecord, index: int) -> SamplingParams:
    """How context answer ``index`` of ``turn`` is sampled: the served turn's temperature and top-p, at most
    ``context_max_tokens`` (else ``default_max_tokens``) and never more than the trainer takes, and a seed of
    its own per (run seed, turn, index), so a retry after a crash samples the same answer."""
    limit = int(config.context_max_tokens) or int(config.default_max_tokens)
    seed = (int(config.seed) * 1_000_003 + int(turn.id or 0) * 1_009 + index) % (2 ** 31)
    return SamplingParams(temperature=effective_temperature(float(turn.temperature)), top_p=float(turn.top_p),
                          max_tokens=max(1, min(limit, int(config.max_response_tokens))), seed=seed)


def context_sample(config: Any, turn: TurnRecord, hints: list[str], index: int, hint_index: int,
                   answer: Generation) -> ContextSample:
    """Context answer ``index`` (sampled under ``hints[hint_index]``) as a turn and sample of its own: the judged
    turn's request and un-hinted prompt ids, the teacher's ids and sampling log-probs as the response."""
    mode = str(config.context_loss)
    text = answer.text
    context_turn = TurnRecord(
        session_id=turn.session_id, owner=turn.owner, turn_index=turn.turn_index, messages=turn.messages,
        tools=turn.tools, prompt_ids=list(turn.prompt_ids), response_ids=list(answer.token_ids),
        logprobs=list(answer.logprobs), temperature=turn.temperature, top_p=turn.top_p,
        policy_version=turn.policy_version, response_text=text,
        assistant_message={"role": "assistant", "content": text}, finish_reason=answer.finish_reason)
    info = {"context_loss": mode, "hint_index": hint_index, "hint": hints[hint_index],
            "teacher_version": int(answer.policy_version),
            "kind_reason": f"the teacher's answer under hint {hint_index}, trained without it ({mode})"}
    sample = SampleRecord(turn_id=0, reward=CONTEXT_REWARD[mode], kind=CONTEXT_KIND,
                          hints=list(hints) if mode == "objective" else [], info=info)
    return ContextSample(index=index, turn=context_turn, sample=sample)


class Pipeline:
    def __init__(self, store: Store, config: Any, *, judge: Judge,
                 concurrency: int = 2, poll_interval_s: float = 2.0, turn_deadline_s: float | None = None,
                 max_attempts: int = 3, on_sample: Callable[[SampleRecord], None] | None = None,
                 teacher: Teacher | None = None):
        """``teacher``: what samples context answers (``context_samples > 0``); without one none are made."""
        self.store = store
        self.config = config
        self.judge = judge
        self.teacher = teacher
        self.context_samples = int(config.context_samples)
        if self.context_samples > 0 and teacher is None:
            log.warning("clawloop pipeline: context_samples=%d but no teacher is at hand; no context samples "
                        "are made", self.context_samples)
        self.concurrency = max(1, int(concurrency))
        self.poll_interval_s = float(poll_interval_s)
        self.turn_deadline_s = float(turn_deadline_s) if turn_deadline_s else configured_turn_deadline_s(config)
        self.max_attempts = int(max_attempts)
        self.on_sample = on_sample
        self.want_eval = bool(config.needs_eval_votes)
        self.want_hints = bool(config.needs_hints)
        self.stats: Counter[str] = Counter()
        self._inflight: dict[int, asyncio.Task] = {}
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._runner: asyncio.Task | None = None
        self._stopping = False
        self.owned_engines: list[Any] = []
        """Engines this pipeline created (``build_pipeline``) and closes on ``stop()``."""

    # ---- lifecycle --------------------------------------------------------------------------------------
    async def start(self) -> dict[str, int]:
        """Recover interrupted work, then start claiming turns. Returns what recovery moved."""
        if self._runner is not None:
            raise RuntimeError("pipeline already started")
        log.warning("%s", startup_message(self.config))
        recovered = await asyncio.to_thread(self.store.recover)
        if any(recovered.values()):
            log.warning("clawloop pipeline: recovered %s", recovered)
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._wake = asyncio.Event()
        self._stopping = False
        self._runner = asyncio.create_task(self._run(), name="clawloop-pipeline")
        return recovered

    async def stop(self) -> None:
        """Stop claiming, cancel turns in flight and hand them back to ``judgeable``."""
        self._stopping = True
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)
            self._runner = None
        tasks = dict(self._inflight)
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        for turn_id in tasks:
            await asyncio.to_thread(self.store.transition, turn_id, [TurnState.JUDGING], TurnState.JUDGEABLE)
        self._inflight.clear()
        await self.judge.client.close()
        for engine in self.owned_engines:
            await engine.close()
        self.owned_engines.clear()

    def notify(self, turn_id: int | None = None) -> None:
        """A turn became judgeable (``turn_id`` is informational; the store says which turns wait). Safe to call
        from any thread, before or after ``start()``; fits ``Server(on_judgeable=pipeline.notify)``."""
        if self._wake is None or self._loop is None:
            return
        if threading.get_ident() == self._loop_thread:
            self._wake.set()
        else:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:  # the loop has closed: the pipeline is gone, polling at restart covers it
                pass

    @property
    def busy(self) -> int:
        return len(self._inflight)

    async def drain(self, timeout_s: float | None = None, settle_s: float = 0.0) -> bool:
        """Wait until no turn is judgeable or being judged by this pipeline. True if drained in time."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            counts = await asyncio.to_thread(self.store.count_turns)
            if not self._inflight and counts.get(TurnState.JUDGEABLE, 0) == 0:
                if settle_s <= 0:
                    return True
                await asyncio.sleep(settle_s)
                settle_s = 0.0
                continue
            if deadline is not None and time.monotonic() > deadline:
                return False
            self.notify()
            await asyncio.sleep(0.05)

    # ---- claiming ---------------------------------------------------------------------------------------
    async def _run(self) -> None:
        assert self._wake is not None
        while not self._stopping:
            self._wake.clear()
            free = self.concurrency - len(self._inflight)
            if free > 0:
                try:
                    turns = await asyncio.to_thread(self.store.claim_judgeable, limit=free)
                except sqlite3.ProgrammingError:  # the store was closed under us: the server is going away
                    log.warning("clawloop pipeline: the store is closed; stopping")
                    return
                except Exception:  # noqa: BLE001 - a store hiccup must not end the loop; polling retries it
                    log.exception("clawloop pipeline: claiming turns failed")
                    turns = []
                for turn in turns:
                    task = asyncio.create_task(self._guarded(turn), name=f"clawloop-turn-{turn.id}")
                    self._inflight[int(turn.id)] = task
                    task.add_done_callback(lambda _t, tid=int(turn.id): self._done(tid))
            # A finished turn wakes us (its done callback), so more waiting turns are claimed at once.
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_interval_s)
            except asyncio.TimeoutError:
                pass

    def _done(self, turn_id: int) -> None:
        self._inflight.pop(turn_id, None)
        if self._wake is not None:
            self._wake.set()

    async def _guarded(self, turn: TurnRecord) -> None:
        try:
            await self.process(turn)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - never leave a turn stuck in judging
            log.exception("clawloop pipeline: turn %s failed", turn.id)
            await self._drop(turn, "pipeline_error", {"error": f"{type(exc).__name__}: {exc}"})

    # ---- one turn ---------------------------------------------------------------------------------------
    async def _drop(self, turn: TurnRecord, reason: str, detail: dict[str, Any] | None = None) -> None:
        if await asyncio.to_thread(self.store.drop_turn, int(turn.id), reason, from_states=[TurnState.JUDGING]):
            self.stats[f"dropped:{reason}"] += 1
            if detail:
                log.info("clawloop pipeline: turn %s dropped (%s): %s", turn.id, reason, detail)

    async def _attempt(self, turn: TurnRecord) -> int:
        earlier = await asyncio.to_thread(self.store.votes, int(turn.id))
        return 1 + max(v.attempt for v in earlier) if earlier else 0

    @staticmethod
    async def _written(writes: list[asyncio.Task]) -> None:
        """Wait for the vote writes of a turn; a failed one is logged (the vote is in the sample's info)."""
        for result in await asyncio.gather(*writes, return_exceptions=True):
            if isinstance(result, BaseException):
                log.error("clawloop pipeline: recording a vote failed: %s: %s", type(result).__name__, result)

    async def process(self, turn: TurnRecord) -> SampleRecord | None:
        """Judge one claimed (``judging``) turn and write its sample or its drop reason."""
        start = time.monotonic()
        if not turn.next_state:
            await self._drop(turn, "no_next_state")
            return None
        if not turn.response_ids:
            await self._drop(turn, "empty_response")
            return None
        attempt = await self._attempt(turn)
        if attempt >= self.max_attempts:
            await self._drop(turn, "too_many_attempts", {"attempts": attempt})
            return None

        writes: list[asyncio.Task] = []

        def record(vote: VoteRecord) -> None:
            # Called by the judge on this loop as each vote is parsed: the write goes to a worker thread.
            writes.append(asyncio.create_task(asyncio.to_thread(self.store.add_votes, [vote])))

        try:
            judgement: Judgement = await self.judge.judge(
                turn, want_eval=self.want_eval, want_hints=self.want_hints, attempt=attempt,
                deadline_s=self.turn_deadline_s, on_vote=record)
        finally:
            await self._written(writes)
        info: dict[str, Any] = {"attempt": attempt, **judgement.summary(), "candidates": judgement.candidates}
        reward, hints = judgement.reward, list(judgement.candidates)
        kind = sample_kind(reward, bool(hints))
        if kind is None:
            votes = judgement.eval_votes + judgement.hint_votes
            await self._drop(turn, "judge_failed" if votes and all(v.score is None for v in votes) else "no_signal")
            return None
        info["kind_reason"] = {
            "rl+opd": "hint(s) and a ±1 evaluative vote",
            "opd": "hint(s) and an evaluative vote of 0" if self.want_eval else "hint(s); evaluative votes off",
            "rl": "±1 evaluative vote and no accepted hint",
        }[kind]
        context = await self.context_answers(turn, hints, info)
        info["pipeline_s"] = round(time.monotonic() - start, 3)
        sample = SampleRecord(turn_id=int(turn.id), reward=float(reward), kind=kind, hints=hints, info=info)
        if not await asyncio.to_thread(self.store.put_sample, sample, context):
            # The turn left `judging` under us (dropped by session code, or already has a sample): nothing to do.
            self.stats["put_sample_refused"] += 1
            return None
        self.stats[f"sample:{kind}"] += 1
        stored = sum(1 for c in context if c.turn.id is not None)
        if stored:
            self.stats[f"sample:{CONTEXT_KIND}"] += stored
        if self.on_sample is not None:
            try:
                self.on_sample(sample)
            except Exception:  # noqa: BLE001 - a listener must not undo a written sample
                log.exception("clawloop pipeline: on_sample listener failed")
        return sample

    async def context_answers(self, turn: TurnRecord, hints: list[str], info: dict[str, Any]) -> list[ContextSample]:
        """The teacher's own answers to ``turn`` under its accepted ``hints`` (answer i under hint i mod C, all
        sampled at once), as context samples to store with the turn's sample. An answer identical to an earlier
        one (a greedy turn) is left out, and with ``context_guard`` one the degeneracy guard flags (asked with the
        turn's wh-question, ``question_of``); failures and what was left out are noted in ``info``, never raised:
        a turn's own sample does not depend on its context answers."""
        if self.context_samples <= 0 or not hints or self.teacher is None:
            return []
        teacher = self.teacher
        plan = [(i, i % len(hints)) for i in range(self.context_samples)]
        target = str(self.config.opd_target)
        draft = True if self.config.context_draft else None
        calls = [teacher.answer(turn, hints[h], context_params(self.config, turn, i), target, draft=draft)
                 for i, h in plan]
        try:
            answers = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), self.turn_deadline_s)
        except asyncio.TimeoutError:
            info["context_error"] = f"the teacher took longer than {self.turn_deadline_s:g}s"
            self.stats["context_timeout"] += 1
            return []
        out: list[ContextSample] = []
        seen: set[tuple[int, ...]] = set()
        errors: list[str] = []
        unsound: list[str] = []
        question = question_of(turn.messages) if self.config.context_guard else None
        for (index, hint_index), answer in zip(plan, answers):
            if isinstance(answer, BaseException):
                errors.append(f"{index}: {type(answer).__name__}: {answer}"[:200])
                continue
            ids = tuple(answer.token_ids)
            if not ids or ids in seen:
                info["context_repeats"] = int(info.get("context_repeats", 0)) + 1
                continue
            seen.add(ids)
            if self.config.context_guard:
                flagged = guard_check(answer.text, question=question).reasons
                if flagged:
                    unsound.append(f"{index}: {', '.join(flagged)}")
                    continue
            out.append(context_sample(self.config, turn, hints, index, hint_index, answer))
        if errors:
            info["context_error"] = errors
            self.stats["context_error"] += len(errors)
        if unsound:  # trained as a +1 answer, a loop or an echo would teach exactly what the gate rejects
            info["context_unsound"] = unsound
            self.stats["context_unsound"] += len(unsound)
        info["context_answers"] = len(out)
        return out
