"""After ``clawloop forget`` under the shared policy, training rebuilds weights that never saw the user: bit for bit
the weights of a run that never had their samples, trained on the same remaining samples in the same order."""

import torch

from clawloop.config import Config
from clawloop.store import Store
from clawloop.trainer.checkpoint import load_latest
from clawloop.trainer.forget import forget_user
from clawloop.trainer.offline import train_offline
from trainer_helpers import add_owned_sample

ALICE, BOB = "k_alice", "k_bob"


BOB_SAMPLES = [("What is rain?", "Water falling from clouds.", 1.0),
               ("What is snow?", "Snow is snow is snow.", -1.0),
               ("What is wind?", "Moving air.", 1.0),
               ("What is fog?", "Fog fog fog fog.", -1.0),
               ("What is hail?", "Ice falling from clouds.", 1.0)]
ALICE_SAMPLE = ("What is Zanzibar-quartz?", "Zanzibar-quartz is mine.", 1.0)


def config(run_dir) -> Config:
    # Staleness is counted in version numbers, and the retired versions keep theirs: a sample trained again after
    # the forget looks older than in a run that never had the user, and past max_staleness it would be importance-
    # corrected where that run's is not (measured: one sample of the last step, weights apart by 1.4e-4). The
    # comparison is of the replay itself, so staleness plays no part here.
    return Config(model="tiny", device="cpu", num_threads=1, method="rl", rollout_batch_size=2, gate=False,
                  lora=True, seed=0, checkpoint_every=1, metrics_backends=[], run_dir=str(run_dir),
                  staleness_mode="ignore")


def train(run_dir) -> None:
    train_offline(config(run_dir), run_dir, console=None)


def test_weights_rebuilt_after_a_forget_equal_a_run_that_never_had_the_user(tmp_path, tiny_tokenizer):
    # Run A: Bob's first two samples, then Alice's with Bob's third, then Bob's last two, a step each time.
    run_a = tmp_path / "a"
    store = Store(run_a / "store.sqlite")
    for question, answer, reward in BOB_SAMPLES[:2]:
        add_owned_sample(store, tiny_tokenizer, BOB, question, answer, reward)
    store.close()
    train(run_a)
    store = Store(run_a / "store.sqlite")
    add_owned_sample(store, tiny_tokenizer, ALICE, *ALICE_SAMPLE)
    add_owned_sample(store, tiny_tokenizer, BOB, *BOB_SAMPLES[2])
    store.close()
    train(run_a)
    store = Store(run_a / "store.sqlite")
    for question, answer, reward in BOB_SAMPLES[3:]:
        add_owned_sample(store, tiny_tokenizer, BOB, question, answer, reward)
    store.close()
    train(run_a)
    trained_with_alice = load_latest(run_a).weights
    store = Store(run_a / "store.sqlite")
    receipt = forget_user(store, run_a, ALICE)
    store.close()
    assert receipt["steps"] == [2] and receipt["retired_versions"]
    train(run_a)  # the next start: resumes from what is left and trains Bob's requeued samples again

    # Run B never had Alice: Bob's samples in the order they were made.
    run_b = tmp_path / "b"
    store = Store(run_b / "store.sqlite")
    for question, answer, reward in BOB_SAMPLES:
        add_owned_sample(store, tiny_tokenizer, BOB, question, answer, reward)
    store.close()
    train(run_b)

    rebuilt, never = load_latest(run_a).weights, load_latest(run_b).weights
    assert rebuilt.keys() == never.keys()
    assert all(torch.equal(rebuilt[k], never[k]) for k in never)
    assert not all(torch.equal(trained_with_alice[k], never[k]) for k in never)  # her sample had moved them
