"""The durable store: state transitions, exactly-once samples, leases, resume accounting, append-only export."""

import json
import os
import sqlite3
import threading
import time

import pytest
import torch

from clawloop.store import LeaseLost, SampleRecord, Store, TurnRecord, TurnState, VoteRecord


def make_turn(session="s", index=0, n=3):
    return TurnRecord(session_id=session, turn_index=index, messages=[{"role": "user", "content": "héllo"}],
                      prompt_ids=[1, 2, 3], response_ids=list(range(10, 10 + n)), logprobs=[-0.5] * n,
                      temperature=0.6, top_p=0.95, policy_version=2, response_text="abc",
                      assistant_message={"role": "assistant", "content": "abc"})


def judged_sample(store, tid, **kw):
    assert store.set_next_state(tid, [{"role": "user", "content": "thanks"}])
    (turn,) = store.claim_judgeable(1)
    assert turn.id == tid
    return store.put_sample(SampleRecord(turn_id=tid, reward=1.0, kind="rl", **kw))


def test_turn_round_trip_survives_reopen(tmp_path):
    path = tmp_path / "run.db"
    store = Store(path)
    tid = store.add_turn(make_turn())
    store.close()
    turn = Store(path).get_turn(tid)
    assert turn.response_ids == [10, 11, 12] and turn.prompt_ids == [1, 2, 3]
    assert turn.logprobs == [-0.5] * 3 and turn.messages[0]["content"] == "héllo"
    assert turn.state == TurnState.AWAITING_NEXT and turn.policy_version == 2


def test_next_state_only_once_and_drop_records_reason(tmp_path):
    store = Store(tmp_path / "run.db")
    a, b = store.add_turn(make_turn(index=0)), store.add_turn(make_turn(index=1))
    assert store.set_next_state(a, [{"role": "tool", "content": "ok"}])
    assert not store.set_next_state(a, [{"role": "user", "content": "again"}])
    assert store.get_turn(a).next_state == [{"role": "tool", "content": "ok"}]
    assert store.drop_turn(b, "no_next_state")
    assert store.get_turn(b).state == TurnState.DROPPED
    assert store.drop_reasons() == {"no_next_state": 1}


def test_a_turn_gives_at_most_one_sample_even_under_races(tmp_path):
    store = Store(tmp_path / "run.db")
    ids = [store.add_turn(make_turn(index=i)) for i in range(20)]
    for tid in ids:
        store.set_next_state(tid, [{"role": "user", "content": "ok"}])
    claimed: list[int] = []
    lock = threading.Lock()

    def worker():
        while batch := store.claim_judgeable(2):
            with lock:
                claimed.extend(t.id for t in batch)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed) == ids  # every turn claimed by exactly one worker
    assert all(store.put_sample(SampleRecord(turn_id=t, reward=1.0, kind="rl")) for t in ids)
    assert not any(store.put_sample(SampleRecord(turn_id=t, reward=1.0, kind="rl")) for t in ids)
    assert store.ready_count() == 20


def test_targets_tensors_round_trip(tmp_path):
    store = Store(tmp_path / "run.db")
    tid = store.add_turn(make_turn())
    targets = {"teacher_ids_C_T_K": torch.arange(24).view(2, 3, 4),
               "teacher_logprobs_C_T_K": torch.randn(2, 3, 4)}
    assert judged_sample(store, tid, targets=targets, hints=["be brief"])
    _, (sample,) = store.lease_samples(5)
    assert sample.hints == ["be brief"]
    for k, v in targets.items():
        assert torch.equal(sample.targets[k], v) and sample.targets[k].dtype == v.dtype


def test_lease_commit_expire_and_requeue(tmp_path):
    store = Store(tmp_path / "run.db")
    ids = [store.add_turn(make_turn(index=i)) for i in range(6)]
    for tid in ids:
        judged_sample(store, tid)
    lease, none = store.lease_samples(4, min_n=10)
    assert none == [] and store.ready_count() == 6
    lease, batch = store.lease_samples(4)
    assert [s.turn_id for s in batch] == ids[:4]
    store.commit_step(lease, step=1, policy_version=1, metrics={"loss": 0.5}, turn_ids=ids[:4])
    assert store.count_samples() == {"consumed": 4, "ready": 2}
    # A lease that expires (its trainer died) goes back to the queue; the dead lease cannot commit.
    lease2, batch2 = store.lease_samples(2, lease_s=0.01)
    time.sleep(0.05)
    lease3, batch3 = store.lease_samples(2)
    assert [s.turn_id for s in batch3] == [s.turn_id for s in batch2]
    try:
        store.commit_step(lease2, 2, 2, {}, [s.turn_id for s in batch2])
        raise AssertionError("a lost lease must not commit")
    except LeaseLost:
        pass
    store.commit_step(lease3, 2, 2, {}, [s.turn_id for s in batch3])
    assert store.count_samples() == {"consumed": 6}
    # Resuming from the checkpoint of step 1 makes the samples of step 2 trainable again, and only those.
    assert store.requeue_after_step(1) == 2
    assert store.count_samples() == {"consumed": 4, "ready": 2}
    # Nothing is deleted: the lost step keeps its row, marked requeued, a copy records the requeue, and the
    # requeue is an event.
    assert [(s["step"], s["requeued"]) for s in store.steps()] == [(1, False), (2, True)]
    assert [s["step"] for s in store.steps(in_weights_only=True)] == [1]
    (lost,) = store.requeued_steps()
    assert lost["step"] == 2 and sorted(lost["turn_ids"]) == sorted(s.turn_id for s in batch3)
    assert lost["resumed_from_step"] == 1
    (event,) = store.events("requeue")
    assert event["detail"]["steps"] == [2] and sorted(event["detail"]["turn_ids"]) == sorted(lost["turn_ids"])


def test_recover_puts_interrupted_work_back(tmp_path):
    path = tmp_path / "run.db"
    store = Store(path)
    a, b = store.add_turn(make_turn(index=0)), store.add_turn(make_turn(index=1))
    judged_sample(store, a)
    store.set_next_state(b, [{"role": "user", "content": "no"}])
    store.claim_judgeable(1)  # b is being judged when the process dies
    store.lease_samples(1)  # a is leased by a trainer that dies
    store.close()
    store = Store(path)
    assert store.recover() == {"judging_to_judgeable": 1, "leased_to_ready": 1}
    assert store.get_turn(b).state == TurnState.JUDGEABLE
    assert store.get_turn(a).state == TurnState.READY and store.ready_count() == 1


def test_export_appends_never_truncates(tmp_path):
    store = Store(tmp_path / "run.db")
    tid = store.add_turn(make_turn())
    store.add_votes([VoteRecord(turn_id=tid, kind="eval", index=0, score=1, raw_text="\\boxed{1}")])
    out = tmp_path / "export"
    assert store.export_jsonl(out) == {"turns.jsonl": 1}
    store.export_jsonl(out)
    lines = (out / "turns.jsonl").read_text().splitlines()
    assert len(lines) == 2
    rec = json.loads(lines[0])
    assert rec["response_ids"] == [10, 11, 12] and rec["votes"][0]["raw_text"] == "\\boxed{1}"


def test_recover_works_once_per_opened_store(tmp_path):
    # The server recovers the store it opens, then starts its pipeline, which recovers too: the second call must
    # not take back what this process has started since (a lease of its own trainer, a turn being judged).
    path = tmp_path / "run.db"
    store = Store(path)
    a, b = store.add_turn(make_turn(index=0)), store.add_turn(make_turn(index=1))
    judged_sample(store, a)
    store.lease_samples(1)
    store.close()
    store = Store(path)
    assert store.recover() == {"judging_to_judgeable": 0, "leased_to_ready": 1}
    lease_id, (sample,) = store.lease_samples(1)
    store.set_next_state(b, [{"role": "user", "content": "no"}])
    store.claim_judgeable(1)
    assert store.recover() == {"judging_to_judgeable": 0, "leased_to_ready": 0}
    assert store.get_turn(a).state == TurnState.LEASED and store.get_turn(b).state == TurnState.JUDGING
    assert store.extend_lease(lease_id, 60.0) == 1
    store.close()
    assert Store(path).recover() == {"judging_to_judgeable": 1, "leased_to_ready": 1}  # a new process: recovered


def test_a_locked_database_is_not_a_lost_lease(tmp_path):
    # Only a lost lease raises LeaseLost: a write that fails for another reason (here another process holds the
    # write lock) raises its own error, changes nothing, and succeeds once the lock is gone, under the same lease.
    path = tmp_path / "run.db"
    store = Store(path, busy_timeout_s=0.05)
    ids = [store.add_turn(make_turn(index=i)) for i in range(2)]
    for tid in ids:
        judged_sample(store, tid)
    lease, batch = store.lease_samples(2)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        store.commit_step(lease, 1, 1, {}, ids)
        raise AssertionError("a locked database must not commit")
    except LeaseLost:
        raise AssertionError("a locked database is not a lost lease")
    except sqlite3.OperationalError as e:
        assert "locked" in str(e)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert store.count_samples() == {"leased": 2} and store.steps() == []
    store.commit_step(lease, 1, 1, {}, ids)
    assert store.count_samples() == {"consumed": 2}


def test_a_turn_is_in_its_samples_state_through_every_move(tmp_path):
    store = Store(tmp_path / "run.db")
    a, b = store.add_turn(make_turn(index=0)), store.add_turn(make_turn(index=1))
    judged_sample(store, a)
    judged_sample(store, b)

    def both(tid):
        return store.get_turn(tid).state, store.get_sample(tid).state

    assert both(a) == (TurnState.READY, TurnState.READY)
    lease, _ = store.lease_samples(2)
    assert both(a) == both(b) == (TurnState.LEASED, TurnState.LEASED)
    assert store.drop_leased_sample(b, "stale", lease_id=lease)
    assert both(b) == (TurnState.DROPPED, TurnState.DROPPED) and store.get_turn(b).reason == "stale"
    store.commit_step(lease, 1, 1, {}, [a])
    assert both(a) == (TurnState.CONSUMED, TurnState.CONSUMED)
    assert store.requeue_after_step(0) == 1
    assert both(a) == (TurnState.READY, TurnState.READY) and store.get_sample(a).consumed_step is None


def test_the_sample_kind_has_its_own_place_and_old_stores_move_it_there(tmp_path):
    path = tmp_path / "run.db"
    store = Store(path)
    kept, dropped = store.add_turn(make_turn(index=0)), store.add_turn(make_turn(index=1))
    judged_sample(store, kept)
    judged_sample(store, dropped)
    lease, _ = store.lease_samples(2)
    store.drop_leased_sample(dropped, "too_long", lease_id=lease)
    turn = store.get_turn(kept)
    assert (turn.sample_kind, turn.reason) == ("rl", "")
    store.close()
    # A store written before: the kind was copied into turns.reason when the sample was written.
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("UPDATE turns SET reason='rl' WHERE id=?", (kept,))
    raw.execute("DELETE FROM meta WHERE key != 'schema_version'")
    raw.close()
    old = Store(path, readonly=True)  # a reader changes nothing, and still reads the kind from the sample
    assert old.get_turn(kept).sample_kind == "rl" and old.get_turn(kept).reason == "rl"
    old.close()
    store = Store(path)
    assert [(t.sample_kind, t.reason) for t in store.turns()] == [("rl", ""), ("rl", "too_long")]
    assert store.drop_reasons() == {"too_long": 1}


def test_one_process_at_a_time_holds_a_run_folder(tmp_path):
    """The run lock: a second holder is refused with the first one's pid until the first lets go; a writable
    store opened through the run folder holds it until the store is closed."""
    from clawloop.run_folder import RunFolderError, open_run_store
    from clawloop.store.run_lock import RunInUse, hold_run

    first = hold_run(tmp_path)
    with pytest.raises(RunInUse) as refused:
        hold_run(tmp_path)
    assert refused.value.holder == os.getpid() and "this process already serves or trains" in str(refused.value)
    first.release()
    store = open_run_store(tmp_path)
    with pytest.raises(RunFolderError, match="This process already serves or trains in"):
        open_run_store(tmp_path)
    store.close()
    open_run_store(tmp_path).close()  # free again once the store is closed
