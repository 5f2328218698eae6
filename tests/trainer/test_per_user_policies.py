"""Per-user policies over one training model (``trainer.per_user.UserPolicies``): each user's adapter and optimizer
state are their own however their steps interleave, and the user trained longest ago goes first."""

from __future__ import annotations

import time

import pytest
import torch

from clawloop.engines.hf import HFEngine
from clawloop.gate.scoring import answer_logprobs
from clawloop.store import Store
from clawloop.trainer.core import Trainer
from clawloop.trainer.model import trainable_state_dict
from clawloop.trainer.per_user import OwnerSamples, UserPolicies, user_dir
from trainer_helpers import add_owned_sample

ALICE, BOB = "k_alice", "k_bob"
ALICE_SAMPLES = [("What is rain?", "Water falling from clouds.", 1.0), ("What is snow?", "Snow snow snow.", -1.0),
                 ("What is wind?", "Moving air.", 1.0), ("What is fog?", "Fog fog fog fog.", -1.0)]
BOB_SAMPLES = [("Name a fish.", "A trout.", 1.0), ("Name a bird.", "Bird bird bird.", -1.0)]


def per_user_config(make_config, **overrides):
    return make_config(lora=True, policy_scope="per_user", api_keys=["a", "b"], method="rl", lr=1e-2,
                       seed=0, staleness_mode="ignore", **overrides)


def train_next(policies: UserPolicies, store: Store, owner: str) -> None:
    lease_id, samples = store.lease_samples(2, owner=owner)
    assert len(samples) == 2
    assert policies.run_batch(owner, lease_id, samples) is not None


def test_interleaved_users_train_exactly_as_if_each_were_alone(make_config, tiny_model_path, tiny_tokenizer,
                                                               tmp_path):
    config = per_user_config(make_config)
    store = Store(tmp_path / "run" / "store.sqlite")
    for sample in ALICE_SAMPLES:
        add_owned_sample(store, tiny_tokenizer, ALICE, *sample)
    for sample in BOB_SAMPLES:
        add_owned_sample(store, tiny_tokenizer, BOB, *sample)
    engine = HFEngine(str(tiny_model_path), device="cpu", adapter_slots=2, num_threads=1)
    try:
        policies = UserPolicies(config, store, engine, run_dir=tmp_path / "run", console=None)
        train_next(policies, store, ALICE)
        train_next(policies, store, BOB)  # Bob's step runs on the same model, between Alice's two
        train_next(policies, store, ALICE)
        policies.activate(ALICE)
        alice = trainable_state_dict(policies.models)
        versions = store.versions()
        assert [(v["owner"], v["step"]) for v in versions] == [(ALICE, 1), (BOB, 2), (ALICE, 3)]
        assert engine.adapter_version(ALICE) == versions[2]["version"]
        assert engine.adapter_version(BOB) == versions[1]["version"]
        assert [s["owner"] for s in store.steps()] == [ALICE, BOB, ALICE]
        assert (user_dir(tmp_path / "run", ALICE) / "versions").is_dir()
        policies.close()
    finally:
        engine.close_sync()
        store.close()

    # Alice alone: her two batches, in order, on a trainer of her own from the same starting adapter.
    alone_store = Store(tmp_path / "alone" / "store.sqlite")
    try:
        for sample in ALICE_SAMPLES:
            add_owned_sample(alone_store, tiny_tokenizer, ALICE, *sample)
        trainer = Trainer(config, alone_store, run_dir=tmp_path / "alone", console=None)
        for _ in range(2):
            lease_id, samples = alone_store.lease_samples(2)
            assert trainer.run_batch(lease_id, samples) is not None
        expected = trainable_state_dict(trainer.models)
        trainer.close()
    finally:
        alone_store.close()
    assert alice.keys() == expected.keys()
    for key in expected:
        assert torch.equal(alice[key], expected[key]), key


def test_the_user_trained_longest_ago_goes_first(make_config, tiny_model_path, tiny_tokenizer, tmp_path):
    config = per_user_config(make_config, rollout_batch_size=4, batch_wait_s=60.0)
    store = Store(tmp_path / "run" / "store.sqlite")
    for sample in ALICE_SAMPLES * 2:
        add_owned_sample(store, tiny_tokenizer, ALICE, sample[0] + "?", *sample[1:])
    add_owned_sample(store, tiny_tokenizer, BOB, *BOB_SAMPLES[0])
    try:
        policies = UserPolicies(config, store, engine=None, run_dir=tmp_path / "run", console=None)
        now = time.time()
        assert policies.next_owner(now, idle=lambda: False) == (ALICE, True)  # Bob's one sample waits for its batch...
        assert policies.next_owner(now + 61, idle=lambda: False) == (ALICE, True)  # ...Alice was never trained either
        policies.last_trained[ALICE] = now
        assert policies.next_owner(now + 61, idle=lambda: False) == (BOB, False)  # ...then Bob, once his sample waited
        assert policies.next_owner(now + 1, idle=lambda: False) == (ALICE, True)
        assert policies.next_owner(now + 1, idle=lambda: True) == (BOB, False)  # an idle run trains what is ready
        policies.close()
    finally:
        store.close()


def test_a_users_gate_probes_only_that_users_prompts(tiny_tokenizer, tmp_path):
    """Another user's prompts neither check (nor steer) a user's adapter, nor land in its gate evidence."""
    store = Store(tmp_path / "store.sqlite")
    try:
        for sample in ALICE_SAMPLES:
            add_owned_sample(store, tiny_tokenizer, ALICE, *sample)
        for sample in BOB_SAMPLES:
            add_owned_sample(store, tiny_tokenizer, BOB, *sample)
        everyone = {messages[0]["content"] for _, _, messages in store.recent_prompts(8)}
        alices = {messages[0]["content"] for _, _, messages in OwnerSamples(store, ALICE).recent_prompts(8)}
        assert everyone == {q for q, _, _ in ALICE_SAMPLES + BOB_SAMPLES}
        assert alices == {q for q, _, _ in ALICE_SAMPLES}
        # Corrected prompts: only those trained into the user's own accepted versions.
        lease_id, samples = store.lease_samples(2, owner=BOB)
        store.commit_step(lease_id, 1, 1, {}, [s.turn_id for s in samples], owner=BOB)
        store.record_version(1, 1, "accepted", {}, owner=BOB)
        assert OwnerSamples(store, ALICE).recent_prompts(8, corrected=True) == []
        assert [m[0]["content"] for _, _, m in OwnerSamples(store, BOB).recent_prompts(8, corrected=True)] == \
            ["Name a bird."]  # the -1 one
    finally:
        store.close()


def test_a_restart_over_users_training_is_refused_unless_resumed_or_fresh(tmp_path):
    from clawloop.run_folder import RunFolderError, prepare_training_state
    from clawloop.trainer.versions import save_version

    run_dir = tmp_path / "run"
    store = Store(run_dir / "store.sqlite")
    try:
        save_version(user_dir(run_dir, ALICE), 0, 0, {"w": torch.zeros(2)}, None, lora=True)
        prepare_training_state(store, run_dir, resume=False, fresh=False)  # only the starting weights: fine
        save_version(user_dir(run_dir, ALICE), 3, 3, {"w": torch.ones(2)}, None, lora=True)
        with pytest.raises(RunFolderError, match="1 user"):
            prepare_training_state(store, run_dir, resume=False, fresh=False)
        prepare_training_state(store, run_dir, resume=False, fresh=True)
        (archive,) = (run_dir / "archive").iterdir()
        assert (archive / "users" / ALICE / "versions" / "v3").is_dir() and not (run_dir / "users").exists()
    finally:
        store.close()


def test_every_users_gate_shares_the_reference_kept_prompt_states(make_config, tiny_model_path, tmp_path):
    # One set of states for the one starting weights: every user's gate reads the same shipped probes under them.
    store = Store(tmp_path / "run" / "store.sqlite")
    engine = HFEngine(str(tiny_model_path), device="cpu", adapter_slots=2, num_threads=1)
    try:
        for tokens, run in ((4096, "run"), (0, "off")):
            config = per_user_config(make_config, gate=True, gate_prompt_state_tokens=tokens)
            policies = UserPolicies(config, store, engine, run_dir=tmp_path / run, console=None)
            alice, bob = policies.activate(ALICE).gate, policies.activate(BOB).gate
            if tokens:
                states = alice.prompt_states
                assert states is not None and states is bob.prompt_states and states.max_tokens == tokens
                # States made from a user's prompts do not outlive the user: a forget drops them all.
                prompt = alice.probe_set()[0].ids
                answer_logprobs(policies.models.causal_lm, [prompt], [prompt[-3:]], states=states)
                assert states.tokens == len(prompt)
                policies.forget(ALICE)
                assert states.tokens == 0 and states.nbytes == 0
            else:
                assert alice.prompt_states is None and bob.prompt_states is None
            policies.close()
    finally:
        engine.close_sync()
        store.close()


def test_a_rollback_of_a_user_forgotten_meanwhile_recreates_nothing(make_config, tiny_model_path, tiny_tokenizer,
                                                                    tmp_path):
    """The route found the user's folder, then waited for the model while their forget ran: the rollback is
    refused instead of making a trainer, a folder and an adapter for a forgotten name."""
    import shutil

    config = per_user_config(make_config)
    store = Store(tmp_path / "run" / "store.sqlite")
    for sample in BOB_SAMPLES:
        add_owned_sample(store, tiny_tokenizer, BOB, *sample)
    engine = HFEngine(str(tiny_model_path), device="cpu", adapter_slots=2, num_threads=1)
    try:
        policies = UserPolicies(config, store, engine, run_dir=tmp_path / "run", console=None)
        train_next(policies, store, BOB)
        policies.forget(BOB)  # what the forget does while it holds the model
        shutil.rmtree(user_dir(tmp_path / "run", BOB))
        with pytest.raises(FileNotFoundError, match="no policy of their own"):
            policies.rollback(BOB, 0)
        assert not user_dir(tmp_path / "run", BOB).exists() and BOB not in policies.trainers
        policies.close()
    finally:
        engine.close_sync()
        store.close()
