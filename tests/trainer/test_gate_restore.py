"""``gate_restore_after``: a rejected candidate is never served, and training goes on from it until that many
candidates in a row were rejected; then it goes back to the last accepted weights. The dashboard puts the steps
of a chain that ended in a restore among the rejected ones."""

from __future__ import annotations

import pytest
import torch

from clawloop.dashboard.readmodel import step_fates
from clawloop.engines.hf import HFEngine
from clawloop.store import Store
from clawloop.trainer.core import Trainer
from clawloop.trainer.model import trainable_state_dict

from trainer_helpers import add_sample


@pytest.fixture
def engine(tiny_model_path):
    engine = HFEngine(tiny_model_path, device="cpu", num_threads=1, max_batch_size=4)
    yield engine
    engine.close_sync()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def _gated_store(tmp_path, base_model, tiny_tokenizer, wrecking: int) -> Store:
    """Two ordinary samples (a first batch the gate accepts), then ``wrecking`` samples of a looping answer."""
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, base_model, tiny_tokenizer, 0, reward=-1.0)
    add_sample(store, base_model, tiny_tokenizer, 1, reward=1.0)
    for i in range(2, 2 + wrecking):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0, answer=" the" * 40)
    return store


def test_training_goes_on_from_rejected_candidates_until_the_limit(make_config, base_model, tiny_tokenizer, tmp_path,
                                                                   engine):
    config = make_config(method="rl", lora=True, lr=1e-3, gate_probe_tokens=16, gate_max_kl=1.0, gate=True,
                         gate_restore_after=2)
    store = _gated_store(tmp_path, base_model, tiny_tokenizer, 4)
    trainer = Trainer(config, store, engine, console=None)
    assert trainer.run_batch(*store.lease_samples(2))["gate_accepted"] == 1.0 and engine.policy_version == 1
    accepted = trainable_state_dict(trainer.models)
    for group in trainer.optimizer.param_groups:  # updates that wreck the weights
        group["lr"] = 1.0

    first = trainer.run_batch(*store.lease_samples(2))
    assert first["gate_accepted"] == 0.0 and first["gate_restored"] == 0.0
    assert engine.policy_version == 1  # never served
    kept = trainable_state_dict(trainer.models)
    assert not _same(kept, accepted)  # training goes on from the rejected weights
    (event,) = store.events("gate_rejected")
    assert event["detail"]["restored_version"] is None and event["detail"]["steps"] == [2]
    # Its step waits for the next decision, as an unchecked one does.
    assert step_fates(store.steps(), store.versions(), store.events())[2]["disposition"] == "unchecked"

    second = trainer.run_batch(*store.lease_samples(2))
    assert second["gate_accepted"] == 0.0 and second["gate_restored"] == 1.0
    assert engine.policy_version == 1
    assert _same(trainable_state_dict(trainer.models), accepted)  # the second in a row: back to version 1
    restoring = store.events("gate_rejected")[-1]
    assert restoring["detail"]["restored_version"] == 1 and restoring["detail"]["steps"] == [2, 3]

    fates = step_fates(store.steps(), store.versions(), store.events())
    assert fates[1]["disposition"] == "in_version"
    assert fates[2]["disposition"] == fates[3]["disposition"] == "rejected"


def _lrs(trainer: Trainer) -> list[float]:
    return [group["lr"] for group in trainer.optimizer.param_groups]


def test_each_rejection_lowers_the_learning_rate_down_to_its_floor(make_config, base_model, tiny_tokenizer, tmp_path,
                                                                   engine):
    """``gate_reject_lr_scale``: after a rejected candidate the next ones are trained with smaller steps, never
    below ``gate_min_lr_scale`` x lr, and a rollback trains at the configured lr again."""
    config = make_config(method="rl", lora=True, lr=1e-3, gate_probe_tokens=16, gate_max_kl=1.0, gate=True,
                         gate_reject_lr_scale=0.5, gate_min_lr_scale=0.25)
    store = _gated_store(tmp_path, base_model, tiny_tokenizer, 6)
    trainer = Trainer(config, store, engine, console=None)
    assert trainer.run_batch(*store.lease_samples(2))["gate_accepted"] == 1.0
    assert _lrs(trainer) == [1e-3]
    for expected in (0.5, 0.25, 0.25):
        for group in trainer.optimizer.param_groups:  # an update that wrecks the weights, so the gate rejects
            group["lr"] = 1.0
        metrics = trainer.run_batch(*store.lease_samples(2))
        assert metrics["gate_accepted"] == 0.0 and metrics["gate_restored"] == 1.0
        assert metrics["lr_scale"] == expected and _lrs(trainer) == pytest.approx([1e-3 * expected])
    trainer.rollback(1)
    assert trainer.lr_scale == 1.0 and _lrs(trainer) == [1e-3]


def test_the_learning_rate_scale_is_checked(make_config):
    from clawloop.config import ConfigError

    for bad in ({"gate_reject_lr_scale": 0.0}, {"gate_reject_lr_scale": 1.5}, {"gate_min_lr_scale": -0.1}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            make_config(**bad)


def test_a_restore_can_leave_the_accepted_versions_momentum_behind(make_config, base_model, tiny_tokenizer, tmp_path,
                                                                   engine):
    """``gate_restore_momentum``: back at the accepted weights, the optimizer has that version's momentum (the
    default) or none, with the second moment the version had either way."""
    for keep in (True, False):
        config = make_config(method="rl", lora=True, lr=1e-3, gate_probe_tokens=16, gate_max_kl=1.0, gate=True,
                             gate_restore_momentum=keep)
        (tmp_path / str(keep)).mkdir()
        store = _gated_store(tmp_path / str(keep), base_model, tiny_tokenizer, 2)
        trainer = Trainer(config, store, engine, console=None)
        assert trainer.run_batch(*store.lease_samples(2))["gate_accepted"] == 1.0
        accepted = {k: {n: t.clone() for n, t in v.items() if torch.is_tensor(t)}
                    for k, v in trainer.optimizer.state.items()}
        assert any(s["exp_avg"].abs().sum() > 0 for s in accepted.values())
        for group in trainer.optimizer.param_groups:  # an update that wrecks the weights, so the gate rejects
            group["lr"] = 1.0
        assert trainer.run_batch(*store.lease_samples(2))["gate_restored"] == 1.0
        for param, state in trainer.optimizer.state.items():
            kept = accepted[param]
            assert torch.equal(state["exp_avg_sq"], kept["exp_avg_sq"])
            assert torch.equal(state["exp_avg"], kept["exp_avg"] if keep else torch.zeros_like(kept["exp_avg"]))
        trainer.close()
        store.close()


@pytest.mark.parametrize("settings", [{"gate_restore_after_v0": 2},
                                      {"opening_preference": "always", "opening_restore_after_v0": 2},
                                      {"gate_restore_after": 2}])
def test_from_the_starting_weights_training_goes_on_longer(make_config, base_model, tiny_tokenizer, tmp_path, engine,
                                                          settings):
    """``gate_restore_after_v0`` (``opening_restore_after_v0`` for an opening preference; unset, it is
    ``gate_restore_after``): while nothing newer than the starting weights was accepted, training goes on from that
    many rejected candidates in a row before it goes back; once a version is accepted, ``gate_restore_after``
    holds."""
    config = make_config(method="rl", lora=True, lr=1e-3, gate_probe_tokens=16, gate_max_kl=1.0, gate=True,
                         **settings)
    store = Store(tmp_path / "store.sqlite")
    for i in range(4):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0, answer=" the" * 40)
    add_sample(store, base_model, tiny_tokenizer, 4, reward=-1.0)
    add_sample(store, base_model, tiny_tokenizer, 5, reward=1.0)
    for i in range(6, 8):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0, answer=" the" * 40)
    trainer = Trainer(config, store, engine, console=None)
    start = trainable_state_dict(trainer.models)

    def set_lr(lr: float) -> None:  # 1.0 wrecks the weights, so the gate rejects
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr

    set_lr(1.0)
    first = trainer.run_batch(*store.lease_samples(2))
    assert first["gate_accepted"] == 0.0 and first["gate_restored"] == 0.0 and engine.policy_version == 0
    assert not _same(trainable_state_dict(trainer.models), start)  # goes on from the rejected weights
    set_lr(1.0)
    second = trainer.run_batch(*store.lease_samples(2))
    assert second["gate_accepted"] == 0.0 and second["gate_restored"] == 1.0 and engine.policy_version == 0
    assert _same(trainable_state_dict(trainer.models), start)  # the second in a row: back to the starting weights

    set_lr(1e-3)
    assert trainer.run_batch(*store.lease_samples(2))["gate_accepted"] == 1.0 and engine.policy_version == 1
    accepted = trainable_state_dict(trainer.models)
    set_lr(1.0)
    third = trainer.run_batch(*store.lease_samples(2))
    after_v1 = settings.get("gate_restore_after", 1)
    assert third["gate_accepted"] == 0.0 and third["gate_restored"] == float(after_v1 == 1)
    assert _same(trainable_state_dict(trainer.models), accepted) == (after_v1 == 1)
    trainer.close()
    store.close()


def test_the_restore_counts_are_checked(make_config):
    from clawloop.config import ConfigError

    for bad in ({"gate_restore_after": 0}, {"gate_restore_after_v0": -1}, {"opening_restore_after_v0": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            make_config(**bad)
