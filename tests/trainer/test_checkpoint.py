"""Checkpoints and resume: weights, optimizer, step and version come back; samples of steps after the
checkpoint train again exactly once; a half-written checkpoint is never loaded."""

from __future__ import annotations

import json

import pytest
import torch

from clawloop.store import Store, TurnState
from clawloop.trainer import checkpoint as ckpt
from clawloop.trainer.core import Trainer
from clawloop.trainer.metrics import read_metrics
from clawloop.trainer.publish import LocalVersion

from trainer_helpers import HINTS, add_sample


def _optimizer_tensors(optimizer):
    return [t.clone() for state in optimizer.state_dict()["state"].values() for t in state.values()
            if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_restores_state_and_accounting_is_exact(make_config, base_model, tiny_tokenizer, tmp_path, lora):
    config = make_config(method="hybrid", lora=lora, rollout_batch_size=2, checkpoint_every=2)
    db = tmp_path / "store.sqlite"
    store = Store(db)
    turn_ids = [add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i % 2 else -1.0,
                           hints=HINTS if i % 3 == 0 else ()) for i in range(10)]

    first = Trainer(config, store, LocalVersion(), console=None)
    first.run_batch(*store.lease_samples(2))
    first.run_batch(*store.lease_samples(2))  # step 2: checkpoint written
    at_checkpoint = [p.detach().clone() for p in first.models.trainable_parameters()]
    optimizer_at_checkpoint = _optimizer_tensors(first.optimizer)
    first.run_batch(*store.lease_samples(2))  # step 3: committed, not checkpointed
    lost = store.steps()[-1]["turn_ids"]
    store.lease_samples(2)  # a step in flight when the process dies
    assert ckpt.latest_checkpoint_path(config.run_dir).name == "step_2"
    del first  # "kill -9": no stop, no final checkpoint
    store.close()

    store = Store(db)
    store.recover()  # what a restarted server does first: the in-flight lease comes back
    second = Trainer(config, store, LocalVersion(), console=None)
    resumed = second.resume()
    assert resumed == {"step": 2, "requeued": 2, "policy_version": 2}
    # The weights are step 2's; the numbering goes on after the lost step 3, whose row stays (marked requeued).
    assert second.step == 3 and second.policy_version == 2 and second.engine.policy_version == 2
    for a, b in zip(at_checkpoint, second.models.trainable_parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    for a, b in zip(optimizer_at_checkpoint, _optimizer_tensors(second.optimizer)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert second.optimizer.state_dict()["state"][0]["step"] == 2
    for tid in lost:  # the lost step's samples are ready again
        assert store.get_turn(tid).state == TurnState.READY
    assert store.ready_count() == 6

    while store.ready_count():
        second.run_batch(*store.lease_samples(2))
    second.checkpoint_if_due(force=True)

    steps = store.steps()
    assert [(s["step"], s["requeued"]) for s in steps] == [(1, False), (2, False), (3, True), (4, False),
                                                           (5, False), (6, False)]
    assert steps[2]["turn_ids"] == lost  # the lost step's record is kept
    trained = [tid for s in store.steps(in_weights_only=True) for tid in s["turn_ids"]]
    assert sorted(trained) == sorted(turn_ids)  # every sample exactly once: none twice, none skipped
    assert store.count_samples() == {TurnState.CONSUMED: 10}
    # Version 3 was served by the lost step's weights: it names those weights forever, so the resumed run's
    # versions go on from 4.
    assert [s["policy_version"] for s in steps] == [1, 2, 3, 4, 5, 6]
    # Only the newest two checkpoints are kept; latest names the final one.
    names = sorted(p.name for p in ckpt.checkpoints_dir(config.run_dir).iterdir() if p.name.startswith("step_"))
    assert names == ["step_4", "step_6"]  # due two steps after the resumed checkpoint, then the final one
    state = json.loads((ckpt.latest_checkpoint_path(config.run_dir) / "state.json").read_text())
    assert state["step"] == 6 and state["policy_version"] == 6 and state["lora"] == lora
    # metrics.jsonl is append-only and every step number appears once: the lost step 3, then the resumed ones.
    assert [m["step"] for m in read_metrics(config.run_dir)] == [1, 2, 3, 4, 5, 6]


def test_resume_without_a_checkpoint_requeues_everything(make_config, base_model, tiny_tokenizer, tmp_path):
    config = make_config(method="rl", checkpoint_every=100)
    store = Store(tmp_path / "store.sqlite")
    for i in range(4):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0)
    first = Trainer(config, store, LocalVersion(), console=None)
    first.run_batch(*store.lease_samples(2))
    second = Trainer(config, store, LocalVersion(), console=None)
    assert second.step == 1  # without resume, numbering continues the store's
    assert second.resume() == {"step": 0, "requeued": 2}
    assert store.ready_count() == 4 and second.step == 1  # the numbering still goes on
    assert [(s["step"], s["requeued"]) for s in store.steps()] == [(1, True)]


def test_a_half_written_checkpoint_is_never_loaded(tmp_path):
    weights = {"w": torch.ones(3)}
    ckpt.save_checkpoint(tmp_path, 1, 1, weights, None)
    # A crash during the next write leaves a temporary folder and the old pointer.
    partial = ckpt.checkpoints_dir(tmp_path) / ".tmp-step_2-deadbeef"
    partial.mkdir()
    (partial / "weights.safetensors").write_bytes(b"trunc")
    found = ckpt.load_latest(tmp_path)
    assert found.step == 1 and torch.equal(found.weights["w"], torch.ones(3))
    ckpt.save_checkpoint(tmp_path, 2, 2, {"w": torch.zeros(3)}, {"state": {}, "param_groups": []})
    assert not partial.exists()
    found = ckpt.load_latest(tmp_path)
    assert found.step == 2 and found.optimizer == {"state": {}, "param_groups": []}
    # A pointer to a folder that is not a complete checkpoint is not followed: resume falls back to the newest
    # complete one (and says so, tests/trainer/test_damaged_checkpoints.py), never to a silent fresh start.
    (ckpt.checkpoints_dir(tmp_path) / "latest").write_text("step_7\n")
    with pytest.raises(RuntimeError, match="not a complete checkpoint"):
        ckpt.latest_checkpoint_path(tmp_path)
    assert ckpt.load_latest(tmp_path).step == 2


def test_checkpoint_of_a_different_mode_is_refused(make_config, base_model, tiny_tokenizer, tmp_path):
    store = Store(tmp_path / "store.sqlite")
    for i in range(2):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0)
    full = Trainer(make_config(method="rl"), store, LocalVersion(), console=None)
    full.run_batch(*store.lease_samples(2))
    full.save_checkpoint()
    lora = Trainer(make_config(method="rl", lora=True), store, LocalVersion(), console=None)
    with pytest.raises(RuntimeError, match="lora"):
        lora.resume()
