"""Hint injection and the teacher's scores per hint candidate (docs/method.md, section 3).

Hint injection: the turn's request messages are copied, the **last user message** gets
``"\\n\\n[user's hint / instruction]\\n" + hint`` appended to its text (when there is no user message, one user
message holding ``"[user's hint / instruction]\\n" + hint`` is added at the end), the result is rendered with the same
renderer and tools the API used when serving, and the turn's **stored response ids** are appended — the response
is never re-tokenised from text. ``render_matches`` says whether rendering the un-hinted messages today reproduces
the stored prompt ids (it does not when the serving template changed since the turn was recorded).
Tool-call loops keep their later tool messages untouched: the hint goes where the user spoke last.

Scores: ``Teacher.score`` answers a trainer's ``TeacherRequest``s (``clawloop.wire``): per sample, the turn,
its hint candidates and the ids the trainer needs the teacher's log-probs at (the old policy's top-k, computed
by the trainer's old-policy pass). It returns one ``TeacherScores`` per request, all from one ``engine.score``
call covering every candidate of every request (the engine returns the teacher's own top-k and the log-probs at
the asked ids from one forward per candidate), all at the temperature the request names (the train-side
``train_temperature(config, turn)`` that the trainer also uses for the student).

The teacher is scored at training time only, by the trainer (``clawloop.trainer.teacher_client``), so the ids
are always the old policy's exact top-k. The judging pipeline asks it for one thing only, and only with
``context_samples > 0``: ``Teacher.answer``, the teacher's own sampled answer to the hint-augmented request (the
very prompt it is scored under), which becomes a context sample (docs/context-distillation.md).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from clawloop.engines.base import Engine, Generation, SamplingParams, ScoreRequest
from clawloop.temperature import effective_temperature
from clawloop.judge.prompts import content_text
from clawloop.store import TurnRecord
from clawloop.wire import TeacherRequest, TeacherScores

HINT_PREFIX = "[user's hint / instruction]\n"
HINT_SEPARATOR = "\n\n"

RenderFn = Callable[[Sequence[dict[str, Any]], list[dict[str, Any]] | None], list[int]]
"""(messages, tools) -> prompt ids, with the generation prompt, exactly as serving renders them."""


class TrainTemperatureSetting(Protocol):
    train_temperature: float
    """0 = each turn's own sampling temperature (``Config.train_temperature``)."""


def train_temperature(config: TrainTemperatureSetting, turn: TurnRecord | float) -> float:
    """The temperature of every train-side log-prob (student, old policy, teacher, reference) for a turn.

    ``config.train_temperature`` when it is positive; otherwise the turn's own sampling temperature, with greedy
    turns (temperature 0, or below ``GREEDY_BELOW`` in a store written before that rule) scored at 1.0.
    """
    fixed = float(config.train_temperature)
    if fixed > 0:
        return fixed
    sampled = effective_temperature(float(turn if isinstance(turn, (int, float)) else turn.temperature))
    return sampled if sampled > 0 else 1.0


def inject_hint(messages: Sequence[dict[str, Any]], hint: str) -> list[dict[str, Any]]:
    """A copy of ``messages`` with ``hint`` appended to the last user message (or a new user message)."""
    out = copy.deepcopy(list(messages))
    for message in reversed(out):
        if message.get("role") == "user":
            message["content"] = content_text(message.get("content")) + HINT_SEPARATOR + HINT_PREFIX + hint
            return out
    out.append({"role": "user", "content": HINT_PREFIX + hint})
    return out


class Teacher:
    """Scores a turn's stored response under hint-augmented prompts with a (normally frozen) engine."""

    def __init__(self, engine: Engine, render: RenderFn, config: Any):
        self.engine = engine
        self.render = render
        self.config = config
        self.topk = int(config.topk)

    # ---- prompts ----------------------------------------------------------------------------------------
    def prompt_ids(self, turn: TurnRecord, hint: str | None) -> list[int]:
        """The teacher prompt for one candidate; ``None``/'' means the un-hinted stored prompt ids."""
        if not hint:
            return list(turn.prompt_ids)
        return list(self.render(inject_hint(turn.messages, hint), turn.tools))

    def render_matches(self, turn: TurnRecord) -> bool:
        """Whether rendering the stored request today reproduces the prompt ids served then."""
        return list(self.render(turn.messages, turn.tools)) == list(turn.prompt_ids)

    # ---- answering ----------------------------------------------------------------------------------------
    async def answer(self, turn: TurnRecord, hint: str, params: SamplingParams) -> Generation:
        """The teacher's own answer to ``turn``'s request with ``hint`` injected, rendered exactly as for
        scoring. Rendering runs in a worker thread and the engine call is awaited: this coroutine runs on the
        serving event loop."""
        prompt_ids = await asyncio.to_thread(self.prompt_ids, turn, hint)
        return await self.engine.generate(prompt_ids, params)

    # ---- scoring ------------------------------------------------------------------------------------------
    async def score(self, requests: Sequence[TeacherRequest]) -> list[TeacherScores]:
        """The teacher's scores for each request (see the module docstring), from one engine call. Rendering the
        hinted prompts runs in a worker thread: this coroutine runs on the serving event loop."""
        prompts, spans = await asyncio.to_thread(self._score_requests, requests)
        results = await self.engine.score(prompts) if prompts else []
        out = []
        for request, (first, count, candidates) in zip(requests, spans):
            mine = results[first:first + count]
            out.append(TeacherScores(
                student_ids_T_K=request.student_ids_T_K.to(torch.int64).cpu().contiguous(),
                teacher_ids_C_T_K=torch.stack([r.topk_ids_T_K.to(torch.int64).cpu() for r in mine]),
                teacher_logprobs_C_T_K=torch.stack([r.topk_logprobs_T_K.float().cpu() for r in mine]),
                teacher_at_student_C_T_K=torch.stack([_at_ids(r).float().cpu() for r in mine]),
                hint_lens_C=torch.tensor([len(h) for h in candidates], dtype=torch.int64),
                teacher_token_logprobs_C_T=torch.stack([r.logprobs_T.float().cpu() for r in mine]),
                teacher_version=int(mine[0].policy_version)))
        return out

    def _score_requests(self, requests: Sequence[TeacherRequest]
                        ) -> tuple[list[ScoreRequest], list[tuple[int, int, list[str]]]]:
        """The engine's score requests for every candidate of every request, and each request's span of them."""
        prompts: list[ScoreRequest] = []
        spans: list[tuple[int, int, list[str]]] = []
        for request in requests:
            turn = request.turn
            if not turn.response_ids:
                raise ValueError("the turn has no response tokens")
            at_ids_T_K = request.student_ids_T_K.to(torch.int64).cpu()
            if at_ids_T_K.dim() != 2 or at_ids_T_K.shape[0] != len(turn.response_ids):
                raise ValueError(f"student ids of shape {tuple(at_ids_T_K.shape)} do not fit a response of "
                                 f"{len(turn.response_ids)} tokens")
            candidates: list[str] = list(request.hints) if request.hints else [""]
            spans.append((len(prompts), len(candidates), candidates))
            prompts.extend(ScoreRequest(prompt_ids=self.prompt_ids(turn, h), response_ids=list(turn.response_ids),
                                        top_k=request.teacher_k or self.topk, temperature=float(request.temperature),
                                        at_ids_T_K=at_ids_T_K) for h in candidates)
        return prompts, spans


def _at_ids(result: Any) -> torch.Tensor:
    if result.at_ids_logprobs_T_K is None:
        raise RuntimeError("the teacher engine did not return log-probs at the requested ids")
    return result.at_ids_logprobs_T_K
