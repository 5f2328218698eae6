"""From leased samples to what a training step consumes.

Each sample is joined with its turn: the prompt ids and the response ids *exactly as generated* (never
re-rendered from text), the behaviour log-probs from serving, the policy version that generated them and the
train-side temperature (one rule, ``clawloop.teacher.train_temperature``, shared with the teacher). Samples that
cannot be trained are returned with a reason so the caller records it in the store (never silently):

* ``empty_response`` — no response tokens;
* ``too_long`` — more response tokens than ``max_response_tokens``, or prompt + response beyond the model's
  context or beyond ``max_train_tokens`` (the per-sample training memory budget, docs/training-memory.md);
* ``bad_logprobs`` — the behaviour log-probs do not line up with the response ids;
* ``bad_ids`` — token ids outside the model's vocabulary;
* ``bad_targets`` — teacher scores recorded with the sample (``clawloop.wire.TeacherScores``) whose shapes do not
  fit the turn, ids outside the vocabulary, or a top-k row naming the same id twice;
* ``stale`` — older than ``max_staleness`` versions with ``staleness_mode = drop``.

A context sample (kind ``context``: the teacher's own answer to a hinted turn, docs/context-distillation.md) is
never stale: its response was sampled by the teacher, not by any version of the policy, so neither dropping it
for the policy's age nor correcting it toward the policy that served the turn means anything; it trains at
weight 1 and stays out of the staleness statistics.

Micro-batches are right-padded: positions after a sequence's end are masked out of attention and never read,
so padding changes no trained value. A micro-batch holds at most ``micro_batch_size`` samples and at most
``micro_batch_tokens`` padded tokens (samples × its longest sample), so its activation memory is bounded by
the token budget whatever the batch; a sample longer than the budget goes alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from clawloop.config import Config
from clawloop.store import CONTEXT_KIND, SampleRecord, Store, TurnRecord
from clawloop.teacher import train_temperature
from clawloop.trainer import staleness as stale
from clawloop.wire import SCORE_KEYS, TeacherScores

TEACHER_KEYS = ("teacher_ids_C_T_K", "teacher_logprobs_C_T_K", "teacher_at_student_C_T_K")


@dataclass
class TrainItem:
    """One sample ready for the old-policy forward and the step."""

    sample: SampleRecord
    turn: TurnRecord
    input_ids_L: torch.Tensor
    """[P + T] int64: prompt ids then response ids."""
    prompt_len: int
    response_ids_T: torch.Tensor
    behaviour_logprobs_T: torch.Tensor
    temperature: float
    """Temperature dividing every train-side logit of this sample (student, old, reference, teacher)."""
    staleness: int
    importance_correct: bool = False
    # Filled by the old-policy forward:
    student_ids_T_K: torch.Tensor | None = None
    """The old policy's top-k ids (samples with an OPD branch), the ids the teacher is asked at."""
    scores: TeacherScores | None = None
    """The teacher's scores at ``student_ids_T_K`` for this step (asked, or recorded with the sample at the very
    same ids), or None (no OPD branch this step)."""
    old_logprobs_T: torch.Tensor | None = None
    targets: Any = None
    """``clawloop.losses.TopKTargets`` with the student side filled in, or None (no OPD term)."""
    ref_logprobs_T: torch.Tensor | None = None
    teacher_logprobs_T: torch.Tensor | None = None
    """ℓ_T at the sampled ids under the chosen hint (legacy ``combine`` method only)."""
    token_weights_T: torch.Tensor | None = None
    """Truncated importance weights (stale samples under ``tis``), None = all ones."""
    info: dict[str, float | str] = field(default_factory=dict)

    @property
    def turn_id(self) -> int:
        return self.sample.turn_id

    @property
    def response_len(self) -> int:
        return int(self.response_ids_T.numel())

    @property
    def recorded_scores(self) -> TeacherScores | None:
        """Teacher scores recorded with the sample (by an earlier step, or an older pipeline), or None."""
        return TeacherScores.from_tensors(self.sample.targets, self.sample.teacher_version)


Drops = list[tuple[int, str]]


def prepare_items(store: Store, samples: list[SampleRecord], config: Config, current_version: int,
                  max_context: int | None = None,
                  vocab_size: int | None = None) -> tuple[list[TrainItem], Drops, stale.StalenessStats]:
    """Join samples with their turns and check them. Returns (items, [(turn_id, drop reason)], staleness)."""
    items: list[TrainItem] = []
    drops: list[tuple[int, str]] = []
    stats = stale.StalenessStats(gaps=[])
    for sample in samples:
        turn = store.get_turn(sample.turn_id)
        reason = _check(sample, turn, config, max_context, vocab_size)
        if reason:
            drops.append((sample.turn_id, reason))
            continue
        if sample.kind == CONTEXT_KIND:
            gap, action = 0, stale.KEEP
        else:
            gap = stale.staleness(turn.policy_version, current_version)
            action = stale.decide(gap, config.max_staleness, config.staleness_mode)
            if action == stale.DROP:
                drops.append((sample.turn_id, "stale"))
                stats.dropped += 1
                continue
            stats.gaps.append(gap)
        response_ids_T = torch.tensor(turn.response_ids, dtype=torch.long)
        items.append(TrainItem(
            sample=sample,
            turn=turn,
            input_ids_L=torch.tensor(list(turn.prompt_ids) + list(turn.response_ids), dtype=torch.long),
            prompt_len=len(turn.prompt_ids),
            response_ids_T=response_ids_T,
            behaviour_logprobs_T=torch.tensor(turn.logprobs, dtype=torch.float32),
            temperature=float(train_temperature(config, turn)),
            staleness=gap,
            importance_correct=action == stale.TIS,
        ))
        if action == stale.TIS:
            stats.corrected += 1
    return items, drops, stats


def _check(sample: SampleRecord, turn: TurnRecord, config: Config, max_context: int | None,
           vocab_size: int | None) -> str:
    n = len(turn.response_ids)
    if n == 0:
        return "empty_response"
    if len(turn.prompt_ids) == 0:
        return "empty_prompt"
    if n > config.max_response_tokens:
        return "too_long"
    if max_context is not None and len(turn.prompt_ids) + n > max_context:
        return "too_long"
    if len(turn.prompt_ids) + n > config.max_train_tokens:
        return "too_long"
    if len(turn.logprobs) != n:
        return "bad_logprobs"
    if vocab_size is not None:
        ids = list(turn.prompt_ids) + list(turn.response_ids)
        if min(ids) < 0 or max(ids) >= vocab_size:
            return "bad_ids"
    t = sample.targets
    if t and all(k in t for k in SCORE_KEYS):
        student = t["student_ids_T_K"]
        if student.dim() != 2 or student.shape[0] != n:
            return "bad_targets"
        C, K = t["teacher_ids_C_T_K"].shape[0], student.shape[1]
        for key in TEACHER_KEYS:
            if t[key].dim() != 3 or t[key].shape[:2] != (C, n):
                return "bad_targets"
        if t["teacher_at_student_C_T_K"].shape[2] != K or \
                t["teacher_logprobs_C_T_K"].shape != t["teacher_ids_C_T_K"].shape:
            return "bad_targets"
        for key in ("student_ids_T_K", "teacher_ids_C_T_K"):
            ids_t = t[key]
            if ids_t.numel() and (int(ids_t.min()) < 0 or (vocab_size is not None and int(ids_t.max()) >= vocab_size)):
                return "bad_targets"
            ordered = ids_t.sort(-1).values
            if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
                return "bad_targets"
    return ""


@dataclass
class MicroBatch:
    items: list[TrainItem]
    input_ids_B_L: torch.Tensor
    attention_mask_B_L: torch.Tensor
    prompt_lens: list[int]
    response_lens: list[int]


def collate(items: list[TrainItem], device: torch.device | str = "cpu", pad_id: int = 0) -> MicroBatch:
    """Right-pad prompt + response ids of ``items`` into one ``[B, L]`` batch."""
    length = max(int(it.input_ids_L.numel()) for it in items)
    input_ids_B_L = torch.full((len(items), length), pad_id, dtype=torch.long)
    attention_mask_B_L = torch.zeros((len(items), length), dtype=torch.long)
    for i, it in enumerate(items):
        n = int(it.input_ids_L.numel())
        input_ids_B_L[i, :n] = it.input_ids_L
        attention_mask_B_L[i, :n] = 1
    return MicroBatch(items=items, input_ids_B_L=input_ids_B_L.to(device),
                      attention_mask_B_L=attention_mask_B_L.to(device),
                      prompt_lens=[it.prompt_len for it in items], response_lens=[it.response_len for it in items])


def micro_batches(items: list[TrainItem], size: int, max_tokens: int | None = None) -> list[list[TrainItem]]:
    """Groups of at most ``size`` items and (with ``max_tokens``) at most ``max_tokens`` padded tokens
    (group length × longest member), similar lengths together (less padding), order otherwise kept. An item
    longer than ``max_tokens`` forms a group of its own."""
    order = sorted(range(len(items)), key=lambda i: int(items[i].input_ids_L.numel()))
    groups: list[list[TrainItem]] = []
    for i in order:
        length = int(items[i].input_ids_L.numel())  # ascending: the newcomer is the group's longest
        group = groups[-1] if groups else None
        if group is not None and len(group) < size and \
                (max_tokens is None or (len(group) + 1) * length <= max_tokens):
            group.append(items[i])
        else:
            groups.append([items[i]])
    return groups
