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


def test_training_goes_on_from_rejected_candidates_until_the_limit(make_config, base_model, tiny_tokenizer, tmp_path,
                                                                   engine):
    config = make_config(method="rl", lora=True, lr=1e-3, gate_probe_tokens=16, gate_max_kl=1.0, gate=True,
                         gate_restore_after=2)
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, base_model, tiny_tokenizer, 0, reward=-1.0)
    add_sample(store, base_model, tiny_tokenizer, 1, reward=1.0)
    for i in range(2, 6):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0, answer=" the" * 40)
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
