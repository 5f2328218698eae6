"""Synthetic samples and teacher scores for the training benchmarks (``train_step.py``, ``cuda_check.py``).

The benchmarks measure the step — forwards, objective, backward, optimizer — so the teacher's answer is made up
here rather than computed by a second model: ``RandomTeacher`` answers every request at exactly the ids it was
asked about (the old policy's top-k), with random log-probs, as fast as a dictionary. The step then runs the
whole hybrid objective, distillation branch included, and its own teacher wait (``time_teacher_wait_s``) stays
near zero. What a real teacher costs is a forward of the teacher model per hint; ``benchmarks/engines.py``
measures scoring.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from clawloop.store import SampleRecord, Store, TurnRecord
from clawloop.wire import TeacherRequest, TeacherScores

FILLER = ("The quick brown fox jumps over the lazy dog while the committee reviews the quarterly report, "
          "and the team agrees on three actions with one owner each. ")
HINTS = ["Keep it to three bullet points.", "Mention the decision and the owner of each action."]


class RandomTeacher:
    """A ``TeacherClient`` with random scores at the asked ids (see the module docstring)."""

    timeout_s = 60.0

    def __init__(self, vocab_size: int, topk: int, seed: int = 0):
        self.vocab_size, self.topk = vocab_size, topk
        self.generator = torch.Generator().manual_seed(seed)

    def submit(self, requests: list[TeacherRequest]) -> Future[list[TeacherScores]]:
        answer: Future[list[TeacherScores]] = Future()
        answer.set_result([self.score(r) for r in requests])
        return answer

    def score(self, request: TeacherRequest) -> TeacherScores:
        ids_T_K = request.student_ids_T_K.to(torch.int64)
        C, (T, K) = max(1, len(request.hints)), ids_T_K.shape
        g, k = self.generator, self.topk
        teacher_ids = torch.stack([torch.randperm(self.vocab_size, generator=g)[:k] for _ in range(C * T)])
        return TeacherScores(
            student_ids_T_K=ids_T_K.contiguous(),
            teacher_ids_C_T_K=teacher_ids.reshape(C, T, k),
            teacher_logprobs_C_T_K=-torch.rand(C, T, k, generator=g).sort(-1).values * 4,
            teacher_at_student_C_T_K=-torch.rand(C, T, K, generator=g) * 8,
            hint_lens_C=torch.tensor([len(h) for h in request.hints] or [0], dtype=torch.int64))

    def close(self) -> None:
        pass


def add_sample(store: Store, prompt: list[int], response: list[int], messages: list[dict], index: int,
               hinted: bool, reward: float) -> int:
    """One judged turn with its sample: hints (``rl+opd``) or not (``rl``)."""
    tid = store.add_turn(TurnRecord(session_id=f"s{index}", messages=messages, prompt_ids=prompt,
                                    response_ids=response, logprobs=[-1.0] * len(response), temperature=0.6,
                                    top_p=1.0, policy_version=0))
    store.set_next_state(tid, [{"role": "user", "content": "please fix it"}])
    store.claim_judgeable(1)
    hints = list(HINTS) if hinted else []
    store.put_sample(SampleRecord(turn_id=tid, reward=reward, kind="rl+opd" if hints else "rl", hints=hints))
    return tid


def write_samples(store: Store, tokenizer, n: int, tokens: int) -> None:
    """``n`` samples of real chat prompts and ``tokens``-token responses of real text: every other one hinted."""
    text_ids = tokenizer(FILLER * (tokens // 20 + 2), add_special_tokens=False)["input_ids"]
    for i in range(n):
        messages = [{"role": "user", "content": f"Question {i}: summarise the meeting notes."}]
        prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
        response = list(text_ids[i:i + tokens - 1]) + [tokenizer.eos_token_id]
        add_sample(store, prompt, response, messages, i, hinted=i % 2 == 0, reward=1.0 if i % 3 else -1.0)
