"""The student moves toward the hinted teacher: OPD-only training raises the tokens the teacher prefers, in the
un-hinted context the policy actually answers in.

The teacher here is a fixed distribution (what a hint-conditioned teacher that names a target token would say):
probability 0.97 on the target token at each response position, the rest spread evenly. It is handed to the
trainer as a ``TeacherClient``; the sample also carries scores recorded at the starting policy's top-k, used
while the student's top-k set is the same and replaced by the teacher's answer at the new ids once it moves.
"""

from __future__ import annotations

import math

import pytest
import torch

from concurrent.futures import Future

from clawloop.store import SampleRecord, Store, TurnRecord
from clawloop.trainer.core import Trainer
from clawloop.wire import TeacherScores

from trainer_helpers import logprob_table, render

VOCAB = 49152
TOP, REST = math.log(0.97), math.log(0.03 / (VOCAB - 1))
MESSAGES = [{"role": "user", "content": "What is two plus two?"}]


def fixed_teacher(target_T: torch.Tensor):
    def logprobs(ids_T_K: torch.Tensor) -> torch.Tensor:
        return torch.where(ids_T_K == target_T[:, None], torch.tensor(TOP), torch.tensor(REST)).float()

    calls: list[int] = []
    teacher_ids_T_K = torch.stack([target_T] + [torch.full_like(target_T, 100 + j) for j in range(3)], dim=1)

    class FixedTeacher:
        timeout_s = 30.0

        def submit(self, requests):
            out = []
            for r in requests:
                assert r.hints == ["Answer with the word banana."]
                calls.append(r.student_ids_T_K.shape[0])
                out.append(TeacherScores(student_ids_T_K=r.student_ids_T_K, teacher_ids_C_T_K=teacher_ids_T_K[None],
                                         teacher_logprobs_C_T_K=logprobs(teacher_ids_T_K)[None],
                                         teacher_at_student_C_T_K=logprobs(r.student_ids_T_K)[None],
                                         hint_lens_C=torch.tensor([27])))
            future: Future = Future()
            future.set_result(out)
            return future

        def close(self):
            pass

    return logprobs, FixedTeacher(), calls


def add_opd_sample(store, prompt, response, behaviour_T, student_ids_T_K, teacher_ids_T_K, logprobs, version):
    targets = {
        "student_ids_T_K": student_ids_T_K,
        "teacher_ids_C_T_K": teacher_ids_T_K[None],
        "teacher_logprobs_C_T_K": logprobs(teacher_ids_T_K)[None],
        "teacher_at_student_C_T_K": logprobs(student_ids_T_K)[None],
        "hint_lens_C": torch.tensor([27]),
    }
    tid = store.add_turn(TurnRecord(session_id="s", turn_index=0, messages=MESSAGES, prompt_ids=prompt,
                                    response_ids=response, logprobs=behaviour_T.tolist(), temperature=0.6,
                                    top_p=1.0, policy_version=version))
    store.set_next_state(tid, [{"role": "user", "content": "No, say banana."}])
    store.claim_judgeable(1)
    store.put_sample(SampleRecord(turn_id=tid, reward=0.0, kind="opd", hints=["Answer with the word banana."],
                                  targets=targets))


def run(make_config, tiny_tokenizer, tmp_path, target_of, steps, **overrides):
    config = make_config(method="opd", rollout_batch_size=1, micro_batch_size=1, **overrides)
    store = Store(tmp_path / "store.sqlite")
    prompt = render(tiny_tokenizer, MESSAGES)
    response = list(tiny_tokenizer("Four.", add_special_tokens=False)["input_ids"]) + [2]
    trainer = Trainer(config, store, console=None)
    start_T_V = logprob_table(trainer.models.policy, prompt, response, 0.6)
    target_T = target_of(start_T_V)
    logprobs, teacher, calls = fixed_teacher(target_T)
    trainer.teacher = teacher
    # The stored student set is the one computed when the sample was judged: the starting policy's top-4.
    student_ids_T_K = start_T_V.topk(4).indices
    teacher_ids_T_K = torch.stack([target_T] + [torch.full_like(target_T, 100 + j) for j in range(3)], dim=1)
    behaviour_T = start_T_V.gather(1, torch.tensor(response)[:, None])[:, 0]

    def target_prob() -> torch.Tensor:
        return logprob_table(trainer.models.policy, prompt, response, 0.6).exp().gather(1, target_T[:, None])[:, 0]

    before = target_prob()
    for _ in range(steps):
        add_opd_sample(store, prompt, response, behaviour_T, student_ids_T_K, teacher_ids_T_K, logprobs,
                       trainer.policy_version)
        metrics = trainer.run_batch(*store.lease_samples(1))
        assert metrics["opd_applied"] == 1.0
    return before, target_prob(), metrics, calls


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_opd_raises_a_token_the_student_already_considers(make_config, tiny_tokenizer, tmp_path, lora):
    """Default OPD (student top-k subset): the teacher prefers the student's 3rd-ranked token at each position.
    Training on the un-hinted prompt makes it far more likely; as the student's top-k moves away from the set
    stored at judging time, the teacher is asked again at the new ids."""
    before, after, metrics, calls = run(
        make_config, tiny_tokenizer, tmp_path, lambda t_T_V: t_T_V.topk(4).indices[:, 2], steps=10,
        lora=lora, lr=1e-3 if lora else 1e-4)
    assert after.mean() > 5 * before.mean(), (before, after)
    assert after.max() > 0.3
    assert calls, "the teacher was never asked at the moved student top-k"
    assert metrics["teacher_asked"] == 1.0


def test_opd_teacher_subset_pulls_up_a_token_far_outside_the_student_top_k(make_config, tiny_tokenizer,
                                                                         tmp_path):
    """With the teacher's subset, a token the student gives ~1e-6 becomes the most likely one."""
    banana = tiny_tokenizer(" banana", add_special_tokens=False)["input_ids"][0]
    before, after, _, _ = run(
        make_config, tiny_tokenizer, tmp_path, lambda t_T_V: torch.full((t_T_V.shape[0],), banana), steps=10,
        subset_mode="teacher", lr=1e-3)
    assert before.max() < 1e-4
    assert after.min() > 0.5, after
