"""The mixed distillation targets (``opd_target``): which positions take the hinted row, and a teacher that
answers each candidate's rows from its hinted prompt there and from the un-hinted prompt elsewhere."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from clawloop.config import Config, ConfigError
from clawloop.engines.base import SamplingParams, ScoreRequest
from clawloop.losses import hinted_positions, mix_rows
from clawloop.renderers import chat_render_fn
from clawloop.store import TurnRecord
from clawloop.teacher import OPENING_TOKENS, Teacher
from clawloop.trainer.old_policy import recorded_at
from clawloop.wire import TeacherRequest, request_from_json, request_to_json

END = torch.tensor([2, 9])


def test_the_rules_pick_the_opening_and_the_ends():
    # Candidate 0 opens differently for two positions and would end at position 4; candidate 1 agrees at once.
    hinted_C_T = torch.tensor([[5, 6, 7, 8, 2, 4],
                               [1, 6, 3, 9, 5, 4]])
    plain_T = torch.tensor([1, 3, 7, 3, 5, 4])
    assert hinted_positions(hinted_C_T, plain_T, END, "hinted").all()
    assert hinted_positions(hinted_C_T, plain_T, END, "end").tolist() == [
        [False, False, False, False, True, False],
        [False, False, False, True, False, False]]
    # opening: before the first agreement (candidate 0 agrees first at position 2, candidate 1 at position 0);
    # a later disagreement (candidate 1 at positions 1 and 2) is not the opening.
    assert hinted_positions(hinted_C_T, plain_T, END, "opening_end").tolist() == [
        [True, True, False, False, True, False],
        [False, False, False, True, False, False]]
    with pytest.raises(ValueError, match="opd_target"):
        hinted_positions(hinted_C_T, plain_T, END, "sometimes")


def test_mix_rows_takes_whole_rows_per_position():
    hinted_C_T_K = torch.arange(24, dtype=torch.float32).view(2, 3, 4)
    plain_T_K = -torch.ones(3, 4)
    use_C_T = torch.tensor([[True, False, True], [False, False, True]])
    mixed = mix_rows(hinted_C_T_K, plain_T_K, use_C_T)
    for c in range(2):
        for t in range(3):
            expected = hinted_C_T_K[c, t] if use_C_T[c, t] else plain_T_K[t]
            assert torch.equal(mixed[c, t], expected)


def test_the_setting_is_checked():
    assert Config(model="tiny").opd_target == "hinted"
    Config(model="tiny", opd_target="opening_end").validate()
    with pytest.raises(ConfigError, match="opd_target"):
        Config(model="tiny", opd_target="stop").validate()


def _turn(chat_ids) -> TurnRecord:
    return TurnRecord(session_id="s", messages=[{"role": "user", "content": "Say hi."}],
                      prompt_ids=chat_ids("Say hi."), response_ids=[28, 905, 311, 2003, 2], logprobs=[0.0] * 5,
                      temperature=0.7, top_p=1.0, policy_version=0, id=7)


def test_the_teacher_mixes_each_candidates_rows_with_the_unhinted_prompts(tiny_engine, tiny_tokenizer, chat_ids):
    hints = ["Be brief.", "Answer in one short sentence."]
    turn = _turn(chat_ids)
    ids_T_K = torch.arange(20, dtype=torch.int64).view(5, 4)
    render = chat_render_fn(tiny_tokenizer)
    plain_teacher = Teacher(tiny_engine, render, Config(model="tiny", topk=4))
    hinted, plain = asyncio.run(plain_teacher.score([TeacherRequest(turn, hints, ids_T_K, 0.7),
                                                     TeacherRequest(turn, [], ids_T_K, 0.7)]))
    # End ids chosen so that the rule has something to find: candidate 0's most likely id at position 3.
    end_ids = [int(hinted.teacher_ids_C_T_K[0, 3, 0])]
    teacher = Teacher(tiny_engine, render, Config(model="tiny", topk=4), tokenizer=tiny_tokenizer)
    teacher.end_ids = torch.tensor(end_ids)
    for target in ("end", "opening_end"):
        (mixed,) = asyncio.run(teacher.score([TeacherRequest(turn, hints, ids_T_K, 0.7, target=target)]))
        use_C_T = hinted_positions(hinted.teacher_ids_C_T_K[..., 0], plain.teacher_ids_C_T_K[0, :, 0],
                                   torch.tensor(end_ids), target)
        assert use_C_T[0, 3]
        if target == "end":  # (the random model's two rows never agree, so its opening is the whole answer)
            assert not use_C_T.all()
        assert mixed.hinted_C_T is not None and torch.equal(mixed.hinted_C_T.bool(), use_C_T)
        assert torch.equal(mixed.hint_lens_C, hinted.hint_lens_C)  # the un-hinted row is not a candidate
        for field in ("teacher_ids_C_T_K", "teacher_logprobs_C_T_K", "teacher_at_student_C_T_K"):
            got, h, p = getattr(mixed, field), getattr(hinted, field), getattr(plain, field)
            assert got.shape == h.shape
            for c in range(len(hints)):
                for t in range(5):
                    torch.testing.assert_close(got[c, t], h[c, t] if use_C_T[c, t] else p[0, t], rtol=0, atol=1e-5)
    # The un-hinted anchor has nothing to mix: the same answer as with the hinted target.
    (anchor,) = asyncio.run(teacher.score([TeacherRequest(turn, [], ids_T_K, 0.7, target="end")]))
    assert anchor.hinted_C_T is None
    torch.testing.assert_close(anchor.teacher_logprobs_C_T_K, plain.teacher_logprobs_C_T_K, rtol=0, atol=1e-5)


def test_a_mixed_target_needs_end_ids_and_a_known_rule(tiny_engine, tiny_tokenizer, chat_ids):
    turn = _turn(chat_ids)
    ids_T_K = torch.zeros(5, 4, dtype=torch.int64)
    no_ends = Teacher(tiny_engine, chat_render_fn(tiny_tokenizer), Config(model="tiny", topk=4))
    with pytest.raises(ValueError, match="end an answer"):
        asyncio.run(no_ends.score([TeacherRequest(turn, ["Be brief."], ids_T_K, 0.7, target="end")]))
    with pytest.raises(ValueError, match="target"):
        asyncio.run(no_ends.score([TeacherRequest(turn, ["Be brief."], ids_T_K, 0.7, target="sometimes")]))
    with pytest.raises(ValueError, match="end an answer"):
        asyncio.run(no_ends.answer(turn, "Be brief.", SamplingParams(temperature=0.0, max_tokens=4), "end"))


def test_a_mixed_answer_has_the_unhinted_content_and_stops_where_the_hinted_prompt_would(tiny_engine,
                                                                                          tiny_tokenizer, chat_ids):
    turn = _turn(chat_ids)
    hint = "Be brief."
    teacher = Teacher(tiny_engine, chat_render_fn(tiny_tokenizer), Config(model="tiny", topk=4),
                      tokenizer=tiny_tokenizer)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    plain = asyncio.run(tiny_engine.generate(list(turn.prompt_ids), greedy)).token_ids
    hinted_prompt = teacher.prompt_ids(turn, hint)
    (scored,) = asyncio.run(tiny_engine.score([ScoreRequest(prompt_ids=hinted_prompt, response_ids=plain, top_k=1)]))
    hinted_top = scored.topk_ids_T_K[:, 0].tolist()
    # Make the hinted prompt's choice at position 3 of the un-hinted answer the "end" token: the mixed answer is
    # the un-hinted one up to the first position where the hinted prompt ranks that token first, then that token.
    stop = hinted_top[3]
    cut = hinted_top.index(stop)
    assert stop not in plain[:cut]
    teacher.end_ids = torch.tensor([stop])
    mixed = asyncio.run(teacher.answer(turn, hint, greedy, "end"))
    assert mixed.token_ids == plain[:cut] + [stop]
    assert mixed.finish_reason == "stop" and len(mixed.logprobs) == len(mixed.token_ids)
    assert mixed.text == tiny_tokenizer.decode(plain[:cut], skip_special_tokens=True)
    # opening_end: the hinted prompt's own first tokens, up to where the un-hinted prompt ranks the same token
    # first, then the un-hinted prompt goes on from them.
    first = asyncio.run(tiny_engine.generate(hinted_prompt, replace(greedy, max_tokens=OPENING_TOKENS))).token_ids
    (plain_scored,) = asyncio.run(tiny_engine.score([ScoreRequest(prompt_ids=list(turn.prompt_ids),
                                                                  response_ids=first, top_k=1)]))
    agree = [a == b for a, b in zip(first, plain_scored.topk_ids_T_K[:, 0].tolist())] + [True]
    opening = first[:agree.index(True)]
    assert opening  # the random model's two rows disagree on the first token
    teacher.end_ids = torch.tensor([tiny_tokenizer.eos_token_id])
    mixed = asyncio.run(teacher.answer(turn, hint, greedy, "opening_end"))
    rest = asyncio.run(tiny_engine.generate(list(turn.prompt_ids) + opening,
                                            replace(greedy, max_tokens=12 - len(opening)))).token_ids
    full = opening + rest
    assert mixed.token_ids == full[:len(mixed.token_ids)] or mixed.token_ids[:-1] == full[:len(mixed.token_ids) - 1]
    assert len(mixed.token_ids) > len(opening)


def test_the_target_travels_in_the_request_codec(chat_ids):
    request = TeacherRequest(_turn(chat_ids), ["Be brief."], torch.zeros(5, 4, dtype=torch.int64), 0.7,
                             target="opening_end")
    body = request_to_json(request)
    assert request_from_json(body).target == "opening_end"
    del body["target"]  # a trainer from before the field
    assert request_from_json(body).target == "hinted"


def test_recorded_scores_are_reused_only_under_the_same_kind_of_target(tiny_engine, tiny_tokenizer, chat_ids):
    turn = _turn(chat_ids)
    ids_T_K = torch.arange(20, dtype=torch.int64).view(5, 4)
    teacher = Teacher(tiny_engine, chat_render_fn(tiny_tokenizer), Config(model="tiny", topk=4),
                      tokenizer=tiny_tokenizer)
    plain, mixed = asyncio.run(teacher.score([TeacherRequest(turn, ["Be brief."], ids_T_K, 0.7),
                                              TeacherRequest(turn, ["Be brief."], ids_T_K, 0.7, target="end")]))
    for recorded, mixed_wanted, reused in ((plain, False, True), (plain, True, False),
                                           (mixed, True, True), (mixed, False, False)):
        item = SimpleNamespace(recorded_scores=recorded)  # all recorded_at reads of a TrainItem
        assert (recorded_at(item, ids_T_K, 4, mixed=mixed_wanted) is not None) == reused
