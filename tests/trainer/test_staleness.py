"""Policy-version staleness: old samples are dropped (with a recorded reason), importance-corrected with
truncated weights, or trained as they are — as ``staleness_mode`` says."""

from __future__ import annotations

import math

import pytest

from clawloop.store import Store, TurnState
from clawloop.trainer import staleness
from clawloop.trainer.core import Trainer
from clawloop.trainer.publish import LocalVersion

from trainer_helpers import add_sample


def test_decide_follows_the_mode_only_beyond_the_bound():
    assert staleness.staleness(turn_version=3, current_version=7) == 4
    assert staleness.staleness(turn_version=9, current_version=7) == 0  # offline: a later online version
    for mode in ("tis", "drop", "ignore"):
        assert staleness.decide(4, max_staleness=4, mode=mode) == staleness.KEEP
    assert staleness.decide(5, 4, "drop") == staleness.DROP
    assert staleness.decide(5, 4, "tis") == staleness.TIS
    assert staleness.decide(5, 4, "ignore") == staleness.KEEP
    with pytest.raises(ValueError):
        staleness.decide(5, 4, "bogus")


def _trainer(make_config, store, version, **overrides):
    config = make_config(method="rl", max_staleness=2, rollout_batch_size=2, **overrides)
    return Trainer(config, store, LocalVersion(version), console=None)


def test_drop_mode_drops_stale_samples_with_a_reason_and_trains_the_rest(make_config, base_model, tiny_tokenizer,
                                                                         tmp_path):
    store = Store(tmp_path / "store.sqlite")
    stale = add_sample(store, base_model, tiny_tokenizer, 0, version=1)
    fresh = add_sample(store, base_model, tiny_tokenizer, 1, version=8)
    trainer = _trainer(make_config, store, version=10, staleness_mode="drop")
    metrics = trainer.run_batch(*store.lease_samples(2))
    assert metrics["samples"] == 1 and metrics["stale_dropped"] == 1 and metrics["staleness_max"] == 2
    turn = store.get_turn(stale)
    assert turn.state == TurnState.DROPPED and turn.reason == "stale"
    assert store.get_turn(fresh).state == TurnState.CONSUMED
    assert store.steps()[0]["turn_ids"] == [fresh]


def test_tis_weights_each_token_by_the_capped_old_over_behaviour_ratio(make_config, base_model, tiny_tokenizer,
                                                                       tmp_path):
    store = Store(tmp_path / "store.sqlite")
    # Behaviour log-probs 3 nats below the old policy's: ratio e^3 ≈ 20, capped at tis_cap = 2.
    add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0, version=0, behaviour_shift=-3.0)
    # 0.5 nats above: ratio e^-0.5, under the cap.
    add_sample(store, base_model, tiny_tokenizer, 1, reward=1.0, version=0, behaviour_shift=0.5)
    trainer = _trainer(make_config, store, version=5, staleness_mode="tis", tis_cap=2.0)
    metrics = trainer.run_batch(*store.lease_samples(2))
    assert metrics["stale_corrected"] == 2 and metrics["samples"] == 2
    # At ratio 1 the GRPO token loss is -r·w: the batch mean of -w over the two samples.
    assert metrics["grpo_loss"] == pytest.approx(-(2.0 + math.exp(-0.5)) / 2, abs=1e-4)
    assert metrics["tis_weight_mean"] == pytest.approx((2.0 + math.exp(-0.5)) / 2, abs=1e-4)


def test_fresh_samples_and_ignore_mode_get_no_weights(make_config, base_model, tiny_tokenizer, tmp_path):
    # tis at gap 2 = max_staleness (fresh enough), and ignore at gap 9: both train unweighted.
    for mode, trainer_version in (("tis", 2), ("ignore", 9)):
        store = Store(tmp_path / f"{mode}.sqlite")
        add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0, version=0, behaviour_shift=-3.0)
        add_sample(store, base_model, tiny_tokenizer, 1, reward=1.0, version=0, behaviour_shift=-3.0)
        trainer = _trainer(make_config, store, version=trainer_version, staleness_mode=mode,
                           run_dir=str(tmp_path / mode))
        metrics = trainer.run_batch(*store.lease_samples(2))
        assert metrics["grpo_loss"] == pytest.approx(-1.0, abs=1e-5), mode
        assert "tis_weight_mean" not in metrics and metrics["stale_corrected"] == 0
        assert metrics["stale_dropped"] == 0


def test_greedy_turns_are_not_importance_corrected(make_config, base_model, tiny_tokenizer, tmp_path):
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0, temperature=0.0, behaviour_shift=-3.0)
    add_sample(store, base_model, tiny_tokenizer, 1, reward=1.0, temperature=0.0, behaviour_shift=-3.0)
    trainer = _trainer(make_config, store, version=9, staleness_mode="tis")
    metrics = trainer.run_batch(*store.lease_samples(2))
    assert metrics["grpo_loss"] == pytest.approx(-1.0, abs=1e-5)
    assert metrics["stale_corrected"] == 2 and "tis_weight_mean" not in metrics
