"""The online trainer inside an event loop, and offline training over a stored run."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from clawloop.engines.hf import HFEngine
from clawloop.store import SampleRecord, Store, TurnRecord, TurnState
from clawloop.trainer import checkpoint as ckpt
from clawloop.trainer.loop import OnlineTrainer
from clawloop.trainer.metrics import read_metrics
from clawloop.trainer.offline import train_offline

from trainer_helpers import HINTS, add_sample, logprob_table, render


async def wait_for(predicate, timeout_s=120.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def test_trains_once_a_batch_is_ready_without_blocking_the_event_loop(make_config, base_model, tiny_tokenizer,
                                                                      tiny_model_path, tmp_path):
    config = make_config(method="hybrid", rollout_batch_size=2)
    store = Store(tmp_path / "store.sqlite")
    engine = HFEngine(tiny_model_path, device="cpu", num_threads=2, max_batch_size=4)

    async def main():
        trainer = OnlineTrainer(config, store, engine, poll_interval_s=0.05, console=None)
        await trainer.start()
        add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0, hints=HINTS)
        trainer.wake()
        await asyncio.sleep(0.3)
        assert trainer.step == 0 and store.ready_count() == 1  # one sample is not a batch
        add_sample(store, base_model, tiny_tokenizer, 1, reward=-1.0)
        trainer.wake()
        await wait_for(lambda: trainer.training, what="the step to start")
        ticks = 0
        while trainer.training:  # the loop stays responsive while the step runs in its thread
            ticks += 1
            await asyncio.sleep(0.005)
        await wait_for(lambda: trainer.step == 1, what="step 1")
        assert ticks > 0
        assert engine.policy_version == 1 and trainer.policy_version == 1
        status = trainer.status()
        assert status["step"] == 1 and status["samples_waiting"] == 0 and status["failures"] == 0
        await trainer.stop()

    try:
        asyncio.run(main())
    finally:
        engine.close_sync()
    assert store.count_samples() == {TurnState.CONSUMED: 2}
    assert ckpt.latest_checkpoint_path(config.run_dir).name == "step_1"  # written at shutdown
    (line,) = read_metrics(config.run_dir)
    for key in ("loss", "grpo_loss", "opd_loss", "grad_norm", "lr", "step", "policy_version", "samples", "tokens",
                "step_time_s", "staleness_mean", "old_behaviour_logprob_gap", "sample_version_max"):
        assert key in line, key


def test_an_idle_trainer_works_ahead_so_that_its_first_step_and_check_do_less(make_config, base_model,
                                                                             tiny_tokenizer, tiny_model_path,
                                                                             tmp_path):
    """With nothing to train, the loop builds the retain term's targets and has the gate's fixed reference answer
    its probes; once samples come, the first step builds no targets and its check asks the reference nothing."""
    config = make_config(method="hybrid", rollout_batch_size=2, lora=True, retain_coef=1.0, retain_tokens=8,
                         retain_batch=2, gate=True, gate_every=1, gate_recent_prompts=0, gate_fixed_prompts=0)
    store = Store(tmp_path / "store.sqlite")
    engine = HFEngine(tiny_model_path, device="cpu", num_threads=2, max_batch_size=4)

    async def main():
        trainer = OnlineTrainer(config, store, engine, poll_interval_s=0.05, console=None)
        await trainer.start()
        assert trainer.status()["gate"]["working_ahead"]
        await wait_for(lambda: not trainer.status()["gate"]["working_ahead"], what="the work ahead")
        assert trainer.core.retain is not None and trainer.core.retain.targets.complete and trainer.step == 0
        for i, reward in enumerate((1.0, -1.0)):
            add_sample(store, base_model, tiny_tokenizer, i, reward=reward, hints=HINTS)
        trainer.wake()
        await wait_for(lambda: trainer.step == 1, what="step 1")
        await trainer.stop()

    try:
        asyncio.run(main())
    finally:
        engine.close_sync()
    (line,) = read_metrics(config.run_dir)
    assert "gate_s" in line and "time_retain_s" in line
    assert not {k for k in line if k.startswith("gate_reference_")}  # neither its answers nor its dice


def test_samples_short_of_a_batch_train_once_the_oldest_has_waited(make_config, base_model, tiny_tokenizer,
                                                                   tiny_model_path, tmp_path):
    # Two conversations' worth of samples and a batch of 16: without a bound on the wait they would never train.
    config = make_config(method="hybrid", rollout_batch_size=16, batch_wait_s=1.0, idle_train_s=0.0)
    store = Store(tmp_path / "store.sqlite")
    engine = HFEngine(tiny_model_path, device="cpu", num_threads=2, max_batch_size=4)

    async def main():
        trainer = OnlineTrainer(config, store, engine, poll_interval_s=0.05, console=None)
        await trainer.start()
        ids = [add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i else -1.0,
                          hints=HINTS if i == 0 else ()) for i in range(2)]
        trainer.wake()
        await wait_for(lambda: trainer.step == 1, what="a step on the two ready samples")
        assert trainer.status()["short_batches"] == 1
        await trainer.stop()
        return ids

    try:
        ids = asyncio.run(main())
        assert engine.policy_version == 1  # the step's weights are served
    finally:
        engine.close_sync()
    (step,) = store.steps()
    assert sorted(step["turn_ids"]) == sorted(ids) and step["metrics"]["samples"] == 2.0
    assert step["metrics"]["grad_norm"] > 0  # a real optimizer step
    # Trained no sooner than the bound: the oldest sample had waited batch_wait_s for a full batch.
    oldest = min(store.get_sample(i).created_at for i in ids)
    assert step["created_at"] - oldest >= config.batch_wait_s
    assert store.count_samples() == {TurnState.CONSUMED: 2}


def _served_turn(model, tokenizer, session_id):
    messages = [{"role": "user", "content": "What is a frog?"}]
    prompt = render(tokenizer, messages)
    response = list(tokenizer("A small amphibian.", add_special_tokens=False)["input_ids"]) + [2]
    table = logprob_table(model, prompt, response, 1.0)
    behaviour = table.gather(1, torch.tensor(response)[:, None])[:, 0].tolist()
    return TurnRecord(session_id=session_id, messages=messages, prompt_ids=prompt, response_ids=response,
                      logprobs=behaviour, temperature=1.0, top_p=1.0, policy_version=0)


def test_samples_short_of_a_batch_train_when_the_user_goes_idle(make_config, base_model, tiny_tokenizer, tmp_path):
    config = make_config(method="rl", rollout_batch_size=16, batch_wait_s=0.0, idle_train_s=1.0)
    store = Store(tmp_path / "store.sqlite")
    ready = add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0)
    # The user's last answer has its next message but is not judged yet: its sample belongs in the same step.
    pending = store.add_turn(_served_turn(base_model, tiny_tokenizer, "s-last"))
    assert store.set_next_state(pending, [{"role": "user", "content": "Thanks!"}])

    async def main():
        from clawloop.trainer.publish import LocalVersion

        trainer = OnlineTrainer(config, store, LocalVersion(), poll_interval_s=0.05, console=None)
        await trainer.start()
        await asyncio.sleep(2.5)  # well past the idle window, but a turn is still to be judged
        assert trainer.step == 0 and trainer.train_what_is_ready(time.time()) is None
        (claimed,) = store.claim_judgeable(1)
        assert store.put_sample(SampleRecord(turn_id=claimed.id, reward=-1.0, kind="rl"))
        trainer.wake()
        await wait_for(lambda: trainer.step == 1, what="a step once the user is idle and nothing is being judged")
        await trainer.stop()
        return trainer

    trainer = asyncio.run(main())
    (step,) = store.steps()
    assert sorted(step["turn_ids"]) == sorted([ready, pending]) and trainer.short_batches == 1
    last_turn = max(store.get_turn(t).created_at for t in (ready, pending))
    assert step["created_at"] - last_turn >= config.idle_train_s  # no new turn for the idle window
    assert store.count_samples() == {TurnState.CONSUMED: 2}


def test_an_active_user_keeps_samples_waiting_for_a_batch_or_the_bound(make_config, base_model, tiny_tokenizer,
                                                                         tmp_path):
    config = make_config(method="rl", rollout_batch_size=16, batch_wait_s=0.0, idle_train_s=30.0)
    store = Store(tmp_path / "store.sqlite")
    add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0)
    trainer = OnlineTrainer(config, store, None, console=None)
    now = time.time()
    assert trainer.train_what_is_ready(now) is None  # a turn came just now; no bound on the wait
    assert "idle_train_s" in trainer.train_what_is_ready(now + 31.0)
    bounded = OnlineTrainer(make_config(method="rl", rollout_batch_size=16, batch_wait_s=10.0, idle_train_s=0.0),
                            store, None, console=None)
    assert bounded.train_what_is_ready(now) is None
    assert "batch_wait_s" in bounded.train_what_is_ready(now + 11.0)
    store.lease_samples(1)
    assert bounded.train_what_is_ready(now + 11.0) is None  # nothing ready, nothing to train


def test_a_failed_step_gives_its_samples_back(make_config, base_model, tiny_tokenizer, tmp_path, monkeypatch):
    config = make_config(method="rl", rollout_batch_size=2)
    store = Store(tmp_path / "store.sqlite")
    for i in range(2):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0)

    def broken_step(*args, **kwargs):
        raise RuntimeError("out of memory in the backward")

    monkeypatch.setattr("clawloop.trainer.core.train_step", broken_step)

    async def main():
        from clawloop.trainer.publish import LocalVersion

        trainer = OnlineTrainer(config, store, LocalVersion(), poll_interval_s=0.05, error_backoff_s=30.0,
                                console=None)
        await trainer.start()
        await wait_for(lambda: trainer.failures == 1, what="the failure")
        await wait_for(lambda: store.ready_count() == 2, what="the lease to be released")
        assert "out of memory in the backward" in trainer.last_error
        await trainer.stop()  # wakes the back-off
        return trainer

    trainer = asyncio.run(main())
    assert trainer.step == 0 and store.steps() == []
    assert store.count_samples() == {TurnState.READY: 2}
    assert ckpt.latest_checkpoint_path(config.run_dir) is None  # nothing trained, nothing to save


def test_a_sample_that_breaks_every_step_is_dropped_with_a_reason(make_config, base_model, tiny_tokenizer,
                                                                  tmp_path, monkeypatch):
    config = make_config(method="rl", rollout_batch_size=2)
    store = Store(tmp_path / "store.sqlite")
    bad = add_sample(store, base_model, tiny_tokenizer, 0, reward=1.0)
    good = [add_sample(store, base_model, tiny_tokenizer, i, reward=1.0) for i in (1, 2)]
    from clawloop.trainer import core

    real_step = core.train_step

    def step_failing_on_bad(models, optimizer, items, config, **kwargs):
        if any(it.turn_id == bad for it in items):
            raise ValueError("non-finite loss")
        return real_step(models, optimizer, items, config, **kwargs)

    monkeypatch.setattr("clawloop.trainer.core.train_step", step_failing_on_bad)

    async def main():
        from clawloop.trainer.publish import LocalVersion

        trainer = OnlineTrainer(config, store, LocalVersion(), poll_interval_s=0.05, error_backoff_s=0.01,
                                max_sample_failures=3, console=None)
        await trainer.start()
        await wait_for(lambda: store.get_turn(bad).state == TurnState.DROPPED, what="the bad sample's drop")
        await wait_for(lambda: trainer.step == 1, what="the good samples' step")
        await trainer.stop()
        return trainer

    trainer = asyncio.run(main())
    assert trainer.failures == 3
    assert store.get_turn(bad).reason == "train_error"
    assert sorted(store.steps()[0]["turn_ids"]) == sorted(good)


def test_stop_during_a_step_finishes_it_and_leaves_nothing_leased(make_config, base_model, tiny_tokenizer,
                                                                  tmp_path):
    config = make_config(method="rl", rollout_batch_size=2)
    store = Store(tmp_path / "store.sqlite")
    for i in range(3):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0)

    async def main():
        from clawloop.trainer.publish import LocalVersion

        trainer = OnlineTrainer(config, store, LocalVersion(), poll_interval_s=0.05, console=None)
        await trainer.start()
        await wait_for(lambda: trainer.training, what="the step to start")
        await trainer.stop()
        return trainer

    trainer = asyncio.run(main())
    assert trainer.step == 1
    assert store.count_samples() == {TurnState.CONSUMED: 2, TurnState.READY: 1}
    assert ckpt.load_latest(config.run_dir).step == 1


def test_offline_training_consumes_a_stored_run_and_continues_it(make_config, base_model, tiny_tokenizer,
                                                                 tmp_path):
    config = make_config(method="hybrid", rollout_batch_size=2)
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    store = Store(run_dir / "store.sqlite")
    ids = [add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i % 2 else -1.0,
                      hints=HINTS if i == 0 else ()) for i in range(5)]
    store.close()

    first = train_offline(config, run_dir, max_steps=1, console=None)
    assert first["steps"] == 1 and first["step"] == 1 and first["ready_left"] == 3
    second = train_offline(config, run_dir, console=None)  # resumes at step 1, trains 2 + a final 1
    assert second["steps"] == 2 and second["step"] == 3 and second["samples"] == 3
    assert second["ready_left"] == 0 and second["policy_version"] == 3

    store = Store(run_dir / "store.sqlite")
    steps = store.steps()
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert sorted(t for s in steps for t in s["turn_ids"]) == sorted(ids)
    assert ckpt.load_latest(run_dir).step == 3
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    # The saved weights differ from the starting model: training happened.
    saved = ckpt.load_latest(run_dir).weights
    key = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(saved[key], base_model.state_dict()[key])


def test_a_lease_lost_after_the_update_is_not_held_against_its_samples(make_config, base_model, tiny_tokenizer,
                                                                       tmp_path):
    """The commit found the lease gone (it expired while the step ran): the samples went back to ready and did
    nothing wrong, so they are not counted toward a train_error drop, nor retried one per step; they train."""
    from clawloop.store import LeaseLost

    class LosesTheFirstCommits(Store):
        lost = 0

        def commit_step(self, *args, **kwargs):
            if self.lost < 3:
                self.lost += 1
                raise LeaseLost("the lease expired during the step")
            return super().commit_step(*args, **kwargs)

    config = make_config(method="rl", rollout_batch_size=2)
    store = LosesTheFirstCommits(tmp_path / "store.sqlite")
    turns = [add_sample(store, base_model, tiny_tokenizer, i, reward=1.0) for i in (0, 1)]

    async def main():
        from clawloop.trainer.publish import LocalVersion

        trainer = OnlineTrainer(config, store, LocalVersion(), poll_interval_s=0.05, error_backoff_s=0.01,
                                max_sample_failures=3, console=None)
        await trainer.start()
        await wait_for(lambda: store.steps(), what="a committed step")
        await trainer.stop()
        return trainer

    trainer = asyncio.run(main())
    assert trainer.failures == 0 and store.lost == 3
    assert all(store.get_turn(t).state == TurnState.CONSUMED for t in turns)
    assert sorted(store.steps()[0]["turn_ids"]) == sorted(turns)


def test_a_rollback_that_comes_while_the_trainer_stops_changes_nothing(make_config, base_model, tiny_tokenizer,
                                                                       tmp_path):
    """The server is shutting down: a rollback that arrives then waits for the model and is refused, rather
    than running on a trainer already closed (a 500 from inside it)."""
    from clawloop.trainer.loop import TrainerStopped

    config = make_config(method="rl", rollout_batch_size=2)
    store = Store(tmp_path / "store.sqlite")

    async def main():
        from clawloop.trainer.publish import LocalVersion

        trainer = OnlineTrainer(config, store, LocalVersion(), poll_interval_s=0.05, console=None)
        await trainer.start()
        stopping = asyncio.create_task(trainer.stop())
        await asyncio.sleep(0)  # the stop has begun
        with pytest.raises(TrainerStopped):
            await trainer.rollback(0)
        await stopping

    asyncio.run(main())
