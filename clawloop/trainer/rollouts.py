"""The student's own answers to hinted turns, sampled by the trainer from its current weights (``opd_rollouts``).

The OPD branch trains the positions of the answer that was served. While the served version is the one being
trained, those are the student's own positions: on-policy distillation. When the two part, they are not. The
publication gate keeps a candidate from users, and with ``gate_restore_after`` > 1 training goes on from it, so
the samples come from the last accepted version while the weights move on; the positions the current weights
would write are then never scored. Under `inshort` a student that has learnt to open with "In" writes
"In mathematics, …", and nothing trains what follows its "In", because no served answer ever opened that way. A
rollout is the trainer's own sampled answer to a hinted turn's prompt, put under the same hint candidates as the
served answer (docs/rollouts.md).

Choices:

* A rollout trains the OPD branch and the teacher-support term only. Nobody voted on it: its reward is 0 and its
  GRPO advantage 0 under every advantage mode, and the batch's advantages are shaped without it
  (``step.rewards_for``). It trains at weight 1 like any sample.
* It is never stored. It is a function of the step's weights, sampled again at every step, and it follows its
  parent sample: committed, dropped or given back with it. Its turn id is negative, so no store write can name
  it. It trains only beside a stored sample: a step whose stored samples were all left out makes no update.
* It is sampled at the turn's train-side temperature by inverse transform, with dice of its own per (run seed,
  step, turn, index) (``clawloop.gate.generation``), so a step run again draws the same answers.
* It has up to ``opd_rollout_tokens`` tokens, fewer where the prompt and answer would not fit the model's context
  or ``max_train_tokens`` (as a served sample must), ended with the chat template's end of turn where the model
  ended it.
* A LoRA model on the CPU decodes with its adapter merged (``gate_candidate``: the weights the gate would check,
  the same up to float rounding).
* Its behaviour log-probs are its sampling's (the current weights), so no importance correction applies.
"""

from __future__ import annotations

import dataclasses

import torch

from clawloop.config import Config
from clawloop.gate.generation import probe_answers, sampling_uniforms
from clawloop.store import CONTEXT_KIND
from clawloop.trainer.batch import TrainItem
from clawloop.trainer.model import TrainModels, gate_candidate
from clawloop.trainer.old_policy import wants_opd

ROLLOUT_KIND = "rollout"
"""``SampleRecord.kind`` of a rollout (never stored)."""


def is_rollout(item: TrainItem) -> bool:
    """Whether ``item`` is a rollout (no vote, not in the store) rather than a stored sample."""
    return item.sample.kind == ROLLOUT_KIND


def wants_rollouts(item: TrainItem, config: Config) -> bool:
    """A served sample with a hint and an OPD branch gets rollouts; a context sample (the teacher's answer) and a
    rollout do not."""
    return (config.opd_rollouts > 0 and bool(item.sample.hints) and wants_opd(config, item)
            and item.sample.kind != CONTEXT_KIND and not is_rollout(item))


def rollout_items(models: TrainModels, items: list[TrainItem], config: Config, *, step: int,
                  end_ids: list[int], turn_end: int, max_context: int | None = None) -> list[TrainItem]:
    """``config.opd_rollouts`` answers of the current weights to each prompt of ``items`` that wants them
    (``wants_rollouts``), as items ready for ``train_step``. An answer is capped so that prompt and answer fit
    ``max_context`` and ``max_train_tokens`` as a served sample must; one with no token is left out."""
    cap = min(int(config.opd_rollout_tokens), int(config.max_response_tokens))
    room = config.max_train_tokens if max_context is None else min(max_context, config.max_train_tokens)
    parents = [it for it in items if wants_rollouts(it, config) and room - 1 - len(it.turn.prompt_ids) >= 1]
    asked = [(parent, j) for parent in parents for j in range(int(config.opd_rollouts))]
    out: list[TrainItem] = []
    # One decoding per temperature (a batch samples at one). It is the train-side temperature, never 0: a greedy
    # turn is trained at 1 (``clawloop.teacher.train_temperature``), and its rollouts are sampled at 1.
    for temperature in sorted({it.temperature for it in parents}):
        batch = [(parent, j) for parent, j in asked if parent.temperature == temperature]
        prompts = [list(parent.turn.prompt_ids) for parent, _ in batch]
        # One token kept free for the end of turn appended to an answer the model ended.
        caps = [min(cap, room - 1 - len(p)) for p in prompts]
        dice = [sampling_uniforms(f"rollout/{config.seed}/{step}/{parent.turn_id}", j, cap) for parent, j in batch]
        chosen: list[list[float]] = []
        was_training = models.causal_lm.training
        models.causal_lm.eval()
        try:
            with gate_candidate(models) as model:
                answers, _ = probe_answers(model, prompts, caps, end_ids, uniforms=dice, temperature=temperature,
                                           sampled_logprobs=chosen)
        finally:
            models.causal_lm.train(was_training)
        for (parent, j), answer, logprobs in zip(batch, answers, chosen):
            if not answer:
                continue
            if len(logprobs) > len(answer):  # the model ended it: the end of turn is part of what it wrote (the
                answer = answer + [turn_end]   # log-prob is the end id it sampled, which may be another end id)
            out.append(_item(parent, answer, logprobs, -(len(out) + 1), j))
    return out


def _item(parent: TrainItem, answer: list[int], logprobs: list[float], turn_id: int, index: int) -> TrainItem:
    turn = dataclasses.replace(parent.turn, response_ids=list(answer), logprobs=list(logprobs), id=turn_id,
                               response_text="", finish_reason="stop")
    sample = dataclasses.replace(parent.sample, turn_id=turn_id, reward=0.0, kind=ROLLOUT_KIND, targets=None,
                                 info={"rollout_of": parent.turn_id, "rollout_index": index})
    return TrainItem(
        sample=sample,
        turn=turn,
        input_ids_L=torch.tensor(list(turn.prompt_ids) + list(answer), dtype=torch.long),
        prompt_len=len(turn.prompt_ids),
        response_ids_T=torch.tensor(answer, dtype=torch.long),
        behaviour_logprobs_T=torch.tensor(logprobs, dtype=torch.float32),
        temperature=parent.temperature,
        staleness=0,
    )
