"""The teacher's width K' for the teacher-support term: a request names it, it crosses the wire, and the teacher
returns that many of its own most likely ids (the first k the same as a k-wide answer)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from clawloop.config import Config
from clawloop.renderers import chat_render_fn
from clawloop.store import TurnRecord
from clawloop.teacher import Teacher
from clawloop.wire import TeacherRequest, request_from_json, request_to_json


def _turn(chat_ids) -> TurnRecord:
    return TurnRecord(session_id="s", messages=[{"role": "user", "content": "Say hi."}],
                      prompt_ids=chat_ids("Say hi."), response_ids=[28, 905, 2], logprobs=[0.0] * 3,
                      temperature=0.7, top_p=1.0, policy_version=0, id=7)


def test_teacher_k_travels_in_the_request_codec_and_is_checked(chat_ids):
    request = TeacherRequest(_turn(chat_ids), ["Be brief."], torch.zeros(3, 4, dtype=torch.int64), 0.7,
                             teacher_k=16)
    back = request_from_json(request_to_json(request))
    assert back.teacher_k == 16
    body = request_to_json(request)
    del body["teacher_k"]  # a trainer from before the field: the teacher's own topk
    assert request_from_json(body).teacher_k == 0
    for bad in (-1, 5000, 2.5, "8", True):
        with pytest.raises(ValueError, match="teacher_k"):
            request_from_json({**body, "teacher_k": bad})


def test_the_teacher_answers_the_width_asked_for_most_likely_first(tiny_engine, tiny_tokenizer, chat_ids):
    teacher = Teacher(tiny_engine, chat_render_fn(tiny_tokenizer), Config(model="tiny", topk=4))
    turn = _turn(chat_ids)
    ids_T_K = torch.arange(12, dtype=torch.int64).view(3, 4)
    narrow, wide = asyncio.run(teacher.score([TeacherRequest(turn, ["Be brief."], ids_T_K, 0.7),
                                              TeacherRequest(turn, ["Be brief."], ids_T_K, 0.7, teacher_k=10)]))
    assert narrow.teacher_ids_C_T_K.shape == (1, 3, 4)
    assert wide.teacher_ids_C_T_K.shape == (1, 3, 10) and wide.teacher_logprobs_C_T_K.shape == (1, 3, 10)
    values = wide.teacher_logprobs_C_T_K
    assert (values[..., :-1] >= values[..., 1:]).all()
    assert torch.equal(wide.teacher_ids_C_T_K[..., :4], narrow.teacher_ids_C_T_K)
    torch.testing.assert_close(wide.teacher_at_student_C_T_K, narrow.teacher_at_student_C_T_K)
