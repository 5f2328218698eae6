"""The records that cross a process boundary, and their one codec.

* A leased sample and its turn, as the trainer routes send it and a remote trainer reads it.
* ``TeacherScores``: the teacher's answer for one sample (the one name of that tensor bundle), as the in-process
  teacher returns it, as a sample row records it, and as the admin teacher route sends it to a ``torchrun``
  trainer; with ``TeacherRequest``, what a trainer asks for.

It sits beside the records it encodes (``clawloop.store``) so that both ends (the API's routes, the trainer's
clients) import it from below. Tensors travel as base64 safetensors, so they arrive bit-for-bit as computed.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, fields
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from clawloop.store import SampleRecord, TurnRecord


def encode_tensors(tensors: dict[str, torch.Tensor] | None) -> str | None:
    if tensors is None:
        return None
    return base64.b64encode(st_save({k: v.contiguous() for k, v in tensors.items()})).decode("ascii")


def decode_tensors(text: str | None) -> dict[str, torch.Tensor] | None:
    """Tensors sent as base64 safetensors; a ``ValueError`` for text that is neither (a caller's mistake, which
    the routes answer 400, not a server failure)."""
    if text is None:
        return None
    try:
        return st_load(base64.b64decode(text, validate=True))
    except Exception as exc:  # noqa: BLE001 - binascii.Error, safetensors' own error, a non-string: all bad input
        raise ValueError(f"not base64 safetensors ({type(exc).__name__}: {exc})") from None


@dataclass
class TeacherScores:
    """The teacher's answer for one sample: per hint candidate c (in hint order; no hints = one candidate, the
    un-hinted prompt) and response position t, from ``log_softmax(logits / τ)`` at the turn's train-side τ.

    Ids are int64, log-probs float32. The first five fields are what the objective reads; the rest are
    record-only (the dashboard's per-token view) and may be absent.
    """

    student_ids_T_K: torch.Tensor
    """[T, K] the ids the teacher was asked at: the old policy's top-k at training time."""
    teacher_ids_C_T_K: torch.Tensor
    """[C, T, K'] each candidate teacher's own top-k ids (K' = the request's ``teacher_k``, most likely first)."""
    teacher_logprobs_C_T_K: torch.Tensor
    """[C, T, K'] their log-probs."""
    teacher_at_student_C_T_K: torch.Tensor
    """[C, T, K] the teacher's log-probs at ``student_ids_T_K``."""
    hint_lens_C: torch.Tensor
    """[C] each candidate's hint length in characters (0 for the un-hinted candidate)."""
    teacher_token_logprobs_C_T: torch.Tensor | None = None
    """[C, T] the teacher's log-probs at the sampled ids (record-only)."""
    student_logprobs_T_K: torch.Tensor | None = None
    """[T, K] the old policy's log-probs at ``student_ids_T_K`` (record-only, filled by the trainer)."""
    student_token_logprobs_T: torch.Tensor | None = None
    """[T] the old policy's log-probs at the sampled ids (record-only, filled by the trainer)."""
    hinted_C_T: torch.Tensor | None = None
    """[C, T] uint8, for a request with a mixed ``target``: 1 where candidate c's row is its hinted prompt's, 0 where
    it is the un-hinted prompt's (record-only; absent for ``target = "hinted"``)."""
    teacher_version: int = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields that are set, by name (a sample row's ``targets`` column holds this form)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                out[f.name] = value.contiguous()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor] | None, teacher_version: int = 0) -> "TeacherScores | None":
        """The bundle from its tensor form; None when a field the objective reads is missing."""
        if not tensors or any(k not in tensors for k in SCORE_KEYS):
            return None
        known = {f.name for f in fields(cls)} - {"teacher_version"}
        hint_lens_C = tensors.get("hint_lens_C")
        if hint_lens_C is None:  # rows written before the field existed
            hint_lens_C = torch.zeros(tensors["teacher_ids_C_T_K"].shape[0], dtype=torch.int64)
        kwargs = {k: v for k, v in tensors.items() if k in known}
        kwargs["hint_lens_C"] = hint_lens_C
        return cls(**kwargs, teacher_version=int(teacher_version))


SCORE_KEYS = ("student_ids_T_K", "teacher_ids_C_T_K", "teacher_logprobs_C_T_K", "teacher_at_student_C_T_K")
"""The ``TeacherScores`` fields the objective reads."""


@dataclass
class TeacherRequest:
    """What a trainer asks the teacher for one sample: score the turn's stored response under each hint
    candidate, with the teacher's own top-k and its log-probs at ``student_ids_T_K``."""

    turn: TurnRecord
    hints: list[str]
    """Hint candidates; empty = the un-hinted prompt itself (the anchor)."""
    student_ids_T_K: torch.Tensor
    temperature: float
    teacher_k: int = 0
    """K': how many of its own most likely ids per position the teacher returns; 0 = the teacher's ``topk``.
    Above ``topk`` when the objective's teacher-support term reads more teacher ids than the subset's k."""
    target: str = "hinted"
    """``opd_target``: which prompt each hinted candidate's rows come from per position (``losses.target_mix``)."""


MAX_TEACHER_K = 1024
"""The widest teacher top-K' a request may ask for (a guard on the route, far above any useful K')."""


def scores_to_json(scores: TeacherScores) -> dict[str, Any]:
    return {"tensors": encode_tensors(scores.tensors()), "teacher_version": int(scores.teacher_version)}


def scores_from_json(d: dict[str, Any]) -> TeacherScores:
    scores = TeacherScores.from_tensors(decode_tensors(d["tensors"]), int(d.get("teacher_version", 0)))
    if scores is None:
        raise ValueError("teacher scores without the tensors the objective reads")
    return scores


def request_to_json(request: TeacherRequest) -> dict[str, Any]:
    turn = request.turn
    return {"turn_id": turn.id, "messages": turn.messages, "tools": turn.tools,
            "prompt_ids": list(turn.prompt_ids), "response_ids": list(turn.response_ids),
            "hints": list(request.hints), "temperature": float(request.temperature),
            "teacher_k": int(request.teacher_k), "target": request.target,
            "student_ids": encode_tensors({"student_ids_T_K": request.student_ids_T_K.to(torch.int64)})}


def request_from_json(d: dict[str, Any]) -> TeacherRequest:
    """The request a trainer sent; raises KeyError/ValueError/TypeError on a malformed one."""
    response_ids = [int(x) for x in d["response_ids"]]
    turn = TurnRecord(session_id="", messages=list(d["messages"]), prompt_ids=[int(x) for x in d["prompt_ids"]],
                      response_ids=response_ids, logprobs=[0.0] * len(response_ids), temperature=0.0, top_p=1.0,
                      policy_version=0, tools=d.get("tools"),
                      id=None if d.get("turn_id") is None else int(d["turn_id"]))
    ids = decode_tensors(d["student_ids"])
    if ids is None or "student_ids_T_K" not in ids:
        raise ValueError("'student_ids' holds no student_ids_T_K")
    hints = d.get("hints") or []
    if not isinstance(hints, list) or not all(isinstance(h, str) for h in hints):
        raise ValueError("'hints' must be a list of strings")
    teacher_k = d.get("teacher_k", 0)  # absent from an older trainer's requests
    if isinstance(teacher_k, bool) or not isinstance(teacher_k, int) or not 0 <= teacher_k <= MAX_TEACHER_K:
        raise ValueError(f"'teacher_k' must be an integer in [0, {MAX_TEACHER_K}], got {teacher_k!r}")
    target = d.get("target", "hinted")  # absent from an older trainer's requests
    if not isinstance(target, str):
        raise ValueError(f"'target' must be a string, got {target!r}")
    return TeacherRequest(turn=turn, hints=hints, student_ids_T_K=ids["student_ids_T_K"].to(torch.int64),
                          temperature=float(d["temperature"]), teacher_k=teacher_k, target=target)


def sample_to_json(sample: SampleRecord, turn: TurnRecord) -> dict[str, Any]:
    return {
        "turn_id": sample.turn_id,
        "session_id": turn.session_id,
        "turn_index": turn.turn_index,
        "messages": turn.messages,
        "tools": turn.tools,
        "prompt_ids": list(turn.prompt_ids),
        "response_ids": list(turn.response_ids),
        "logprobs": list(turn.logprobs),
        "temperature": turn.temperature,
        "top_p": turn.top_p,
        "policy_version": turn.policy_version,
        "response_text": turn.response_text,
        "reward": sample.reward,
        "kind": sample.kind,
        "hints": list(sample.hints),
        "teacher_version": sample.teacher_version,
        "info": sample.info,
        "targets": encode_tensors(sample.targets),
    }


def sample_from_json(d: dict[str, Any], lease_id: str = "") -> tuple[SampleRecord, TurnRecord]:
    turn = TurnRecord(session_id=d["session_id"], turn_index=int(d["turn_index"]), messages=d["messages"],
                      tools=d.get("tools"), prompt_ids=[int(x) for x in d["prompt_ids"]],
                      response_ids=[int(x) for x in d["response_ids"]], logprobs=[float(x) for x in d["logprobs"]],
                      temperature=float(d["temperature"]), top_p=float(d["top_p"]),
                      policy_version=int(d["policy_version"]), response_text=d.get("response_text", ""),
                      id=int(d["turn_id"]), state="leased")
    sample = SampleRecord(turn_id=int(d["turn_id"]), reward=float(d["reward"]), kind=d["kind"],
                          hints=list(d["hints"]), targets=decode_tensors(d.get("targets")),
                          teacher_version=int(d.get("teacher_version", 0)), info=dict(d.get("info") or {}),
                          state="leased", lease_id=lease_id)
    return sample, turn
