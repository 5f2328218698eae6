"""Hint injection and the teacher's scores per hint candidate (docs/method.md, section 3).

Hint injection: the turn's request messages are copied, the **last user message** gets
``"\\n\\n[user's hint / instruction]\\n" + hint`` appended to its text (when there is no user message, one user
message holding ``"[user's hint / instruction]\\n" + hint`` is added at the end), the result is rendered with the same
renderer and tools the API used when serving, and the turn's **stored response ids** are appended — the response
is never re-tokenised from text. ``render_matches`` says whether rendering the un-hinted messages today reproduces
the stored prompt ids (it does not when the serving template changed since the turn was recorded).
Tool-call loops keep their later tool messages untouched: the hint goes where the user spoke last (an OpenClaw
message holding only its internal runtime context, or asking again for an answer, is not the user speaking). With
``hint_placement = "system_and_user"`` it also ends the system prompt (``inject_hint``'s ``system``).

Scores: ``Teacher.score`` answers a trainer's ``TeacherRequest``s (``clawloop.wire``): per sample, the turn,
its hint candidates and the ids the trainer needs the teacher's log-probs at (the old policy's top-k, computed
by the trainer's old-policy pass). It returns one ``TeacherScores`` per request, all from one ``engine.score``
call covering every candidate of every request (the engine returns the teacher's own top-k and the log-probs at
the asked ids from one forward per candidate), all at the temperature the request names (the train-side
``train_temperature(config, turn)`` that the trainer also uses for the student).

A request's ``target`` (the trainer's ``opd_target``) other than ``hinted`` adds one more prompt per sample, the
stored un-hinted one, and each hint candidate's rows are then mixed per position from its own hinted row and that
un-hinted row (``clawloop.losses.target_mix``); ``hinted_C_T`` records which positions took the hinted row. The
rule reads the ids that end an answer, from the tokenizer the teacher is given at construction. Under the same
target, ``Teacher.answer`` writes the answer that mix describes (context distillation, below).

The teacher is scored at training time only, by the trainer (``clawloop.trainer.teacher_client``), so the ids
are always the old policy's exact top-k. The judging pipeline asks it for one thing only, and only with
``context_samples > 0``: ``Teacher.answer``, the teacher's own sampled answer to the hint-augmented request (the
very prompt it is scored under), which becomes a context sample (docs/context-distillation.md).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch

from clawloop.engines.base import Engine, Generation, SamplingParams, ScoreRequest
from clawloop.engines.model_files import end_token_ids
from clawloop.temperature import effective_temperature
from clawloop.judge.prompts import content_text
from clawloop.losses import OPD_TARGETS, hinted_positions, mix_rows, mixes
from clawloop.openclaw_format import is_ephemeral
from clawloop.renderers import template_default_system
from clawloop.store import TurnRecord
from clawloop.wire import TeacherRequest, TeacherScores

OPENING_TOKENS = 8
"""The most tokens of the hinted prompt's own answer a mixed answer reads its opening from."""

HINT_PREFIX = "[user's hint / instruction]\n"
HINT_SEPARATOR = "\n\n"
DRAFT_PREFIX = "[a correct answer to rewrite so that it follows the instruction]\n"

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


def inject_hint(messages: Sequence[dict[str, Any]], hint: str, draft: str | None = None, *,
                system: str | None = None) -> list[dict[str, Any]]:
    """A copy of ``messages`` with ``hint`` appended to the last user message (or a new user message).

    With ``system`` (``hint_placement = "system_and_user"``: the system prompt the chat template writes when there
    is none, often ''), the hint is also appended to the system message, one being added (``system`` followed by
    the hint) when the conversation has none. Told 'Begin every answer with "In short,"' only after the question,
    SmolLM2-135M takes the phrase for the topic ("In short, "In short," is a common idiomatic expression …") and
    states 7 of the 17 facts it knows; told it in its system prompt as well, it states all 17 and still opens 10 of
    14 held-out answers with the phrase (docs/method.md, "Where the hint goes").

    With a ``draft`` (the answer that was served, ``teacher_draft``), the hint is followed by the draft under
    ``DRAFT_PREFIX`` and then by the hint once more: a small teacher told only "Begin every answer with "In short,""
    answers "In short, there are 720 days in a week", while with its own plain answer to rewrite it keeps the facts
    (SmolLM2-135M: 15 of 17 known facts against 7) and still opens with the preference (13 of 14 held-out answers
    against 12); the hint is repeated last because a small model follows what it read last. Scoring the same
    answer it reads, though, the teacher copies it, which is why the setting is off (docs/method.md)."""
    addition = hint if draft is None else hint + HINT_SEPARATOR + DRAFT_PREFIX + draft + HINT_SEPARATOR + hint
    out = copy.deepcopy(list(messages))
    if system is not None:
        if out and out[0].get("role") == "system":
            out[0]["content"] = content_text(out[0].get("content")) + HINT_SEPARATOR + HINT_PREFIX + hint
        else:
            out.insert(0, {"role": "system", "content": (system + HINT_SEPARATOR if system else "") + HINT_PREFIX
                           + hint})
    # Where the user spoke last: an OpenClaw message holding only its internal runtime context, or its request
    # for an answer again, is not the user's words (the judge leaves them out too), so the hint goes before it.
    users = [m for m in out if m.get("role") == "user"]
    spoken = [m for m in users if not is_ephemeral(m)] or users
    if spoken:
        spoken[-1]["content"] = content_text(spoken[-1].get("content")) + HINT_SEPARATOR + HINT_PREFIX + addition
        return out
    out.append({"role": "user", "content": HINT_PREFIX + addition})
    return out


def hint_system(config: Any, tokenizer: Any) -> str | None:
    """``inject_hint``'s ``system`` for ``config.hint_placement``: None (the hint goes after the last user message
    only) or the system prompt the tokenizer's template writes when there is none ('' without a tokenizer)."""
    if config.hint_placement != "system_and_user":
        return None
    return template_default_system(tokenizer) if tokenizer is not None else ""


class Teacher:
    """Scores a turn's stored response under hint-augmented prompts with a (normally frozen) engine."""

    def __init__(self, engine: Engine, render: RenderFn, config: Any, *, tokenizer: Any = None):
        self.engine = engine
        self.render = render
        self.config = config
        self.topk = int(config.topk)
        self.end_ids = torch.tensor(end_token_ids(tokenizer) if tokenizer is not None else [], dtype=torch.int64)
        """The ids that end an answer (end of turn, end of text), which the mixed targets read; none without a
        tokenizer, and then a mixed target is refused."""
        self.decode: Callable[[list[int]], str] | None = (
            None if tokenizer is None else lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
        self.hint_system = hint_system(config, tokenizer)
        """Where the hint goes besides the last user message (``inject_hint``'s ``system``)."""
        self.draft = bool(config.teacher_draft)
        """Whether hinted prompts carry the served answer (``teacher_draft``), read from the stored ids as text."""
        if self.draft and self.decode is None:
            raise ValueError("teacher_draft needs the tokenizer to read the served answer; this teacher has none")

    @property
    def ends(self) -> frozenset[int]:
        """``end_ids`` as a set of ints (derived each time: ``end_ids`` may be replaced)."""
        return frozenset(int(i) for i in self.end_ids.tolist())

    # ---- prompts ----------------------------------------------------------------------------------------
    def prompt_ids(self, turn: TurnRecord, hint: str | None, *, draft: bool | None = None) -> list[int]:
        """The teacher prompt for one candidate; ``None``/'' means the un-hinted stored prompt ids. ``draft``:
        whether the prompt carries the served answer to rewrite (None: as ``teacher_draft`` says)."""
        if not hint:
            return list(turn.prompt_ids)
        shown = self._draft(turn) if (self.draft if draft is None else draft) else None
        return list(self.render(inject_hint(turn.messages, hint, shown, system=self.hint_system), turn.tools))

    def _draft(self, turn: TurnRecord) -> str | None:
        """The turn's served answer as text (None without a tokenizer to read it)."""
        if self.decode is None:
            return None
        return self.decode([i for i in turn.response_ids if i not in self.ends]).strip()

    def render_matches(self, turn: TurnRecord) -> bool:
        """Whether rendering the stored request today reproduces the prompt ids served then."""
        return list(self.render(turn.messages, turn.tools)) == list(turn.prompt_ids)

    # ---- answering ----------------------------------------------------------------------------------------
    async def answer(self, turn: TurnRecord, hint: str, params: SamplingParams, target: str = "hinted", *,
                     draft: bool | None = None) -> Generation:
        """The teacher's own answer to ``turn``'s request with ``hint`` injected, rendered as for scoring, or with
        the served answer shown as a draft or not as ``draft`` says (None: as for scoring); under a mixed
        ``target``, the answer that target describes (``_mixed_answer``). Rendering runs in a worker thread and
        the engine calls are awaited: this coroutine runs on the serving event loop."""
        if draft and self.decode is None:
            raise ValueError("a drafted answer needs the tokenizer to read the served answer; this teacher has none")
        prompt_ids = await asyncio.to_thread(functools.partial(self.prompt_ids, turn, hint, draft=draft))
        if target == "hinted":
            return await self.engine.generate(prompt_ids, params)
        if target not in OPD_TARGETS:
            raise ValueError(f"target={target!r} is not one of: {', '.join(OPD_TARGETS)}")
        if self.end_ids.numel() == 0:
            raise ValueError(f"target={target!r} needs the ids that end an answer; this teacher has none")
        return await self._mixed_answer(turn, prompt_ids, params, target)

    async def _mixed_answer(self, turn: TurnRecord, hinted_prompt: list[int], params: SamplingParams,
                            target: str) -> Generation:
        """An answer from the hinted prompt's opening, the un-hinted prompt's content and the hinted prompt's
        stop, sampled with the engine's own calls:

        1. (``opening_end``) the hinted prompt samples up to ``OPENING_TOKENS``; its opening is the tokens before
           the first one the un-hinted prompt also ranks first (one score call);
        2. the un-hinted prompt, with the opening already written, samples the rest;
        3. the hinted prompt scores the whole answer, which is cut at the first position after the opening where
           its most likely token ends the answer, and ended there with that token.
        """
        plain_prompt = list(turn.prompt_ids)
        temperature = params.temperature if params.temperature > 0 else 1.0
        ends = self.ends
        opening: list[int] = []
        opening_logprobs: list[float] = []
        if target == "opening_end":
            probe = await self.engine.generate(hinted_prompt, replace(params, max_tokens=min(params.max_tokens,
                                                                                             OPENING_TOKENS)))
            ids = list(itertools.takewhile(lambda i: i not in ends, probe.token_ids))
            if ids:
                (plain,) = await self.engine.score([ScoreRequest(prompt_ids=plain_prompt, response_ids=ids, top_k=1,
                                                                 temperature=temperature)])
                plain_top = plain.topk_ids_T_K[:, 0].tolist()
                agree = next((t for t, i in enumerate(ids) if i == plain_top[t]), len(ids))
                opening, opening_logprobs = ids[:agree], list(probe.logprobs[:agree])
        rest = await self.engine.generate(plain_prompt + opening,
                                          replace(params, max_tokens=max(1, params.max_tokens - len(opening))))
        ids = opening + list(rest.token_ids)
        logprobs = opening_logprobs + list(rest.logprobs)
        finish = rest.finish_reason
        (hinted,) = await self.engine.score([ScoreRequest(prompt_ids=hinted_prompt, response_ids=ids, top_k=1,
                                                          temperature=temperature)])
        hinted_top = hinted.topk_ids_T_K[:, 0].tolist()
        for t in range(len(opening), len(ids)):
            if ids[t] in ends:
                break
            if hinted_top[t] in ends:
                ids, logprobs = ids[:t] + [hinted_top[t]], logprobs[:t] + [float(hinted.topk_logprobs_T_K[t, 0])]
                finish = "stop"
                break
        text = self.decode([i for i in ids if i not in ends]) if self.decode is not None else ""
        return Generation(token_ids=ids, logprobs=logprobs, finish_reason=finish, policy_version=rest.policy_version,
                          prompt_tokens=len(plain_prompt), text=text)

    # ---- scoring ------------------------------------------------------------------------------------------
    async def score(self, requests: Sequence[TeacherRequest]) -> list[TeacherScores]:
        """The teacher's scores for each request (see the module docstring), from one engine call. Rendering the
        hinted prompts runs in a worker thread: this coroutine runs on the serving event loop."""
        prompts, spans = await asyncio.to_thread(self._score_requests, requests)
        results = await self.engine.score(prompts) if prompts else []
        out = []
        for request, (first, count, candidates) in zip(requests, spans):
            mine = results[first:first + count]
            scores = TeacherScores(
                student_ids_T_K=request.student_ids_T_K.to(torch.int64).cpu().contiguous(),
                teacher_ids_C_T_K=torch.stack([r.topk_ids_T_K.to(torch.int64).cpu() for r in mine]),
                teacher_logprobs_C_T_K=torch.stack([r.topk_logprobs_T_K.float().cpu() for r in mine]),
                teacher_at_student_C_T_K=torch.stack([_at_ids(r).float().cpu() for r in mine]),
                hint_lens_C=torch.tensor([len(h) for h in candidates], dtype=torch.int64),
                teacher_token_logprobs_C_T=torch.stack([r.logprobs_T.float().cpu() for r in mine]),
                teacher_version=int(mine[0].policy_version))
            out.append(self._mixed(scores, request.target) if _mixes(request) else scores)
        return out

    def _score_requests(self, requests: Sequence[TeacherRequest]
                        ) -> tuple[list[ScoreRequest], list[tuple[int, int, list[str]]]]:
        """The engine's score requests for every candidate of every request, and each request's span of them. A
        request with a mixed target gets one more candidate at the end of its span: the un-hinted prompt."""
        prompts: list[ScoreRequest] = []
        spans: list[tuple[int, int, list[str]]] = []
        for request in requests:
            turn = request.turn
            if not turn.response_ids:
                raise ValueError("the turn has no response tokens")
            if request.target not in OPD_TARGETS:
                raise ValueError(f"target={request.target!r} is not one of: {', '.join(OPD_TARGETS)}")
            if _mixes(request) and self.end_ids.numel() == 0:
                raise ValueError(f"target={request.target!r} needs the ids that end an answer; this teacher has none")
            at_ids_T_K = request.student_ids_T_K.to(torch.int64).cpu()
            if at_ids_T_K.dim() != 2 or at_ids_T_K.shape[0] != len(turn.response_ids):
                raise ValueError(f"student ids of shape {tuple(at_ids_T_K.shape)} do not fit a response of "
                                 f"{len(turn.response_ids)} tokens")
            candidates: list[str] = list(request.hints) if request.hints else [""]
            scored = candidates + [""] if _mixes(request) else candidates
            spans.append((len(prompts), len(scored), candidates))
            prompts.extend(ScoreRequest(prompt_ids=self.prompt_ids(turn, h), response_ids=list(turn.response_ids),
                                        top_k=request.teacher_k or self.topk, temperature=float(request.temperature),
                                        at_ids_T_K=at_ids_T_K) for h in scored)
        return prompts, spans

    def _mixed(self, scores: TeacherScores, target: str) -> TeacherScores:
        """The hinted candidates' rows mixed per position with the un-hinted row (the last one scored), by the
        ``target`` rule (``losses.target_mix``)."""
        ids_C_T_K = scores.teacher_ids_C_T_K
        hinted = slice(0, ids_C_T_K.shape[0] - 1)
        use_C_T = hinted_positions(ids_C_T_K[hinted, :, 0], ids_C_T_K[-1, :, 0], self.end_ids, target)
        assert scores.teacher_token_logprobs_C_T is not None
        token_C_T = scores.teacher_token_logprobs_C_T
        return TeacherScores(
            student_ids_T_K=scores.student_ids_T_K,
            teacher_ids_C_T_K=mix_rows(ids_C_T_K[hinted], ids_C_T_K[-1], use_C_T),
            teacher_logprobs_C_T_K=mix_rows(scores.teacher_logprobs_C_T_K[hinted], scores.teacher_logprobs_C_T_K[-1],
                                            use_C_T),
            teacher_at_student_C_T_K=mix_rows(scores.teacher_at_student_C_T_K[hinted],
                                              scores.teacher_at_student_C_T_K[-1], use_C_T),
            hint_lens_C=scores.hint_lens_C,
            teacher_token_logprobs_C_T=torch.where(use_C_T, token_C_T[hinted], token_C_T[-1:]),
            hinted_C_T=use_C_T.to(torch.uint8),
            teacher_version=scores.teacher_version)


def _mixes(request: TeacherRequest) -> bool:
    return mixes(request.target, bool(request.hints))


def _at_ids(result: Any) -> torch.Tensor:
    if result.at_ids_logprobs_T_K is None:
        raise RuntimeError("the teacher engine did not return log-probs at the requested ids")
    return result.at_ids_logprobs_T_K
