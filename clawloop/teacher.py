"""Hint injection and the teacher's top-k targets per hint candidate (docs/method.md, section 3).

Hint injection: the turn's request messages are copied, the **last user message** gets
``"\\n\\n[user's hint / instruction]\\n" + hint`` appended to its text (when there is no user message, one user
message holding ``"[user's hint / instruction]\\n" + hint`` is added at the end), the result is rendered with the same
renderer and tools the API used when serving, and the turn's **stored response ids** are appended — the response
is never re-tokenised from text. The un-hinted messages are rendered the same way and compared with the stored
prompt ids; a mismatch (the serving template changed since the turn was recorded) is reported in the sample info.
Tool-call loops keep their later tool messages untouched: the hint goes where the user spoke last.

Targets, per candidate c and response position t, all from ``log_softmax(logits / T)`` with the one train-side
temperature ``train_temperature(config, turn)`` that the trainer also uses for the student:

* ``teacher_ids_C_T_K`` / ``teacher_logprobs_C_T_K`` — the teacher's own top-k under the hinted prompt (the frozen
  teacher never changes, so these are final);
* ``student_ids_T_K`` — a *provisional* student top-k set: the current policy's top-k on the un-hinted prompt at
  judging time. The trainer recomputes the old policy's top-k at training time; where that differs it asks again
  through ``Teacher.teacher_at_ids``;
* ``teacher_at_student_C_T_K`` — the teacher's log-probs at those provisional student ids;
* ``hint_lens_C`` — each candidate's length in characters (0 for the un-hinted anchor candidate);
* ``student_logprobs_T_K``, ``student_token_logprobs_T`` and ``teacher_token_logprobs_C_T`` — the provisional
  student's log-probs at its top-k and at the sampled tokens, and each candidate teacher's at the sampled tokens.
  The trainer does not read them (it recomputes the old policy); they let a reader of the record (the dashboard)
  show the per-token teacher-minus-student signal of each sample as it was at judging time.

Ids are int64, log-probs float32. With ``opd_on_unhinted = anchor`` an RL-only sample gets one candidate: the
un-hinted stored prompt itself.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from clawloop.engines.base import Engine, ScoreRequest
from clawloop.temperature import effective_temperature
from clawloop.judge.prompts import content_text
from clawloop.store import TurnRecord

HINT_PREFIX = "[user's hint / instruction]\n"
HINT_SEPARATOR = "\n\n"

RenderFn = Callable[[Sequence[dict[str, Any]], list[dict[str, Any]] | None], list[int]]
"""(messages, tools) -> prompt ids, with the generation prompt, exactly as serving renders them."""


def train_temperature(config: Any, turn: TurnRecord | float) -> float:
    """The temperature of every train-side log-prob (student, old policy, teacher, reference) for a turn.

    ``config.train_temperature`` when it is positive; otherwise the turn's own sampling temperature, with greedy
    turns (temperature 0, or below ``GREEDY_BELOW`` in a store written before that rule) scored at 1.0.
    """
    fixed = float(getattr(config, "train_temperature", 0.0) or 0.0)
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


@dataclass
class TeacherTargets:
    tensors: dict[str, torch.Tensor]
    """student_ids_T_K, teacher_ids_C_T_K, teacher_logprobs_C_T_K, teacher_at_student_C_T_K, hint_lens_C and the
    record-only student_logprobs_T_K, student_token_logprobs_T, teacher_token_logprobs_C_T (module docstring)."""
    teacher_version: int
    info: dict[str, Any] = field(default_factory=dict)


class Teacher:
    """Scores a turn's stored response under hint-augmented prompts with a (normally frozen) engine."""

    def __init__(self, engine: Engine, render: RenderFn, config: Any, *, student_engine: Engine | None = None):
        self.engine = engine
        self.render = render
        self.config = config
        self.student_engine = student_engine if student_engine is not None else engine
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

    # ---- scoring ------------------------------------------------------------------------------------------
    async def targets(self, turn: TurnRecord, hints: Sequence[str]) -> TeacherTargets:
        """All teacher tensors for a turn. ``hints`` empty = one anchor candidate on the un-hinted prompt."""
        if not turn.response_ids:
            raise ValueError("the turn has no response tokens")
        temperature = train_temperature(self.config, turn)
        candidates: list[str] = list(hints) if hints else [""]
        t0 = time.monotonic()
        matches = self.render_matches(turn)
        prompts = [self.prompt_ids(turn, h) for h in candidates]

        # Provisional student set: the current policy's top-k on the prompt it actually answered.
        (student,) = await self.student_engine.score([ScoreRequest(
            prompt_ids=list(turn.prompt_ids), response_ids=list(turn.response_ids), top_k=self.topk,
            temperature=temperature)])
        student_ids_T_K = student.topk_ids_T_K.to(torch.int64).cpu()
        t1 = time.monotonic()

        results = await self.engine.score([ScoreRequest(
            prompt_ids=p, response_ids=list(turn.response_ids), top_k=self.topk, temperature=temperature,
            at_ids_T_K=student_ids_T_K) for p in prompts])
        t2 = time.monotonic()
        tensors = {
            "student_ids_T_K": student_ids_T_K.contiguous(),
            "teacher_ids_C_T_K": torch.stack([r.topk_ids_T_K.to(torch.int64).cpu() for r in results]),
            "teacher_logprobs_C_T_K": torch.stack([r.topk_logprobs_T_K.float().cpu() for r in results]),
            "teacher_at_student_C_T_K": torch.stack([_at_ids(r).float().cpu() for r in results]),
            "hint_lens_C": torch.tensor([len(h) for h in candidates], dtype=torch.int64),
            "student_logprobs_T_K": student.topk_logprobs_T_K.float().cpu().contiguous(),
            "student_token_logprobs_T": student.logprobs_T.float().cpu().contiguous(),
            "teacher_token_logprobs_C_T": torch.stack([r.logprobs_T.float().cpu() for r in results]),
        }
        info = {
            "render_matches": matches,
            "temperature": temperature,
            "teacher_prompt_lens": [len(p) for p in prompts],
            "anchor": not hints,
            "student_version": int(student.policy_version),
            "student_topk_s": round(t1 - t0, 4),
            "teacher_s": round(t2 - t1, 4),
        }
        return TeacherTargets(tensors=tensors, teacher_version=int(results[0].policy_version), info=info)

    async def teacher_at_ids(self, turn: TurnRecord, hints: Sequence[str], at_ids_T_K: torch.Tensor,
                             temperature: float | None = None) -> torch.Tensor:
        """[C, T, K] teacher log-probs at the given ids (the old policy's top-k computed at training time), one
        row per candidate in ``hints`` order; ``hints`` empty = the un-hinted anchor candidate."""
        temperature = train_temperature(self.config, turn) if temperature is None else temperature
        at_ids_T_K = at_ids_T_K.to(torch.int64).cpu()
        candidates: list[str] = list(hints) if hints else [""]
        results = await self.engine.score([ScoreRequest(
            prompt_ids=self.prompt_ids(turn, h), response_ids=list(turn.response_ids), top_k=self.topk,
            temperature=temperature, at_ids_T_K=at_ids_T_K) for h in candidates])
        return torch.stack([_at_ids(r).float().cpu() for r in results])


def _at_ids(result: Any) -> torch.Tensor:
    if result.at_ids_logprobs_T_K is None:
        raise RuntimeError("the teacher engine did not return log-probs at the requested ids")
    return result.at_ids_logprobs_T_K
