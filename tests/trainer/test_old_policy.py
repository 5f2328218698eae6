"""The old-policy forward: exact old log-probs at the train temperature, the student side of the top-k
targets, recorded teacher scores reused only at the very same ids, and the teacher asked where they are not."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from clawloop.store import Store
from clawloop.trainer.batch import prepare_items
from clawloop.trainer.model import load_train_models
from clawloop.trainer.old_policy import TEACHER_MISSING, fill_old_side, match_rows
from clawloop.wire import TeacherScores

from trainer_helpers import HINTS, add_sample, logprob_table


class FakeTeacher:
    """A ``TeacherClient`` answering constant log-probs at whatever ids it is asked (its own top-k: ids 100..)."""

    timeout_s = 30.0

    def __init__(self, at_student=-2.0, at_response=-1.0):
        self.at_student, self.at_response, self.asked = at_student, at_response, []

    def submit(self, requests):
        self.asked.append(requests)
        out = []
        for r in requests:
            C, (T, K) = max(1, len(r.hints)), r.student_ids_T_K.shape
            own = torch.arange(100, 100 + K).expand(C, T, K).contiguous()
            out.append(TeacherScores(student_ids_T_K=r.student_ids_T_K, teacher_ids_C_T_K=own,
                                     teacher_logprobs_C_T_K=torch.full((C, T, K), -1.0),
                                     teacher_at_student_C_T_K=torch.full((C, T, K), self.at_student),
                                     hint_lens_C=torch.tensor([len(h) for h in r.hints] or [0]),
                                     teacher_token_logprobs_C_T=torch.full((C, T), self.at_response)))
        future = Future()
        future.set_result(out)
        return future

    def close(self):
        pass


def _items(store, config, version=0):
    lease_id, samples = store.lease_samples(100)
    items, drops, _ = prepare_items(store, samples, config, version)
    assert not drops
    _items.last_lease = lease_id
    return items


def test_old_side_matches_a_direct_forward_at_the_turn_temperature(make_config, base_model, tiny_tokenizer,
                                                                   tmp_path):
    config = make_config()
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, base_model, tiny_tokenizer, 0, hints=HINTS, temperature=0.6)
    add_sample(store, base_model, tiny_tokenizer, 1, hints=HINTS[:1], temperature=0.0)  # greedy turn
    models = load_train_models(config)
    items = _items(store, config)
    fill_old_side(models, items, config)
    for item, temperature in zip(items, (0.6, 1.0)):  # greedy is scored at 1.0
        assert item.temperature == temperature
        table_T_V = logprob_table(base_model, item.turn.prompt_ids, item.turn.response_ids, temperature)
        ids_T = torch.tensor(item.turn.response_ids)
        torch.testing.assert_close(item.old_logprobs_T, table_T_V.gather(1, ids_T[:, None])[:, 0],
                                   atol=1e-4, rtol=1e-4)
        t = item.targets
        torch.testing.assert_close(t.student_ids_T_K, table_T_V.topk(4).indices)
        torch.testing.assert_close(t.student_logprobs_T_K, table_T_V.topk(4).values, atol=1e-4, rtol=1e-4)
        for c in range(t.num_candidates):
            torch.testing.assert_close(t.old_at_teacher_C_T_K[c], table_T_V.gather(1, t.teacher_ids_C_T_K[c]),
                                       atol=1e-4, rtol=1e-4)
        # Same policy as at judging time: the stored teacher values at the student ids are reused as they are.
        torch.testing.assert_close(t.teacher_at_student_C_T_K, item.sample.targets["teacher_at_student_C_T_K"])
        assert item.info["teacher_reused"] == 1.0
        # Behaviour log-probs were produced by the same weights: the gap is ~0.
        assert item.info["behaviour_gap"] < 1e-4


def test_a_fixed_train_temperature_applies_to_every_sample(make_config, base_model, tiny_tokenizer, tmp_path):
    config = make_config(train_temperature=0.8)
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, base_model, tiny_tokenizer, 0, temperature=0.6)
    add_sample(store, base_model, tiny_tokenizer, 1, temperature=0.0)
    items = _items(store, config)
    fill_old_side(load_train_models(config), items, config)
    for item in items:
        assert item.temperature == 0.8
        table = logprob_table(base_model, item.turn.prompt_ids, item.turn.response_ids, 0.8)
        expected = table.gather(1, torch.tensor(item.turn.response_ids)[:, None])[:, 0]
        torch.testing.assert_close(item.old_logprobs_T, expected, atol=1e-4, rtol=1e-4)


def test_match_rows_finds_permutations_and_flags_changed_sets():
    new = torch.tensor([[5, 6, 7], [1, 2, 3]])
    stored = torch.tensor([[7, 5, 6], [1, 2, 9]])
    perm, matches = match_rows(new, stored)
    assert matches.tolist() == [True, False]
    assert perm[0].tolist() == [1, 2, 0]


def _store_with_edited_targets(store, base_model, tiny_tokenizer, edit):
    """One hinted sample whose stored targets were edited by ``edit``; returns a copy of what was stored."""
    stored = {}

    def keep(t):
        edit(t)
        stored.update({k: v.clone() for k, v in t.items()})

    add_sample(store, base_model, tiny_tokenizer, 0, hints=HINTS, edit_targets=keep)
    return stored


def test_same_set_in_another_order_reuses_the_stored_teacher_values(make_config, base_model, tiny_tokenizer,
                                                                    tmp_path):
    config = make_config()
    store = Store(tmp_path / "store.sqlite")

    def reverse(t):
        t["student_ids_T_K"] = t["student_ids_T_K"].flip(-1).contiguous()
        t["teacher_at_student_C_T_K"] = t["teacher_at_student_C_T_K"].flip(-1).contiguous()

    original = _store_with_edited_targets(store, base_model, tiny_tokenizer, reverse)
    items = _items(store, config)
    teacher = FakeTeacher()
    fill_old_side(load_train_models(config), items, config, teacher=teacher)
    assert not teacher.asked
    t = items[0].targets
    # Values follow their ids: re-flipping the stored ones gives the order of the new (descending) ids.
    torch.testing.assert_close(t.student_ids_T_K, original["student_ids_T_K"].flip(-1))
    torch.testing.assert_close(t.teacher_at_student_C_T_K, original["teacher_at_student_C_T_K"].flip(-1))


def test_a_moved_top_k_asks_the_teacher_or_leaves_the_opd_branch_out(make_config, base_model,
                                                                           tiny_tokenizer, tmp_path):
    config = make_config()
    store = Store(tmp_path / "store.sqlite")

    def replace_last_column(t):
        t["student_ids_T_K"] = t["student_ids_T_K"].clone()
        t["student_ids_T_K"][:, -1] = 40000  # an id outside today's top-4 at every position

    stored = _store_with_edited_targets(store, base_model, tiny_tokenizer, replace_last_column)
    models = load_train_models(config)

    # With a teacher: asked once, with today's ids and the hints in candidate order.
    items = _items(store, config)
    teacher = FakeTeacher(at_student=-3.0)
    fill_old_side(models, items, config, teacher=teacher)
    ((request,),) = teacher.asked
    t = items[0].targets
    assert request.hints == HINTS and request.temperature == 0.6
    torch.testing.assert_close(request.student_ids_T_K, t.student_ids_T_K)
    table = logprob_table(base_model, items[0].turn.prompt_ids, items[0].turn.response_ids, 0.6)
    assert torch.equal(t.student_ids_T_K, table.topk(4).indices)
    assert not (t.student_ids_T_K == 40000).any() and not (stored["student_ids_T_K"] == t.student_ids_T_K).all()
    assert (t.teacher_at_student_C_T_K == -3.0).all()
    assert items[0].info["teacher_asked"] == 1.0

    # Without a teacher: no stale set; the OPD branch is left out and said so.
    assert store.release_lease(_items.last_lease) == 1
    items = _items(store, config)
    fill_old_side(models, items, config)
    assert items[0].targets is None and items[0].info[TEACHER_MISSING] == 1.0
    assert items[0].old_logprobs_T is not None  # the rest of the old side is there


@pytest.mark.parametrize("mode", ["skip", "anchor"])
def test_unhinted_samples_get_targets_only_under_anchor(make_config, base_model, tiny_tokenizer, tmp_path, mode):
    config = make_config(method="hybrid", opd_on_unhinted=mode)
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0, anchor=True)  # rl sample, anchor targets
    items = _items(store, config)
    fill_old_side(load_train_models(config), items, config)
    assert (items[0].targets is not None) == (mode == "anchor")
    if mode == "anchor":
        assert items[0].targets.num_candidates == 1


def test_combine_takes_the_teacher_logprob_of_each_sampled_token(make_config, base_model, tiny_tokenizer,
                                                                 tmp_path):
    config = make_config(method="combine")
    store = Store(tmp_path / "store.sqlite")
    T_holder = {}

    def add_response_logprobs(t):
        C, T, _ = t["teacher_ids_C_T_K"].shape
        T_holder["value"] = torch.arange(C * T, dtype=torch.float32).reshape(C, T) * -0.1
        t["teacher_token_logprobs_C_T"] = T_holder["value"]

    _store_with_edited_targets(store, base_model, tiny_tokenizer, add_response_logprobs)
    items = _items(store, config)
    fill_old_side(load_train_models(config), items, config)
    item = items[0]
    # sequence_optimal picks one candidate for the whole response; its row is used.
    values = T_holder["value"]
    assert any(torch.allclose(item.teacher_logprobs_T, values[c]) for c in range(values.shape[0]))
    assert item.info["combine_teacher"] == 1.0

    # Asked instead: every teacher answer carries its log-probs at the sampled ids.
    store2 = Store(tmp_path / "store2.sqlite")
    add_sample(store2, base_model, tiny_tokenizer, 0, hints=HINTS, edit_targets=lambda t: t.clear())
    items = _items(store2, config)
    teacher = FakeTeacher(at_response=-1.5)
    fill_old_side(load_train_models(config), items, config, teacher=teacher)
    assert teacher.asked
    assert (items[0].teacher_logprobs_T == -1.5).all() and items[0].info["combine_teacher"] == 1.0
