"""The publication gate, the version history and rollback, on the tiny model with a real serving engine.

* a broken candidate (a real AdamW step at lr 1 toward one repeated token) is rejected and never served, while the
  engine keeps answering requests during the check; training returns to the accepted weights and optimizer state;
* rollback serves an earlier version's exact log-probs, training continues from it, and the next version gets a
  fresh number;
* version numbers stay unique across restarts with and without resume.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from clawloop.engines.base import SamplingParams, ScoreRequest
from clawloop.engines.hf import HFEngine
from clawloop.retry import Backoff
from clawloop.store import Store
from clawloop.trainer import versions as history
from clawloop.trainer.core import Trainer
from clawloop.trainer.model import trainable_state_dict
from clawloop.trainer.publish import LocalVersion

from trainer_helpers import add_sample, render


@pytest.fixture
def engine(tiny_model_path):
    engine = HFEngine(tiny_model_path, device="cpu", num_threads=1, max_batch_size=4)
    yield engine
    engine.close_sync()


def _probe(tokenizer):
    prompt = render(tokenizer, [{"role": "user", "content": "Tell me a joke."}])
    response = list(tokenizer("Why did the chicken cross the road?", add_special_tokens=False)["input_ids"])
    return prompt, response


def _score(engine, prompt, response):
    (result,) = asyncio.run(engine.score([ScoreRequest(prompt_ids=prompt, response_ids=response, top_k=4,
                                                       temperature=1.0)]))
    return result


def _optimizer_tensors(optimizer):
    return [t.clone() for state in optimizer.state_dict()["state"].values() for t in state.values()
            if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_broken_candidate_is_rejected_and_never_served(make_config, base_model, tiny_tokenizer, tmp_path, engine,
                                                         lora):
    # The tiny random model's own answers are not language, so few probes count for the guard here; the KL bound
    # is set to 1 nat/token (healthy steps of this test measure ~0.01).
    config = make_config(method="rl", lora=lora, lr=1e-3, gate_probe_tokens=16, gate_max_kl=1.0, gate=True)
    store = Store(tmp_path / "store.sqlite")
    for i in range(2):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i else -1.0)
    broken = " the" * 40
    for i in range(2, 4):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0, answer=broken)
    prompt, response = _probe(tiny_tokenizer)
    decisions = []
    trainer = Trainer(config, store, engine, console=None, on_gate=decisions.append)

    healthy = trainer.run_batch(*store.lease_samples(2))
    assert healthy["gate_accepted"] == 1.0 and healthy["published"] == 1.0 and engine.policy_version == 1
    served_v1 = _score(engine, prompt, response)
    accepted_weights = trainable_state_dict(trainer.models)
    accepted_optimizer = _optimizer_tensors(trainer.optimizer)

    # A real update at lr 1 toward one repeated token: the weights are wrecked.
    for group in trainer.optimizer.param_groups:
        group["lr"] = 1.0
    spans: list[float] = []
    check = trainer.gate.check

    def timed_check(*args, **kwargs):
        spans.append(time.monotonic())
        try:
            return check(*args, **kwargs)
        finally:
            spans.append(time.monotonic())

    trainer.gate.check = timed_check
    answered: list[tuple[float, int]] = []
    stop = threading.Event()

    def requests() -> None:  # a user keeps asking while the trainer works
        async def loop() -> None:
            while not stop.is_set():
                gen = await engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4))
                answered.append((time.monotonic(), gen.policy_version))

        asyncio.run(loop())

    user = threading.Thread(target=requests, daemon=True)
    user.start()
    try:
        rejected = trainer.run_batch(*store.lease_samples(2))
    finally:
        stop.set()
        user.join(60)

    assert rejected["gate_accepted"] == 0.0 and rejected["published"] == 0.0
    # Rejected on the evidence: the answers loop (guard) or drifted far from the reference (KL), or both.
    assert rejected["gate_kl"] > config.gate_max_kl or rejected["gate_guard_pass"] < config.gate_min_guard_pass
    # Never served: the engine still runs version 1, with exactly version 1's outputs.
    assert engine.policy_version == 1 and rejected["policy_version"] == 1
    after = _score(engine, prompt, response)
    assert after.policy_version == 1
    torch.testing.assert_close(after.logprobs_T, served_v1.logprobs_T, rtol=0, atol=0)
    # Requests were answered while the gate ran, all by the accepted version.
    start, end = spans
    during = [v for t, v in answered if start <= t <= end]
    assert during and set(during) == {1}
    assert {v for _, v in answered} <= {1}
    # Training went back to the accepted weights and optimizer state.
    for key, value in trainable_state_dict(trainer.models).items():
        torch.testing.assert_close(value, accepted_weights[key], rtol=0, atol=0)
    for a, b in zip(accepted_optimizer, _optimizer_tensors(trainer.optimizer)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The decision is recorded with its evidence; the step's samples are accounted for by the rejected step.
    (event,) = store.events("gate_rejected")
    assert event["step"] == 2 and event["detail"]["steps"] == [2] and event["detail"]["restored_version"] == 1
    assert event["detail"]["reasons"] and not event["detail"]["accepted"]
    assert len(event["detail"]["probes"]) >= 12 and all("answer" in p for p in event["detail"]["probes"])
    assert [d["kind"] for d in decisions] == ["gate_accepted", "gate_rejected"]
    assert [v["version"] for v in store.versions()] == [1]
    steps = store.steps()
    assert [(s["step"], s["policy_version"], s["metrics"]["published"]) for s in steps] == [(1, 1, 1.0),
                                                                                           (2, 1, 0.0)]
    assert store.count_samples() == {"consumed": 4}

    # Training goes on from the accepted state: the next sound step is published as version 2.
    for group in trainer.optimizer.param_groups:
        group["lr"] = 1e-3
    add_sample(store, base_model, tiny_tokenizer, 4, reward=1.0)
    add_sample(store, base_model, tiny_tokenizer, 5, reward=-1.0)
    healthy = trainer.run_batch(*store.lease_samples(2))
    assert healthy["gate_accepted"] == 1.0 and engine.policy_version == 2


def test_rollback_serves_the_earlier_version_exactly_and_numbers_go_on(make_config, base_model, tiny_tokenizer,
                                                                       tmp_path, engine):
    config = make_config(method="rl", lora=True, lr=1e-2, gate_probe_tokens=8, gate=True)
    store = Store(tmp_path / "store.sqlite")
    for i in range(6):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i % 2 else -1.0)
    prompt, response = _probe(tiny_tokenizer)
    trainer = Trainer(config, store, engine, console=None)
    v0 = _score(engine, prompt, response)
    trainer.run_batch(*store.lease_samples(2))
    v1 = _score(engine, prompt, response)
    trainer.run_batch(*store.lease_samples(2))
    v2 = _score(engine, prompt, response)
    assert (v1.policy_version, v2.policy_version) == (1, 2)
    assert (v2.logprobs_T - v1.logprobs_T).abs().max() > 1e-4
    assert history.list_versions(config.run_dir) == [0, 1, 2]

    result = trainer.rollback(1)
    assert result["version"] == 1 and result["rolled_back"] == [2] and result["optimizer"] == "restored"
    again = _score(engine, prompt, response)
    assert again.policy_version == 1
    torch.testing.assert_close(again.logprobs_T, v1.logprobs_T, rtol=0, atol=0)
    torch.testing.assert_close(again.topk_logprobs_T_K, v1.topk_logprobs_T_K, rtol=0, atol=0)
    assert torch.equal(again.topk_ids_T_K, v1.topk_ids_T_K)
    assert [(v["version"], v["status"]) for v in store.versions()] == [(1, "accepted"), (2, "rolled_back")]
    assert store.events("rollback")[0]["detail"]["from_version"] == 2

    trainer.rollback(0)  # the starting weights are kept as version 0
    torch.testing.assert_close(_score(engine, prompt, response).logprobs_T, v0.logprobs_T, rtol=0, atol=0)
    trainer.rollback(1)

    # Training continues from version 1; the next version is 3, never 2 again.
    trainer.run_batch(*store.lease_samples(2))
    assert engine.policy_version == 3
    assert [s["policy_version"] for s in store.steps()] == [1, 2, 3]
    with pytest.raises(FileNotFoundError):
        trainer.rollback(9)


def test_version_numbers_stay_unique_across_restarts(make_config, base_model, tiny_tokenizer, tmp_path):
    config = make_config(method="rl", lora=True, lr=1e-2, checkpoint_every=1, gate_probe_tokens=8, gate=True)
    db = tmp_path / "store.sqlite"
    store = Store(db)
    for i in range(10):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i % 2 else -1.0)

    first = Trainer(config, store, LocalVersion(), console=None)
    first.run_batch(*store.lease_samples(2))
    first.run_batch(*store.lease_samples(2))
    first.close()

    # A restart without resume: fresh weights and an engine that starts at version 0 — the numbers go on.
    second = Trainer(config, store, LocalVersion(), console=None)
    assert second.step == 2
    second.run_batch(*store.lease_samples(2))
    assert second.policy_version == 3
    second.close()

    # A crash after a committed but not yet checkpointed step, then a restart with resume.
    third = Trainer(config, store, LocalVersion(), console=None)
    third.resume()
    third.checkpoint_if_due = lambda force=False: None  # the process dies before its checkpoint
    third.run_batch(*store.lease_samples(2))
    assert third.policy_version == 4
    store.close()

    store = Store(db)
    fourth = Trainer(config, store, LocalVersion(), console=None)
    resumed = fourth.resume()
    assert resumed["step"] == 3 and resumed["requeued"] == 2 and fourth.policy_version == 3
    fourth.run_batch(*store.lease_samples(2))
    assert fourth.policy_version == 5  # 4 named the lost step's weights

    versions = [v["version"] for v in store.versions()]
    assert versions == [1, 2, 3, 4, 5]
    kept = {v: load_file(str(history.version_dir(config.run_dir, v) / "weights.safetensors")) for v in versions}
    # Each number was given once, to one set of weights (v5 retrains v4's samples from the same checkpoint, so
    # it may equal v4: one set of weights may have two numbers, never one number two sets).
    for a in versions[:4]:
        for b in versions[:4]:
            if a < b:
                assert any(not torch.equal(kept[a][k], kept[b][k]) for k in kept[a])
    # Resume kept the lost step's record, and said so.
    assert [s["step"] for s in store.requeued_steps()] == [4]
    assert [e["detail"]["steps"] for e in store.events("requeue")] == [[4]]
    steps = store.steps()
    assert [(s["step"], s["requeued"]) for s in steps] == [(1, False), (2, False), (3, False), (4, True), (5, False)]
    assert [s["policy_version"] for s in steps] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("fixed", [True, False])
def test_full_fine_tuning_s_gate_measures_against_the_starting_weights_by_default(fixed, make_config, base_model,
                                                                                 tiny_tokenizer, tmp_path):
    """Against the last accepted weights each accepted version may lose a little more than the one before, without
    bound; full fine-tuning keeps a frozen copy of the starting weights for the gate unless told not to."""
    config = make_config(method="rl", lora=False, lr=1e-2, gate_probe_tokens=8, gate=True, kl_coef=0.0,
                         retain_coef=0.0, gate_fixed_reference=fixed, gate_knowledge=False)
    store = Store(tmp_path / "store.sqlite")
    for i in range(2):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i % 2 else -1.0)
    trainer = Trainer(config, store, LocalVersion(), console=None)
    assert trainer.gate_view.kl_to == ("reference" if fixed else "last_accepted")
    assert (trainer.models.reference is not None) == fixed
    metrics = trainer.run_batch(*store.lease_samples(2))
    assert metrics is not None and metrics["step"] == 1
    if fixed:  # the copy stays the starting weights while the policy moves
        start = dict(base_model.named_parameters())
        for name, p in trainer.models.reference.named_parameters():
            assert torch.equal(p, start[name]), name
    trainer.close()


def test_a_resumed_full_fine_tuning_keeps_no_momentum_of_steps_past_its_accepted_version(make_config, base_model,
                                                                                         tiny_tokenizer, tmp_path):
    """Full fine-tuning keeps no optimizer state with its versions. A checkpoint written after an unchecked step
    holds that step's AdamW state; it is not the accepted version's, so a rejection after the resume must not
    restore it with the version's weights."""
    config = make_config(method="rl", lora=False, lr=1e-2, checkpoint_every=1, gate_probe_tokens=8, gate=True,
                         gate_every=2)
    db = tmp_path / "store.sqlite"
    store = Store(db)
    for i in range(4):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i % 2 else -1.0)
    first = Trainer(config, store, LocalVersion(), console=None)
    first.run_batch(*store.lease_samples(2))  # step 1: trained and checkpointed, not yet checked
    assert first.step == 1 and first.policy_version == 0
    first.close()
    store.close()

    second = Trainer(config, Store(db), LocalVersion(), console=None)
    resumed = second.resume()
    assert resumed["step"] == 1 and second.accepted is not None and second.accepted.version == 0
    assert second.accepted.optimizer is None  # v0 goes back with a fresh optimizer, not step 1's momentum
    assert second.optimizer.state  # while training itself goes on from the checkpoint's optimizer state
    second.close()


def test_a_restarted_trainer_s_first_check_reads_the_answers_its_predecessor_kept(make_config, base_model,
                                                                                  tiny_tokenizer, tmp_path):
    """``gate_kept_answers``: the starting weights' answers to the shipped probes, kept by one trainer, spare the
    next one (a restart, or another run of the model) asking them; off, every trainer asks them itself."""
    from clawloop.gate import kept_answers

    # The run's own prompts would be asked of the reference in any case: leave them out to see the shipped ones.
    config = make_config(method="rl", lora=True, lr=1e-2, gate_probe_tokens=8, gate=True, gate_recent_prompts=0,
                         gate_fixed_prompts=0)
    store = Store(tmp_path / "store.sqlite")
    for i in range(6):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i % 2 else -1.0)

    first = Trainer(config, store, LocalVersion(), console=None)
    assert first.gate.kept_answers.path.parent == kept_answers.answers_root()
    assert first.run_batch(*store.lease_samples(2))["gate_reference_answers_s"] > 0
    assert len(first.gate.kept_answers) >= len(first.gate.shipped)
    first.close()

    second = Trainer(config, store, LocalVersion(), console=None)
    checked = second.run_batch(*store.lease_samples(2))
    assert checked["gate_s"] > 0 and "gate_reference_answers_s" not in checked
    second.close()

    off = Trainer(config.replace(gate_kept_answers=False), store, LocalVersion(), console=None)
    assert off.gate.kept_answers is None
    assert off.run_batch(*store.lease_samples(2))["gate_reference_answers_s"] > 0
    off.close()
    store.close()


def test_the_trainer_s_gate_keeps_the_last_accepted_verdicts_unless_told_not_to(make_config, tmp_path):
    """``gate_accepted_verdicts`` reaches the gate the trainer checks with (its effect on a check:
    tests/gate/test_gate_memory.py)."""
    config = make_config(method="rl", lora=True, gate=True)
    store = Store(tmp_path / "store.sqlite")
    for setting in (True, False):
        trainer = Trainer(config.replace(gate_accepted_verdicts=setting), store, LocalVersion(), console=None)
        assert trainer.gate.accepted_verdicts is setting
        trainer.close()
    store.close()


def test_a_stop_while_the_store_refuses_the_gates_record_ends_the_step(make_config, base_model, tiny_tokenizer,
                                                                       tmp_path, engine):
    """Every record written after an update is tried until it goes through, unless a stop is asked for: the gate's
    own decision record too, or a full disk during a check would keep a shutdown (and every forget and rollback
    waiting behind the step) waiting for ever."""
    import sqlite3

    from clawloop.trainer.core import CommitNotRecorded

    class NoEvents(Store):
        def record_event(self, *args, **kwargs):
            raise sqlite3.OperationalError("database or disk is full")

    config = make_config(method="rl", lora=True, lr=1e-2, gate_probe_tokens=8, gate=True, gate_min_guard_pass=0.0)
    store = NoEvents(tmp_path / "store.sqlite")
    for i in range(2):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i % 2 else -1.0)
    trainer = Trainer(config, store, engine, console=None, store_backoff=Backoff(1, 0.01))
    asked = []

    def stop_once_trained() -> bool:  # not at the start (the step would not train), from then on
        asked.append(True)
        return len(asked) > 1

    finished = []
    worker = threading.Thread(target=lambda: finished.append(
        pytest.raises(CommitNotRecorded, trainer.run_batch, *store.lease_samples(2), should_stop=stop_once_trained)),
        daemon=True)
    worker.start()
    worker.join(120)
    assert not worker.is_alive() and finished


def test_a_rollback_the_engine_cannot_serve_changes_nothing(make_config, base_model, tiny_tokenizer, tmp_path,
                                                            engine, monkeypatch):
    """The kept version is loaded into the training model before it is served: when serving it fails, the
    training model, its optimizer and the served version stay as they were (training went on from the loaded
    version against the old accepted state, a mix of two lineages)."""
    config = make_config(method="rl", lora=True, lr=1e-2, gate_probe_tokens=8, gate=True)
    store = Store(tmp_path / "store.sqlite")
    for i in range(6):
        add_sample(store, base_model, tiny_tokenizer, i, reward=1.0 if i % 2 else -1.0)
    trainer = Trainer(config, store, engine, console=None)
    trainer.run_batch(*store.lease_samples(2))
    trainer.run_batch(*store.lease_samples(2))
    assert engine.policy_version == 2
    held = {k: v.clone() for k, v in trainable_state_dict(trainer.models).items()}

    def engine_down(*args, **kwargs):
        raise RuntimeError("the engine is restarting")

    monkeypatch.setattr(engine, "publish_sync", engine_down)
    with pytest.raises(RuntimeError, match="restarting"):
        trainer.rollback(1)
    assert trainer.policy_version == 2 and trainer.accepted.version == 2 and engine.policy_version == 2
    for name, value in trainable_state_dict(trainer.models).items():
        assert torch.equal(value, held[name]), name
    assert store.events("rollback") == []
    monkeypatch.undo()
    trainer.run_batch(*store.lease_samples(2))  # training goes on from version 2
    assert engine.policy_version == 3
