"""Helpers for trainer tests: real turns of the tiny model in a real store, and teacher targets.

* ``add_sample(store, model, tokenizer, i, ...)`` — writes one served turn (real chat-template prompt,
  real tokenizer ids for the answer, behaviour log-probs scored by ``model`` at the turn's temperature), moves it
  through the store's states to ``ready`` with a ``SampleRecord``. Hinted samples get teacher targets computed
  by ``model`` on the hint-augmented prompt (a frozen base teacher, as by default).
* ``TableTeacher(model, tokenizer)`` — a teacher client answering from ``model``'s full log-prob tables under the
  hinted prompts, counting its calls.
* ``add_owned_sample(store, tokenizer, owner, question, answer, reward)`` — one ``rl`` sample of a user (per-user
  key name ``owner``), with placeholder behaviour log-probs.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from tests.losses_support import build_topk_targets
from clawloop.store import SampleRecord, Store, TurnRecord
from clawloop.teacher import inject_hint
from clawloop.wire import TeacherScores

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about rain.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Name a colour of the sky.",
    "Say hello in Spanish.",
    "What is two plus two?",
    "Give me a synonym for quick.",
]
ANSWERS = [
    "Paris is the capital.",
    "Rain on the roof, soft.",
    "Two, three and five.",
    "Use reversed or slicing.",
    "Blue, most days.",
    "Hola!",
    "Four.",
    "Fast.",
]
HINTS = ["Answer in one short sentence.", "Mention the exact number and nothing else."]


def render(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


@torch.no_grad()
def logprob_table(model, prompt_ids: list[int], response_ids: list[int], temperature: float) -> torch.Tensor:
    """[T, V] log-softmax(logits / τ) at the positions predicting each response token."""
    ids = torch.tensor([prompt_ids + response_ids])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:len(prompt_ids) - 1 + len(response_ids)]
    return torch.log_softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)


def teacher_tensors(model, tokenizer, messages, prompt_ids, response_ids, hints, temperature, k=4):
    """What the pipeline stores for a hinted sample, computed with ``model`` as the frozen teacher."""
    student_T_V = logprob_table(model, prompt_ids, response_ids, temperature)
    if hints:
        tables = [logprob_table(model, render(tokenizer, inject_hint(messages, h)), response_ids, temperature)
                  for h in hints]
    else:  # anchor: the un-hinted prompt
        tables = [student_T_V]
    t = build_topk_targets(student_T_V, torch.stack(tables), k)
    return {
        "student_ids_T_K": t.student_ids_T_K,
        "teacher_ids_C_T_K": t.teacher_ids_C_T_K,
        "teacher_logprobs_C_T_K": t.teacher_logprobs_C_T_K,
        "teacher_at_student_C_T_K": t.teacher_at_student_C_T_K,
        "hint_lens_C": torch.tensor([len(h) for h in hints] if hints else [0]),
    }


def add_sample(store: Store, model, tokenizer, i: int, *, reward: float = 1.0, hints=(), version: int = 0,
               temperature: float = 0.6, anchor: bool = False, behaviour_shift: float = 0.0,
               answer: str | None = None, edit_targets=None) -> int:
    q = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (#{i})")
    messages = [{"role": "user", "content": q}]
    prompt_ids = render(tokenizer, messages)
    text = answer if answer is not None else ANSWERS[i % len(ANSWERS)]
    response_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [2]
    table = logprob_table(model, prompt_ids, response_ids, temperature)
    behaviour = (table.gather(1, torch.tensor(response_ids)[:, None])[:, 0] + behaviour_shift).tolist()
    turn = TurnRecord(session_id=f"s{i}", turn_index=0, messages=messages, prompt_ids=prompt_ids,
                      response_ids=response_ids, logprobs=behaviour, temperature=temperature, top_p=1.0,
                      policy_version=version, response_text=text,
                      assistant_message={"role": "assistant", "content": text})
    tid = store.add_turn(turn)
    assert store.set_next_state(tid, [{"role": "user", "content": "ok, thanks"}])
    claimed = store.claim_judgeable(1)
    assert [t.id for t in claimed] == [tid]
    hints = list(hints)
    targets = None
    if hints or anchor:
        targets = teacher_tensors(model, tokenizer, messages, prompt_ids, response_ids, hints,
                                  temperature if temperature > 0 else 1.0)
    if targets is not None and edit_targets is not None:
        edit_targets(targets)  # e.g. a provisional student set computed by an older policy
    kind = ("rl+opd" if reward else "opd") if hints else "rl"
    assert store.put_sample(SampleRecord(turn_id=tid, reward=reward, kind=kind, hints=hints, targets=targets))
    return tid


def train_steps(config, store: Store, model, tokenizer, steps: int = 2):
    """A ``Trainer`` (``LocalVersion`` engine) after ``steps`` committed steps of two samples each, rewards
    alternating, on a store given ``2 * steps + 2`` samples (two are left ready)."""
    from clawloop.trainer.core import Trainer
    from clawloop.trainer.publish import LocalVersion

    for i in range(2 * steps + 2):
        add_sample(store, model, tokenizer, i, reward=1.0 if i % 2 else -1.0)
    trainer = Trainer(config, store, LocalVersion(), console=None)
    for _ in range(steps):
        trainer.run_batch(*store.lease_samples(2))
    return trainer


def add_owned_sample(store: Store, tokenizer, owner: str, question: str, answer: str, reward: float) -> int:
    messages = [{"role": "user", "content": question}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    response = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    tid = store.add_turn(TurnRecord(session_id=f"{owner}-{question}", owner=owner, messages=messages,
                                    prompt_ids=prompt, response_ids=response, logprobs=[-1.0] * len(response),
                                    temperature=1.0, top_p=1.0, policy_version=0, response_text=answer))
    store.set_next_state(tid, [{"role": "user", "content": "Thanks." if reward > 0 else "No."}])
    store.claim_judgeable(1)
    assert store.put_sample(SampleRecord(turn_id=tid, reward=reward, kind="rl"))
    return tid


class TableTeacher:
    """A ``TeacherClient`` answering from full log-prob tables of ``model`` under the hinted prompts (what the
    trainer helpers record with a sample), counting its calls; ``fail`` makes every call raise."""

    timeout_s = 30.0

    def __init__(self, model, tokenizer, k=4, fail=False):
        self.model, self.tokenizer, self.k, self.fail = model, tokenizer, k, fail
        self.asked = []

    def submit(self, requests):
        future: Future = Future()
        self.asked.append(requests)
        if self.fail:
            future.set_exception(RuntimeError("teacher out of memory"))
            return future
        out = []
        for r in requests:
            prompts = [render(self.tokenizer, inject_hint(r.turn.messages, h)) for h in r.hints] or \
                [list(r.turn.prompt_ids)]
            tables = torch.stack([logprob_table(self.model, p, list(r.turn.response_ids), r.temperature)
                                  for p in prompts])
            top = tables.topk(self.k, dim=-1)
            C = tables.shape[0]
            out.append(TeacherScores(
                student_ids_T_K=r.student_ids_T_K, teacher_ids_C_T_K=top.indices, teacher_logprobs_C_T_K=top.values,
                teacher_at_student_C_T_K=tables.gather(-1, r.student_ids_T_K.unsqueeze(0).expand(C, -1, -1)),
                hint_lens_C=torch.tensor([len(h) for h in r.hints] or [0])))
        future.set_result(out)
        return future

    def close(self):
        pass
