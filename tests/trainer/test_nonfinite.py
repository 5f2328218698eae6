"""Non-finite numbers stay with the sample that made them, and an update that moved nothing is never a version.

One sample with a NaN in its stored teacher targets (a teacher engine that answered NaN) used to turn the whole
batch's gradient into NaN: the update was skipped, every sample of the batch was still marked consumed (other
users' feedback lost), and the unchanged weights were published as a new version.
"""

from __future__ import annotations

import torch

from clawloop.store import Store, TurnState
from clawloop.trainer.core import Trainer
from clawloop.trainer.model import trainable_state_dict
from clawloop.trainer.publish import LocalVersion
from clawloop.trainer.step import NONFINITE_LOSS, UPDATE_SKIPPED

from trainer_helpers import HINTS, add_sample


def poison(targets):
    targets["teacher_logprobs_C_T_K"][:, 1] = float("nan")
    targets["teacher_at_student_C_T_K"][:, 1] = float("nan")


def weights_of(trainer):
    return {k: v.clone() for k, v in trainable_state_dict(trainer.models).items()}


def moved(before, after):
    return any(not torch.equal(before[k], after[k]) for k in before)


def test_a_sample_with_a_nonfinite_loss_is_dropped_and_the_rest_of_the_batch_trains(
        make_config, base_model, tiny_tokenizer, tmp_path):
    config = make_config(method="hybrid", rollout_batch_size=3, micro_batch_size=3)
    store = Store(tmp_path / "store.sqlite")
    bad = add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0, hints=HINTS, edit_targets=poison)
    good = [add_sample(store, base_model, tiny_tokenizer, 1, reward=1.0, hints=HINTS),
            add_sample(store, base_model, tiny_tokenizer, 2, reward=-1.0)]
    trainer = Trainer(config, store, LocalVersion(), console=None)
    before = weights_of(trainer)

    metrics = trainer.run_batch(*store.lease_samples(3))

    assert metrics is not None and metrics["updates_applied"] == 1.0 and metrics["samples_excluded_nonfinite"] == 1.0
    assert store.get_turn(bad).state == TurnState.DROPPED and store.get_turn(bad).reason == NONFINITE_LOSS
    (step,) = store.steps()
    assert sorted(step["turn_ids"]) == sorted(good)
    assert all(store.get_turn(t).state == TurnState.CONSUMED for t in good)
    assert moved(before, weights_of(trainer))
    assert all(torch.isfinite(v).all() for v in weights_of(trainer).values())
    assert trainer.policy_version == 1


def test_a_step_that_changed_no_weight_is_not_committed_or_published(make_config, base_model, tiny_tokenizer,
                                                                    tmp_path):
    config = make_config(method="opd", rollout_batch_size=2)
    store = Store(tmp_path / "store.sqlite")
    bad = [add_sample(store, base_model, tiny_tokenizer, i, reward=1.0, hints=HINTS, edit_targets=poison)
           for i in (0, 1)]
    engine = LocalVersion()
    trainer = Trainer(config, store, engine, console=None)
    before = weights_of(trainer)

    assert trainer.run_batch(*store.lease_samples(2)) is None

    assert store.steps() == [] and trainer.step == 0
    assert trainer.policy_version == 0 and engine.policy_version == 0
    assert [v["version"] for v in store.versions() if v["status"] == "accepted"] in ([], [0])
    assert not moved(before, weights_of(trainer))
    assert {store.get_turn(t).reason for t in bad} == {NONFINITE_LOSS}


def test_an_update_skipped_as_nonfinite_gives_its_samples_back_once(make_config, base_model, tiny_tokenizer,
                                                                   tmp_path, monkeypatch):
    """The global gradient can still be non-finite when every sample's own gradient is finite (an overflow in
    the decoder's backward): nothing is committed, and the samples get one more try before being dropped."""
    config = make_config(method="rl", rollout_batch_size=2)
    store = Store(tmp_path / "store.sqlite")
    turns = [add_sample(store, base_model, tiny_tokenizer, i, reward=1.0) for i in (0, 1)]
    trainer = Trainer(config, store, LocalVersion(), console=None)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda params, max_norm: torch.tensor(float("inf")))

    assert trainer.run_batch(*store.lease_samples(2)) is None
    assert store.steps() == [] and trainer.policy_version == 0
    assert store.ready_count() == 2  # back to ready, not consumed

    assert trainer.run_batch(*store.lease_samples(2)) is None
    assert {store.get_turn(t).reason for t in turns} == {UPDATE_SKIPPED}
    assert [e["kind"] for e in store.events("update_skipped")] == ["update_skipped", "update_skipped"]
