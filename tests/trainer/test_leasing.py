"""The one leaser every trainer loop takes its batches from: whole batches, the failed batch's samples retried one
per step, and a sample that keeps failing dropped with a reason."""

from __future__ import annotations

from clawloop.store import SampleRecord, Store, TurnRecord, TurnState
from clawloop.trainer.leasing import BatchLeaser


def _ready_samples(store, n):
    for i in range(n):
        tid = store.add_turn(TurnRecord(session_id=f"s{i}", messages=[{"role": "user", "content": f"q{i}"}],
                                        prompt_ids=[1, 2], response_ids=[5, 2], logprobs=[-0.1, -0.2],
                                        temperature=1.0, top_p=1.0, policy_version=0))
        store.set_next_state(tid, [{"role": "user", "content": "thanks"}])
        store.claim_judgeable(1)
        store.put_sample(SampleRecord(turn_id=tid, reward=1.0, kind="rl"))


def test_whole_batches_only_unless_partial(tmp_path):
    store = Store(tmp_path / "store.sqlite")
    _ready_samples(store, 5)
    leaser = BatchLeaser(store, 4)
    lease_id, first = leaser.lease()
    assert len(first) == 4
    store.commit_step(lease_id, 1, 1, {}, [s.turn_id for s in first])
    leaser.succeeded(first)
    assert leaser.lease() == ("", [])  # one ready sample is not a batch
    assert len(BatchLeaser(store, 4, partial=True).lease()[1]) == 1  # offline's last, smaller step


def test_a_failed_batch_is_retried_one_sample_a_step_and_a_sample_failing_again_is_dropped(tmp_path):
    store = Store(tmp_path / "store.sqlite")
    _ready_samples(store, 3)
    leaser = BatchLeaser(store, 3, max_sample_failures=2)
    lease_id, batch = leaser.lease()
    assert leaser.failed(lease_id, batch) == 3 and leaser.quarantine == 3
    lease_id, (bad,) = leaser.lease()  # one per step now, oldest first
    assert bad.turn_id == batch[0].turn_id
    assert leaser.failed(lease_id, [bad]) == 0  # its second failure: dropped, with the reason recorded
    dropped = store.get_turn(bad.turn_id)
    assert dropped.state == TurnState.DROPPED and dropped.reason == "train_error"
    for step in (1, 2):  # the other two go through one at a time, then batches resume
        lease_id, (good,) = leaser.lease()
        store.commit_step(lease_id, step, step, {}, [good.turn_id])
        leaser.succeeded([good])
    assert leaser.quarantine == 0 and leaser.lease() == ("", [])
