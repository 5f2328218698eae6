"""The trainer asks the teacher once per sample, at the old policy's exact top-k ids: in-process (a real tiny HF
engine on a loop of its own) and over real HTTP (the admin teacher route), with the same tensors; a failing
teacher costs a sample its OPD branch only; and the step's numbers are bit-for-bit those of scores recorded
at the same ids."""

from __future__ import annotations

import httpx
import pytest
import torch

from clawloop.api.teacher_routes import mount_teacher_routes
from clawloop.config import Config
from clawloop.renderers import chat_render_fn
from clawloop.serve import Server
from clawloop.store import Store, TurnState
from clawloop.teacher import Teacher, inject_hint
from clawloop.trainer.batch import prepare_items
from clawloop.trainer.core import Trainer
from clawloop.trainer.model import load_train_models
from clawloop.trainer.old_policy import TEACHER_ERROR, TEACHER_MISSING, fill_old_side
from clawloop.trainer.publish import LocalVersion
from clawloop.trainer.step import EXCLUDED, make_optimizer, train_step
from clawloop.trainer.teacher_client import InProcessTeacher, RemoteTeacher
from tests.counting_engine import CountingEngine

from trainer_helpers import HINTS, TableTeacher, add_sample, logprob_table, render

ADMIN_KEY = "teacher-admin-key"


def unrecorded(t):
    t.clear()  # the sample as the pipeline writes it now: votes and hints, no teacher tensors


def _items(store, config):
    _, samples = store.lease_samples(100)
    items, drops, _ = prepare_items(store, samples, config, 0)
    assert not drops
    return items


def test_old_policy_pass_asks_the_teacher_once_per_sample_at_the_exact_top_k(make_config, base_model,
                                                                             tiny_tokenizer, tiny_engine, tmp_path):
    config = make_config(steps_per_batch=2)
    store = Store(tmp_path / "store.sqlite")
    for i in range(3):
        add_sample(store, base_model, tiny_tokenizer, i, reward=0.0 if i == 1 else 1.0, hints=HINTS[: 1 + i % 2],
                   edit_targets=unrecorded)
    add_sample(store, base_model, tiny_tokenizer, 3, reward=-1.0)  # RL only: no teacher call
    counting = CountingEngine(tiny_engine)
    client = InProcessTeacher(Teacher(counting, chat_render_fn(tiny_tokenizer), config))  # a loop of its own
    items = _items(store, config)
    try:
        fill_old_side(load_train_models(config), items, config, micro_batch_size=2, teacher=client)
    finally:
        client.close()
    hinted = [it for it in items if it.sample.hints]
    asked = [r for call in counting.calls for r in call]
    # one request per candidate of each hinted sample, each candidate once, at that sample's exact old top-k ids
    assert len(asked) == sum(len(it.sample.hints) for it in hinted)
    assert len(counting.calls) <= 2  # one engine call per micro-batch
    for it in hinted:
        table = logprob_table(base_model, it.turn.prompt_ids, it.turn.response_ids, it.temperature)
        exact_T_K = table.topk(4, dim=-1).indices
        mine = [r for r in asked if r.response_ids == list(it.turn.response_ids)]
        assert len(mine) == len(it.sample.hints)
        assert all(torch.equal(r.at_ids_T_K, exact_T_K) for r in mine)
        assert torch.equal(it.targets.student_ids_T_K, exact_T_K)
        assert it.info["teacher_asked"] == 1.0 and TEACHER_MISSING not in it.info
        # the teacher's own values, straight from its engine (prompt with the hint)
        for c, hint in enumerate(it.sample.hints):
            ref = logprob_table(base_model, render(tiny_tokenizer, inject_hint(it.turn.messages, hint)),
                                it.turn.response_ids, it.temperature)
            torch.testing.assert_close(it.targets.teacher_at_student_C_T_K[c], ref.gather(1, exact_T_K),
                                       atol=1e-4, rtol=1e-4)
        # record-only student side, for the sample's record
        assert it.scores.student_logprobs_T_K.shape == exact_T_K.shape
    rl_only = [it for it in items if not it.sample.hints]
    assert rl_only and all(it.targets is None and "teacher_asked" not in it.info for it in rl_only)


@pytest.fixture
def teacher_server(tiny_model_path, tmp_path):
    torch.set_num_threads(2)
    config = Config.from_dict(dict(model=str(tiny_model_path), device="cpu", run_dir=str(tmp_path / "api"),
                                   admin_key=ADMIN_KEY, port=0, train=False, num_threads=1, topk=4))
    srv = Server(config)
    srv.build()
    teacher = Teacher(srv.engine, chat_render_fn(srv.engine.tokenizer), config)
    mount_teacher_routes(srv.app, lambda: teacher, config)
    srv.start()
    try:
        yield srv, teacher
    finally:
        srv.stop()


def test_remote_teacher_over_http_gives_the_in_process_tensors(make_config, base_model, tiny_tokenizer,
                                                               teacher_server, tmp_path):
    srv, teacher = teacher_server
    config = make_config()
    store = Store(tmp_path / "store.sqlite")
    for i in range(2):
        add_sample(store, base_model, tiny_tokenizer, i, hints=HINTS[: 1 + i], edit_targets=unrecorded)
    models = load_train_models(config)

    remote = RemoteTeacher(srv.base_url, ADMIN_KEY, timeout_s=60, retries=1, backoff_s=0.01)
    local = InProcessTeacher(teacher)  # the server's engine, asked from a loop of this client's own
    try:
        by_client = {}
        for name, client in (("remote", remote), ("local", local)):
            items = _items(store, config)
            fill_old_side(models, items, config, teacher=client)
            by_client[name] = {it.turn_id: it for it in items}
            assert store.release_lease(items[0].sample.lease_id) == 2
    finally:
        remote.close()
        local.close()
    for turn_id, it in by_client["remote"].items():
        other = by_client["local"][turn_id]
        assert it.info["teacher_asked"] == 1.0
        for name, value in it.scores.tensors().items():
            assert torch.equal(value, other.scores.tensors()[name]), name  # bit-for-bit over the wire

    # The route is an admin route.
    response = httpx.post(srv.base_url + "/v1/trainer/teacher", json={"requests": []}, timeout=10)
    assert response.status_code == 401
    response = httpx.post(srv.base_url + "/v1/trainer/teacher", json={"requests": [{"hints": 3}]},
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    assert response.status_code == 400
    garbled = {"messages": [{"role": "user", "content": "hi"}], "prompt_ids": [1], "response_ids": [2],
               "temperature": 1.0, "hints": [], "student_ids": "bm90IHNhZmV0ZW5zb3Jz"}  # base64, not safetensors
    response = httpx.post(srv.base_url + "/v1/trainer/teacher", json={"requests": [garbled]},
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    assert response.status_code == 400 and "safetensors" in response.json()["error"]["message"]


def test_a_failing_teacher_costs_the_opd_branch_only(make_config, base_model, tiny_tokenizer, tmp_path):
    config = make_config(rollout_batch_size=3, micro_batch_size=3)
    store = Store(tmp_path / "store.sqlite")
    both = add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0, hints=HINTS, edit_targets=unrecorded)
    opd_only = add_sample(store, base_model, tiny_tokenizer, 1, reward=0.0, hints=HINTS, edit_targets=unrecorded)
    rl_only = add_sample(store, base_model, tiny_tokenizer, 2, reward=-1.0)
    teacher = TableTeacher(base_model, tiny_tokenizer, fail=True)
    trainer = Trainer(config, store, LocalVersion(), teacher=teacher, console=None)
    metrics = trainer.run_batch(*store.lease_samples(3))
    assert len(teacher.asked) == 1 and len(teacher.asked[0]) == 2  # both hinted samples, in one call
    assert metrics is not None and metrics["teacher_missing"] == 2.0 and metrics["teacher_asked"] == 0.0
    assert metrics["samples_dropped_teacher_error"] == 1.0
    assert store.get_turn(opd_only).state == TurnState.DROPPED and store.get_turn(opd_only).reason == TEACHER_ERROR
    trained = {s.turn_id for s in store.samples() if s.consumed_step == metrics["step"]}
    assert trained == {both, rl_only}  # the RL branch of the hinted sample still trained
    trainer.close()


@pytest.mark.parametrize("method", ["opd", "topk_kl"])
def test_without_a_grpo_branch_a_failing_teacher_drops_every_hinted_sample(method, make_config, base_model,
                                                                           tiny_tokenizer, tmp_path):
    """Under a method with no RL branch a voted sample whose teacher call failed has nothing left to train: it is
    dropped, never committed as trained (its loss would be a constant, the update none of its doing)."""
    config = make_config(rollout_batch_size=3, micro_batch_size=3, method=method)
    store = Store(tmp_path / "store.sqlite")
    thanked = add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0, hints=HINTS, edit_targets=unrecorded)
    corrected = add_sample(store, base_model, tiny_tokenizer, 1, reward=-1.0, hints=HINTS, edit_targets=unrecorded)
    unvoted = add_sample(store, base_model, tiny_tokenizer, 2, reward=0.0, hints=HINTS, edit_targets=unrecorded)
    trainer = Trainer(config, store, LocalVersion(), teacher=TableTeacher(base_model, tiny_tokenizer, fail=True),
                      console=None)
    trainer.run_batch(*store.lease_samples(3))
    for turn_id in (thanked, corrected, unvoted):
        turn = store.get_turn(turn_id)
        assert turn.state == TurnState.DROPPED and turn.reason == TEACHER_ERROR, (turn_id, turn.state, turn.reason)
    assert not [s for s in store.samples() if s.consumed_step is not None]
    trainer.close()


def test_step_numbers_are_bit_for_bit_those_of_scores_recorded_at_the_same_ids(make_config, base_model,
                                                                               tiny_tokenizer, tmp_path):
    """The same teacher values reach the objective whether the trainer asks for them (now) or finds them
    recorded at the very same ids (as the judging-time pipeline stored them when its set matched)."""
    results = {}
    for path in ("recorded", "asked"):
        for fuse in (True, False):
            config = make_config(method="hybrid", micro_batch_size=2, steps_per_batch=1 if fuse else 2)
            store = Store(tmp_path / f"{path}-{fuse}.sqlite")
            for i in range(3):
                add_sample(store, base_model, tiny_tokenizer, i, reward=(1.0, 0.0, -1.0)[i],
                           hints=HINTS[: 1 + i % 2], edit_targets=unrecorded if path == "asked" else None)
            torch.manual_seed(0)
            models = load_train_models(config)
            optimizer = make_optimizer(models, config)
            items = _items(store, config)
            teacher = TableTeacher(base_model, tiny_tokenizer) if path == "asked" else None
            metrics = train_step(models, optimizer, items, config, teacher=teacher)
            if teacher is not None:
                assert sum(len(call) for call in teacher.asked) == 3  # once per sample
            assert all(it.targets is not None and EXCLUDED not in it.info for it in items)
            weights = {k: v.detach().clone() for k, v in models.causal_lm.named_parameters() if v.requires_grad}
            results[(path, fuse)] = (metrics["loss"], metrics["grad_norm"], weights)
    for fuse in (True, False):
        a, b = results[("recorded", fuse)], results[("asked", fuse)]
        assert a[0] == b[0] and a[1] == b[1], (fuse, a[:2], b[:2])
        assert all(torch.equal(a[2][k], b[2][k]) for k in a[2])


def test_a_step_of_one_micro_batch_asks_the_teacher_from_the_loss_forward_with_the_same_update(
        make_config, base_model, tiny_tokenizer, tmp_path, monkeypatch):
    """One micro-batch: the top-k ids come from the loss's own forward and the teacher is asked before the loss,
    with no no-gradient forward first (on long prompts a whole decoder forward of the step); the teacher is asked
    the same ids once per sample and the update is bit for bit that of the separate top-k forward. With several
    micro-batches the separate forward stays, so each teacher call overlaps the next forward."""
    import clawloop.trainer.step as step_module

    separate_forwards = []
    real_topk_pass = step_module.topk_pass
    monkeypatch.setattr(step_module, "topk_pass",
                        lambda *a, **k: (separate_forwards.append(1), real_topk_pass(*a, **k))[1])
    results = {}
    for case, micro_batch_size, late in (("late", 4, None), ("separate", 4, False), ("several", 2, None)):
        config = make_config(method="hybrid", micro_batch_size=micro_batch_size)
        store = Store(tmp_path / f"{case}.sqlite")
        for i in range(3):
            add_sample(store, base_model, tiny_tokenizer, i, reward=(1.0, 0.0, -1.0)[i], hints=HINTS[: 1 + i % 2],
                       edit_targets=unrecorded)
        torch.manual_seed(0)
        models = load_train_models(config)
        optimizer = make_optimizer(models, config)
        items = _items(store, config)
        teacher = TableTeacher(base_model, tiny_tokenizer)
        separate_forwards.clear()
        metrics = train_step(models, optimizer, items, config, teacher=teacher, ask_in_loss_forward=late)
        asked = sorted((r.turn.id, r.student_ids_T_K.tolist()) for call in teacher.asked for r in call)
        assert len(asked) == 3  # once per sample
        assert all(it.targets is not None and EXCLUDED not in it.info for it in items)
        weights = {k: v.detach().clone() for k, v in models.causal_lm.named_parameters() if v.requires_grad}
        results[case] = (len(separate_forwards), asked, metrics["loss"], metrics["grad_norm"], weights)
    assert [results[c][0] for c in ("late", "separate", "several")] == [0, 1, 1]
    late, separate = results["late"], results["separate"]
    assert late[1] == separate[1] == results["several"][1]  # the same ids asked
    assert late[2] == separate[2] and late[3] == separate[3], (late[2:4], separate[2:4])
    assert all(torch.equal(late[4][k], separate[4][k]) for k in late[4])
