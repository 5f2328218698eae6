"""One optimizer step: every method preset trains, for full fine-tuning and LoRA alike, through one code path."""

from __future__ import annotations

import math

import pytest
import torch

from clawloop.store import Store, TurnState
from clawloop.trainer.core import Trainer

from trainer_helpers import HINTS, add_sample

METHODS = ["hybrid", "rl", "opd", "combine", "topk_kl"]


def _fill(store, base_model, tiny_tokenizer, method):
    # Two hinted samples (one with a ±1 vote, one with 0) and two RL-only samples with ±1 votes.
    add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0, hints=HINTS)
    add_sample(store, base_model, tiny_tokenizer, 1, reward=0.0 if method != "rl" else -1.0, hints=HINTS[:1])
    add_sample(store, base_model, tiny_tokenizer, 2, reward=-1.0)
    add_sample(store, base_model, tiny_tokenizer, 3, reward=1.0)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("method", METHODS)
def test_one_step_of_each_method_moves_parameters_with_finite_metrics(make_config, base_model, tiny_tokenizer,
                                                                      tmp_path, method, lora):
    config = make_config(method=method, lora=lora, rollout_batch_size=4, micro_batch_size=2)
    store = Store(tmp_path / "store.sqlite")
    _fill(store, base_model, tiny_tokenizer, method)
    trainer = Trainer(config, store, console=None)
    before = [p.detach().clone() for p in trainer.models.trainable_parameters()]
    lease, samples = store.lease_samples(4)
    metrics = trainer.run_batch(lease, samples)

    after = trainer.models.trainable_parameters()
    moved = sum(float((a - b.detach()).abs().sum()) for a, b in zip(before, after))
    assert moved > 0, "the step did not change the trained parameters"
    if lora:  # only the adapter trains: the base weights are untouched
        names = [n for n, p in trainer.models.policy.named_parameters() if p.requires_grad]
        assert names and all("lora_" in n for n in names)
    assert metrics["step"] == 1 and metrics["samples"] == 4 and metrics["tokens"] > 0
    for key, value in metrics.items():
        assert isinstance(value, (int, float)) and math.isfinite(value), f"{key}={value}"
    assert metrics["grad_norm"] > 0
    assert metrics["lr"] == pytest.approx(1e-3)
    # Method-specific terms appear in the metrics.
    expected = {"hybrid": ("grpo_loss", "opd_loss"), "rl": ("grpo_loss",), "opd": ("opd_loss",),
                "combine": ("combine_loss",), "topk_kl": ("topk_kl_loss",)}[method]
    for key in expected:
        assert key in metrics
    if method in ("hybrid", "opd"):
        assert metrics["opd_applied"] == pytest.approx(0.5)  # the two hinted samples of four
    # The step was committed: samples consumed by step 1, recorded with the metrics.
    assert store.count_samples() == {TurnState.CONSUMED: 4}
    (row,) = store.steps()
    assert row["step"] == 1 and sorted(row["turn_ids"]) == sorted(s.turn_id for s in samples)
    assert row["metrics"]["loss"] == pytest.approx(metrics["loss"])


def test_separate_old_forward_gives_the_same_update_as_the_fused_one(make_config, base_model, tiny_tokenizer,
                                                                     tmp_path):
    """With one update per batch ℓ_old is read from the loss's own forward; a separate no-grad forward (used
    for several PPO epochs) must give the same step."""
    from clawloop.trainer.batch import prepare_items
    from clawloop.trainer.model import load_train_models
    from clawloop.trainer.step import make_optimizer, train_step

    config = make_config(method="hybrid", rollout_batch_size=4)
    store = Store(tmp_path / "store.sqlite")
    _fill(store, base_model, tiny_tokenizer, "hybrid")
    _, samples = store.lease_samples(4)
    results = []
    for fuse in (True, False):
        models = load_train_models(config)
        optimizer = make_optimizer(models, config)
        items, drops, _ = prepare_items(store, samples, config, current_version=0)
        assert not drops
        metrics = train_step(models, optimizer, items, config, fuse_old=fuse)
        results.append((metrics, [p.detach().clone() for p in models.trainable_parameters()]))
    (m_fused, p_fused), (m_sep, p_sep) = results
    assert "time_old_forward_s" in m_sep and "time_old_forward_s" not in m_fused
    assert m_fused["loss"] == pytest.approx(m_sep["loss"], abs=1e-5)
    assert m_fused["opd_loss"] == pytest.approx(m_sep["opd_loss"], abs=1e-5)
    for a, b in zip(p_fused, p_sep):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_several_ppo_epochs_clip_and_keep_old_logprobs_fixed(make_config, base_model, tiny_tokenizer, tmp_path):
    config = make_config(method="rl", steps_per_batch=3, rollout_batch_size=2, lr=5e-3)
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0)
    add_sample(store, base_model, tiny_tokenizer, 1, reward=-1.0)
    trainer = Trainer(config, store, console=None)
    lease, samples = store.lease_samples(2)
    metrics = trainer.run_batch(lease, samples)
    # Later epochs move away from the old policy: the ratio is no longer 1, so ppo_kl is non-zero.
    assert metrics["ppo_kl"] != 0.0
    assert metrics["time_old_forward_s"] > 0


def test_kl_to_reference_uses_frozen_start_weights(make_config, base_model, tiny_tokenizer, tmp_path):
    for lora in (False, True):
        config = make_config(method="rl", kl_coef=0.1, lora=lora, rollout_batch_size=2,
                             run_dir=str(tmp_path / f"run{lora}"))
        store = Store(tmp_path / f"store{lora}.sqlite")
        for i in range(4):
            add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i % 2 else -1.0)
        trainer = Trainer(config, store, console=None)
        first = trainer.run_batch(*store.lease_samples(2))
        second = trainer.run_batch(*store.lease_samples(2))
        # At the start the policy is the reference (KL 0); after an update it is not.
        assert first["ref_kl"] == pytest.approx(0.0, abs=1e-6)
        assert second["ref_kl"] > 0


def test_group_norm_normalises_rewards_within_a_shared_prompt(make_config, base_model, tiny_tokenizer, tmp_path):
    from clawloop.trainer.batch import prepare_items
    from clawloop.trainer.step import rewards_for

    config = make_config(method="rl", group_norm=True, rollout_batch_size=3)
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0)
    add_sample(store, base_model, tiny_tokenizer, 0, reward=-1.0, answer="London.")  # same prompt
    add_sample(store, base_model, tiny_tokenizer, 1, reward=1.0)  # alone in its group: unchanged
    _, samples = store.lease_samples(3)
    items, _, _ = prepare_items(store, samples, config, 0)
    rewards = rewards_for(items, config)
    assert rewards[0] == pytest.approx(1.0, abs=1e-4) and rewards[1] == pytest.approx(-1.0, abs=1e-4)
    assert rewards[2] == 1.0


def test_full_and_lora_compute_the_same_objective(make_config, base_model, tiny_tokenizer, tmp_path):
    """LoRA starts at the base weights (B = 0), so its first-step loss and metrics equal full fine-tuning's:
    the same objective runs on both paths."""
    out = {}
    for lora in (False, True):
        config = make_config(method="hybrid", lora=lora, rollout_batch_size=4, run_dir=str(tmp_path / f"r{lora}"))
        store = Store(tmp_path / f"s{lora}.sqlite")
        _fill(store, base_model, tiny_tokenizer, "hybrid")
        trainer = Trainer(config, store, console=None)
        out[lora] = trainer.run_batch(*store.lease_samples(4))
    for key in ("loss", "grpo_loss", "opd_loss", "opd_abs_diff", "opd_subset_size", "entropy"):
        assert out[True][key] == pytest.approx(out[False][key], abs=1e-5), key


def test_anchor_mode_trains_an_rl_sample_stored_without_targets(make_config, base_model, tiny_tokenizer, tmp_path):
    """Under opd_on_unhinted=anchor a sample whose teacher failed (kept for its vote, no targets) still trains
    its RL term; the step does not fail and says how many lacked an anchor."""
    config = make_config(method="hybrid", opd_on_unhinted="anchor", rollout_batch_size=2)
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0, anchor=True)
    add_sample(store, base_model, tiny_tokenizer, 1, reward=-1.0)  # no targets
    trainer = Trainer(config, store, console=None)
    metrics = trainer.run_batch(*store.lease_samples(2))
    assert metrics["anchor_missing"] == 1.0
    assert metrics["opd_applied"] == pytest.approx(0.5)
    assert store.count_samples() == {TurnState.CONSUMED: 2}


@pytest.mark.parametrize("mode,want", [("raw", [-1.0, -1.0, -1.0]), ("balanced", [0.0, 0.0, 0.0]),
                                       ("hinted_opd", [0.0, 0.0, -1.0])])
def test_advantage_mode_shapes_an_all_negative_batch(make_config, base_model, tiny_tokenizer, tmp_path, mode, want):
    """Where every vote is −1, the default (balanced) trains no GRPO term; raw keeps the original's A = r;
    hinted_opd leaves only the turn without a hint to GRPO."""
    from clawloop.trainer.batch import prepare_items
    from clawloop.trainer.step import rewards_for

    config = make_config(method="hybrid", advantage_mode=mode, rollout_batch_size=3)
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, base_model, tiny_tokenizer, 0, reward=-1.0, hints=HINTS)
    add_sample(store, base_model, tiny_tokenizer, 1, reward=-1.0, hints=HINTS[:1])
    add_sample(store, base_model, tiny_tokenizer, 2, reward=-1.0)
    _, samples = store.lease_samples(3)
    items, _, _ = prepare_items(store, samples, config, 0)
    by_hints = sorted(zip((len(it.sample.hints) for it in items), rewards_for(items, config)), reverse=True)
    assert [r for _, r in by_hints] == want


def test_default_advantage_mode_is_balanced(make_config):
    assert make_config().advantage_mode == "balanced"


def test_adam_eps_reaches_the_optimizer_and_damps_small_gradients(make_config):
    """``adam_eps`` is AdamW's epsilon: a parameter whose gradient is far below it moves far less than the
    learning rate in the first step, where with the default it moves the whole learning rate."""
    from clawloop.config import ConfigError
    from clawloop.trainer.model import load_train_models
    from clawloop.trainer.step import make_optimizer

    moved = {}
    for eps in (1e-8, 1e-2):
        config = make_config(method="rl", lora=True, lr=1e-3, adam_eps=eps)
        models = load_train_models(config)
        optimizer = make_optimizer(models, config)
        assert {group["eps"] for group in optimizer.param_groups} == {eps}
        param = models.trainable_parameters()[0]
        before = param.detach().clone()
        param.grad = torch.full_like(param, 1e-4)
        optimizer.step()
        moved[eps] = float((param.detach() - before).abs().max())
    assert moved[1e-8] == pytest.approx(1e-3, rel=1e-3)
    assert moved[1e-2] < 2e-5
    with pytest.raises(ConfigError, match="adam_eps"):
        make_config(adam_eps=0.0)


def test_a_later_epoch_that_fails_ends_the_step_with_the_updates_it_made(make_config, base_model, tiny_tokenizer,
                                                                         tmp_path):
    """With several PPO epochs the first update is in the weights before the second epoch runs. A failure there
    (an out-of-memory, say) must not give the batch back to be trained again: the step ends with its first
    update, commits, and says so."""
    config = make_config(method="rl", rollout_batch_size=2, micro_batch_size=2, steps_per_batch=2)
    store = Store(tmp_path / "store.sqlite")
    turn_ids = [add_sample(store, base_model, tiny_tokenizer, i, reward=(1.0, -1.0)[i]) for i in range(2)]
    trainer = Trainer(config, store, console=None)
    real_step, calls = trainer.optimizer.step, []

    def second_update_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (injected)")
        return real_step(*args, **kwargs)

    trainer.optimizer.step = second_update_fails
    before = [p.detach().clone() for p in trainer.models.trainable_parameters()]
    metrics = trainer.run_batch(*store.lease_samples(2))
    assert metrics is not None and metrics["updates_applied"] == 1.0 and metrics["epochs_cut_short"] == 1.0
    assert any(not torch.equal(b, p) for b, p in zip(before, trainer.models.trainable_parameters()))
    assert {s.turn_id: s.consumed_step for s in store.samples()} == {t: 1 for t in turn_ids}
    assert store.ready_count() == 0
    trainer.close()


def test_a_first_epoch_that_fails_gives_the_batch_back_untrained(make_config, base_model, tiny_tokenizer, tmp_path):
    config = make_config(method="rl", rollout_batch_size=2, micro_batch_size=2, steps_per_batch=2)
    store = Store(tmp_path / "store.sqlite")
    for i in range(2):
        add_sample(store, base_model, tiny_tokenizer, i, reward=(1.0, -1.0)[i])
    trainer = Trainer(config, store, console=None)

    def fails(*args, **kwargs):
        raise RuntimeError("out of memory (injected)")

    trainer.optimizer.step = fails
    with pytest.raises(RuntimeError, match="injected"):
        trainer.run_batch(*store.lease_samples(2))
    assert all(s.consumed_step is None for s in store.samples())
    trainer.close()
